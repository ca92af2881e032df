/* Click-through-rate data: the Criteo TSV reader and writer, and the
 * synthetic click logs with a known ground truth (see data_ctr.h).
 *
 * The reader parses line by line into arrays that grow geometrically (no
 * allocation per line); a file is read through zlib in 1 MiB pieces, so a
 * gzip file and a plain one take the same path and max_rows stops reading
 * early. The generator's every draw comes from counter-based hashes of
 * (seed, example, field), so any slice of the log is computed alone. */
#include "worker/data/data_ctr.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "common/util.h"

/* ---- hashing ---- */

#define GOLDEN 0x9e3779b97f4a7c15ull

/* The splitmix64 finalizer: a bijection of 64-bit words that mixes well. */
static inline uint64_t ctr__mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t ps_ctr_feature_id(int field, const char *value, size_t len) {
  /* The field and the length open the hash, so "" differs from "\0" and
   * field 3's "a" from field 4's; then each 8-byte word goes through the
   * bijection, so two values of up to 8 bytes of one field and length
   * never collide. */
  uint64_t h = ctr__mix(0x637472666964ull + (uint64_t)(uint32_t)field * GOLDEN +
                        (uint64_t)len * 0xd6e8feb86659fd93ull);
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, value, 8);
    h = ctr__mix(h ^ w);
    value += 8;
    len -= 8;
  }
  if (len) {
    uint64_t w = 0;
    memcpy(&w, value, len);
    h = ctr__mix(h ^ w);
  }
  return h ? h : 1;
}

float ps_ctr_dense_value(int64_t x) {
  /* -x cannot overflow: the reader takes at most 18 digits, and the
   * writer's counts are small; INT64_MIN is taken as INT64_MIN + 1. */
  if (x >= 0) return (float)log1p((double)x);
  if (x == INT64_MIN) x++;
  return (float)-log1p((double)-x);
}

/* ---- the reader ---- */

/* Widths of a field at its longest: a dense integer ('-' and 18 digits),
 * a categorical value, the truth column. */
#define DENSE_MAX_CHARS 19
#define DENSE_MAX_DIGITS 18
#define CAT_MAX_CHARS 8
#define TRUTH_MAX_CHARS 32
#define READ_CHUNK (1u << 20)
/* Counts below this take their dense value from a table. */
#define DENSE_TABLE 4096

typedef struct {
  const char *name;
  int n_dense, n_cat;
  int64_t max_rows;
  int64_t line;    /* the number of the line being parsed, from 1 */
  size_t max_line; /* the longest valid line, its line end not counted */
  int truth_col;   /* -1: not known yet (no line read); 0 no; 1 yes */
  int64_t cap;     /* examples the arrays hold room for */
  ps_ctr_data d;
  float dense_small[DENSE_TABLE]; /* ps_ctr_dense_value(c) of the common counts */
} ctr__reader;

static int ctr__check_shape(int n_dense, int n_cat, char *err) {
  if (n_dense < 0 || n_cat < 0 || n_dense > PS_CTR_MAX_FIELDS || n_cat > PS_CTR_MAX_FIELDS ||
      n_dense + n_cat == 0)
    return ps_seterr(err, PS_EINVAL,
                     "CTR data of %d dense and %d categorical fields: each must be in [0, %d], "
                     "and not both 0",
                     n_dense, n_cat, PS_CTR_MAX_FIELDS);
  return PS_OK;
}

static void ctr__reader_init(ctr__reader *r, const char *name, int n_dense, int n_cat,
                             int64_t max_rows) {
  memset(r, 0, sizeof *r);
  r->name = name ? name : "(text)";
  r->n_dense = n_dense;
  r->n_cat = n_cat;
  r->max_rows = max_rows;
  r->max_line = 1 + (size_t)n_dense * (1 + DENSE_MAX_CHARS) + (size_t)n_cat * (1 + CAT_MAX_CHARS) +
                1 + TRUTH_MAX_CHARS;
  r->truth_col = -1;
  r->d.n_dense = n_dense;
  r->d.n_cat = n_cat;
  for (int c = 0; c < DENSE_TABLE; c++) r->dense_small[c] = ps_ctr_dense_value(c);
}

/* realloc to `count` elements of `size` bytes, at least 1 byte. */
static int ctr__grow(void **p, int64_t count, size_t size) {
  size_t bytes = (size_t)count * size;
  void *q = realloc(*p, bytes ? bytes : 1);
  if (!q) return -1;
  *p = q;
  return 0;
}

/* Room for `need` examples: the arrays double (or take `need` when that is
 * more), so reading n lines costs O(log n) reallocations. */
static int ctr__reserve(ctr__reader *r, int64_t need, char *err) {
  if (need <= r->cap) return PS_OK;
  int64_t cap = r->cap ? r->cap * 2 : 4096;
  if (r->max_rows > 0 && cap > r->max_rows) cap = r->max_rows;
  if (cap < need) cap = need;
  /* the largest array is ids: n_cat * 8 bytes an example */
  size_t per = (size_t)(r->n_cat > r->n_dense ? r->n_cat : r->n_dense) * 8;
  if ((uint64_t)cap > SIZE_MAX / (per ? per : 8))
    return ps_seterr(err, PS_ENOMEM, "'%s': too many examples for memory (%lld)", r->name,
                     (long long)cap);
  ps_ctr_data *d = &r->d;
  if (ctr__grow((void **)&d->dense, cap * d->n_dense, sizeof(float)) ||
      ctr__grow((void **)&d->ids, cap * d->n_cat, sizeof(uint64_t)) ||
      ctr__grow((void **)&d->labels, cap, sizeof(float)) ||
      (r->truth_col == 1 && ctr__grow((void **)&d->truth, cap, sizeof(float))))
    return ps_seterr(err, PS_ENOMEM, "'%s': out of memory for %lld examples", r->name,
                     (long long)cap);
  r->cap = cap;
  return PS_OK;
}

/* Gives the arrays back the room they hold beyond n (a failure to shrink
 * leaves them as they are). */
static void ctr__shrink(ctr__reader *r) {
  ps_ctr_data *d = &r->d;
  if (d->n == r->cap || d->n == 0) return;
  ctr__grow((void **)&d->dense, d->n * d->n_dense, sizeof(float));
  ctr__grow((void **)&d->ids, d->n * d->n_cat, sizeof(uint64_t));
  ctr__grow((void **)&d->labels, d->n, sizeof(float));
  if (d->truth) ctr__grow((void **)&d->truth, d->n, sizeof(float));
  r->cap = d->n;
}

/* The name of field k of a line (0: the label), for messages. */
static void ctr__field_name(const ctr__reader *r, int k, char *buf, size_t len) {
  if (k == 0)
    snprintf(buf, len, "label");
  else if (k <= r->n_dense)
    snprintf(buf, len, "I%d", k);
  else if (k <= r->n_dense + r->n_cat)
    snprintf(buf, len, "C%d", k - r->n_dense);
  else
    snprintf(buf, len, "truth");
}

/* A message about field k whose text is [s, e): names file, line, field. */
static int ctr__bad_field(const ctr__reader *r, int k, const char *s, const char *e,
                          const char *want, char *err) {
  char field[16];
  ctr__field_name(r, k, field, sizeof field);
  int shown = e - s > 24 ? 24 : (int)(e - s);
  return ps_seterr(err, PS_EINVAL, "'%s' line %lld: field %d (%s) is '%.*s%s'; wants %s", r->name,
                   (long long)r->line, k + 1, field, shown, s, e - s > shown ? "..." : "", want);
}

static int ctr__bad_count(const ctr__reader *r, const char *p, size_t len, char *err) {
  size_t fields = 1;
  for (size_t i = 0; i < len; i++) fields += p[i] == '\t';
  int want = 1 + r->n_dense + r->n_cat;
  if (r->truth_col == 1)
    return ps_seterr(err, PS_EINVAL,
                     "'%s' line %lld: %zu fields; wants %d (label, %d integer, %d categorical "
                     "and the truth column that line 1 has)",
                     r->name, (long long)r->line, fields, want + 1, r->n_dense, r->n_cat);
  return ps_seterr(
      err, PS_EINVAL,
      "'%s' line %lld: %zu fields; wants %d (label, %d integer and %d categorical, "
      "TAB-separated)%s",
      r->name, (long long)r->line, fields, want, r->n_dense, r->n_cat,
      r->truth_col == 0 && fields == (size_t)want + 1 ? "; line 1 has no truth column" : "");
}

/* A decimal integer, '-' allowed, 1 to DENSE_MAX_DIGITS digits. */
static int ctr__parse_int(const char *s, const char *e, int64_t *out) {
  int neg = 0;
  if (s < e && *s == '-') {
    neg = 1;
    s++;
  }
  if (s == e || e - s > DENSE_MAX_DIGITS) return -1;
  int64_t v = 0;
  for (; s < e; s++) {
    unsigned dgt = (unsigned)(unsigned char)*s - '0';
    if (dgt > 9) return -1;
    v = v * 10 + (int64_t)dgt;
  }
  *out = neg ? -v : v;
  return 0;
}

/* The truth column: a decimal in [0, 1]. */
static int ctr__parse_prob(const char *s, const char *e, float *out) {
  char buf[TRUTH_MAX_CHARS + 1];
  if (s == e || e - s > TRUTH_MAX_CHARS) return -1;
  memcpy(buf, s, (size_t)(e - s));
  buf[e - s] = '\0';
  char *end;
  double v = strtod(buf, &end);
  if (*end || !(v >= 0.0 && v <= 1.0)) return -1;
  *out = (float)v;
  return 0;
}

/* Whether the line has as many fields as the file's lines want. */
static int ctr__count_ok(const ctr__reader *r, const char *p, size_t len) {
  size_t tabs = 0, want = (size_t)(r->n_dense + r->n_cat);
  for (size_t c = 0; c < len; c++) tabs += p[c] == '\t';
  return tabs == want + (r->truth_col == 1) || (r->truth_col < 0 && tabs == want + 1);
}

static int ctr__fields(ctr__reader *r, const char *p, size_t len, char *err);

/* Parses one line (its line end removed, a CR still there) into example
 * d.n, which the arrays have room for. */
static int ctr__line(ctr__reader *r, const char *p, size_t len, char *err) {
  if (len && p[len - 1] == '\r') len--;
  if (len > r->max_line)
    return ps_seterr(err, PS_EINVAL,
                     "'%s' line %lld: %zu bytes, longer than a line of a label, %d integer and "
                     "%d categorical fields can be (%zu); not Criteo TSV?",
                     r->name, (long long)r->line, len, r->n_dense, r->n_cat, r->max_line);
  int rc = ctr__fields(r, p, len, err);
  /* A line of another shape gets that said, not a complaint about
   * whichever field came out misplaced. */
  if (rc == PS_EINVAL && !ctr__count_ok(r, p, len)) rc = ctr__bad_count(r, p, len, err);
  if (rc == 0) r->d.n++;
  return rc;
}

/* Parses the fields of a line of at most max_line bytes into example d.n. */
static int ctr__fields(ctr__reader *r, const char *p, size_t len, char *err) {
  const char *end = p + len, *s = p;
  int64_t i = r->d.n;
  float *dense = r->d.dense + i * r->n_dense;
  uint64_t *ids = r->d.ids + i * r->n_cat;
  int fields = 1 + r->n_dense + r->n_cat;
  int more = 1; /* whether a field starts at s */
  for (int k = 0; k < fields; k++) {
    if (!more) return ctr__bad_count(r, p, len, err); /* the line ended early */
    const char *e = memchr(s, '\t', (size_t)(end - s));
    if (!e) {
      e = end;
      more = 0;
    }
    if (k == 0) {
      if (e - s != 1 || (*s != '0' && *s != '1')) return ctr__bad_field(r, k, s, e, "0 or 1", err);
      r->d.labels[i] = (float)(*s - '0');
    } else if (k <= r->n_dense) {
      int64_t x = 0;
      if (s < e && ctr__parse_int(s, e, &x) != 0)
        return ctr__bad_field(r, k, s, e, "an integer of at most 18 digits, or nothing", err);
      dense[k - 1] = x >= 0 && x < DENSE_TABLE ? r->dense_small[x] : ps_ctr_dense_value(x);
    } else {
      char low[CAT_MAX_CHARS];
      size_t n = (size_t)(e - s);
      if (n > CAT_MAX_CHARS)
        return ctr__bad_field(r, k, s, e, "1 to 8 hex digits, or nothing", err);
      for (size_t c = 0; c < n; c++) {
        unsigned char ch = (unsigned char)s[c];
        if (ch >= 'A' && ch <= 'F') ch = (unsigned char)(ch - 'A' + 'a');
        if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f')))
          return ctr__bad_field(r, k, s, e, "1 to 8 hex digits, or nothing", err);
        low[c] = (char)ch;
      }
      int f = k - 1 - r->n_dense;
      ids[f] = ps_ctr_feature_id(f, low, n);
    }
    if (more) s = e + 1;
  }
  /* The first line says whether the file has a truth column. */
  if (r->truth_col < 0) {
    r->truth_col = more;
    if (more && ctr__grow((void **)&r->d.truth, r->cap, sizeof(float)))
      return ps_seterr(err, PS_ENOMEM, "'%s': out of memory", r->name);
  }
  if (more != r->truth_col) return ctr__bad_count(r, p, len, err);
  if (more) {
    if (memchr(s, '\t', (size_t)(end - s))) return ctr__bad_count(r, p, len, err);
    if (ctr__parse_prob(s, end, &r->d.truth[i]) != 0)
      return ctr__bad_field(r, fields, s, end, "a probability in [0, 1]", err);
  }
  return PS_OK;
}

/* Parses the complete lines of buf[0, len); writes in *used the bytes
 * consumed (up to and with the last line end), all of them when `last`
 * (then an unterminated last line counts). Sets *full when max_rows
 * examples are in. */
static int ctr__lines(ctr__reader *r, const char *buf, size_t len, int last, size_t *used,
                      int *full, char *err) {
  size_t at = 0;
  *full = 0;
  while (at < len) {
    if (r->max_rows > 0 && r->d.n >= r->max_rows) {
      *full = 1;
      break;
    }
    const char *nl = memchr(buf + at, '\n', len - at);
    size_t line_len;
    if (nl) {
      line_len = (size_t)(nl - (buf + at));
    } else if (last) {
      line_len = len - at;
    } else {
      break;
    }
    r->line++;
    int rc = ctr__reserve(r, r->d.n + 1, err);
    if (rc == 0) rc = ctr__line(r, buf + at, line_len, err);
    if (rc != 0) return rc;
    at += line_len + (nl != NULL);
  }
  if (r->max_rows > 0 && r->d.n >= r->max_rows) *full = 1;
  *used = at;
  return PS_OK;
}

/* Hands the reader's data to out (0), or frees it and zeroes out. */
static int ctr__finish(ctr__reader *r, int rc, ps_ctr_data *out, char *err) {
  if (rc == 0 && r->d.n == 0)
    rc = ps_seterr(err, PS_EINVAL, "'%s': no examples (an empty file)", r->name);
  if (rc != 0) {
    ps_ctr_free(&r->d);
    memset(out, 0, sizeof *out);
    return rc;
  }
  ctr__shrink(r);
  *out = r->d;
  return PS_OK;
}

int ps_ctr_parse_tsv_shape(const char *text, size_t len, const char *name, int n_dense, int n_cat,
                           int64_t max_rows, ps_ctr_data *out, char *err) {
  memset(out, 0, sizeof *out);
  int rc = ctr__check_shape(n_dense, n_cat, err);
  if (rc != 0) return rc;
  ctr__reader r;
  ctr__reader_init(&r, name, n_dense, n_cat, max_rows);
  /* One pass over the line ends sizes the arrays exactly. */
  int64_t lines = 0;
  for (const char *p = text, *end = text + len; p < end; lines++) {
    if (max_rows > 0 && lines >= max_rows) break;
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    p = nl ? nl + 1 : end;
  }
  rc = ctr__reserve(&r, lines, err);
  size_t used;
  int full;
  if (rc == 0) rc = ctr__lines(&r, text, len, 1, &used, &full, err);
  return ctr__finish(&r, rc, out, err);
}

int ps_ctr_parse_tsv(const char *text, size_t len, const char *name, int64_t max_rows,
                     ps_ctr_data *out, char *err) {
  return ps_ctr_parse_tsv_shape(text, len, name, PS_CTR_CRITEO_DENSE, PS_CTR_CRITEO_CAT, max_rows,
                                out, err);
}

/* zlib's message without the path it prefixes. */
static int ctr__gz_error(gzFile f, const char *path, char *err) {
  int zerr = Z_OK;
  const char *msg = gzerror(f, &zerr);
  if (zerr == Z_ERRNO) return ps_seterr(err, PS_EIO, "cannot read '%s': %s", path, strerror(errno));
  size_t plen = strlen(path);
  if (msg && strncmp(msg, path, plen) == 0 && msg[plen] == ':') msg += plen + 1;
  while (msg && *msg == ' ') msg++;
  return ps_seterr(err, PS_EINVAL, "'%s': corrupt or truncated gzip data: %s", path,
                   msg && *msg ? msg : "unknown zlib error");
}

/* Reads the file through f in pieces, carrying a cut line over. */
static int ctr__read_stream(ctr__reader *r, gzFile f, char *err) {
  size_t size = READ_CHUNK;
  if (size < 2 * r->max_line + 4) size = 2 * r->max_line + 4;
  char *buf = malloc(size);
  if (!buf) return ps_seterr(err, PS_ENOMEM, "'%s': out of memory", r->name);
  size_t have = 0;
  int rc = PS_OK;
  for (;;) {
    int got = gzread(f, buf + have, (unsigned)(size - have));
    if (got < 0) {
      rc = ctr__gz_error(f, r->name, err);
      break;
    }
    if (got == 0) {
      /* the end, or a gzip stream cut short (zlib's Z_BUF_ERROR) */
      int zerr = Z_OK;
      gzerror(f, &zerr);
      if (zerr != Z_OK) {
        rc = ctr__gz_error(f, r->name, err);
        break;
      }
    }
    have += (size_t)got;
    int last = got == 0, full = 0;
    size_t used = 0;
    rc = ctr__lines(r, buf, have, last, &used, &full, err);
    if (rc != 0 || full || last) break;
    if (used == 0 && have == size) {
      /* a whole buffer without a line end: longer than any valid line */
      r->line++;
      rc = ctr__line(r, buf, have, err);
      break;
    }
    memmove(buf, buf + used, have - used);
    have -= used;
  }
  free(buf);
  return rc;
}

int ps_ctr_load_tsv_shape(const char *path, int n_dense, int n_cat, int64_t max_rows,
                          ps_ctr_data *out, char *err) {
  memset(out, 0, sizeof *out);
  int rc = ctr__check_shape(n_dense, n_cat, err);
  if (rc != 0) return rc;
  errno = 0;
  /* gzopen reads a plain file unchanged: gzip is detected by its magic. */
  gzFile f = gzopen(path, "rb");
  if (!f)
    return ps_seterr(err, errno ? PS_EIO : PS_ENOMEM, "cannot open '%s': %s", path,
                     errno ? strerror(errno) : "out of memory");
  gzbuffer(f, 1 << 18);
  ctr__reader r;
  ctr__reader_init(&r, path, n_dense, n_cat, max_rows);
  rc = ctr__read_stream(&r, f, err);
  gzclose(f);
  return ctr__finish(&r, rc, out, err);
}

int ps_ctr_load_tsv(const char *path, int64_t max_rows, ps_ctr_data *out, char *err) {
  return ps_ctr_load_tsv_shape(path, PS_CTR_CRITEO_DENSE, PS_CTR_CRITEO_CAT, max_rows, out, err);
}

void ps_ctr_free(ps_ctr_data *d) {
  free(d->dense);
  free(d->ids);
  free(d->labels);
  free(d->truth);
  free(d->values);
  memset(d, 0, sizeof *d);
}

/* ---- the synthetic click log ---- */

/* Keys of the generator's hashes, one per kind of draw. */
#define KEY_EXAMPLE 0x6374722d65780001ull
#define KEY_VALUE 0x6374722d76610002ull
#define KEY_MODEL 0x6374722d6d6f0003ull
#define KEY_DENSE 0x6374722d64650004ull
/* The counters within one example: its label's uniform, its dense draws,
 * then one stream of uniforms per categorical field. */
#define CTR_LABEL 0
#define CTR_DENSE(j) (1 + (uint64_t)(j))
#define CTR_FIELD(f) (0x10000 + (uint64_t)(f))
/* The lognormal counts: log-scale spread, and the top of the means m_j. */
#define DENSE_SIGMA 1.5
#define DENSE_MEAN_MAX 3.0

void ps_ctr_synth_defaults(ps_ctr_synth_cfg *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->n_dense = PS_CTR_CRITEO_DENSE;
  cfg->n_cat = PS_CTR_CRITEO_CAT;
  cfg->vocab = 100000;
  cfg->zipf_s = 1.05;
  cfg->factors = 8;
  cfg->weight_scale = 0.15;
  cfg->factor_scale = 0.12;
  cfg->dense_scale = 0.15;
  cfg->bias = -1.45;
  cfg->seed = 1;
}

int ps_ctr_synth_check(const ps_ctr_synth_cfg *c, char *err) {
  int rc = ctr__check_shape(c->n_dense, c->n_cat, err);
  if (rc != 0) return rc;
  if (c->vocab < 1 || c->vocab > PS_CTR_MAX_VOCAB)
    return ps_seterr(err, PS_EINVAL, "synthetic CTR data: vocab %llu is not in [1, 2^40]",
                     (unsigned long long)c->vocab);
  if (!(c->zipf_s >= 0.0 && c->zipf_s <= PS_CTR_MAX_ZIPF))
    return ps_seterr(err, PS_EINVAL, "synthetic CTR data: Zipf exponent %g is not in [0, %g]",
                     c->zipf_s, PS_CTR_MAX_ZIPF);
  if (c->factors < 1 || c->factors > PS_CTR_MAX_FACTORS)
    return ps_seterr(err, PS_EINVAL, "synthetic CTR data: factors %d is not in [1, %d]", c->factors,
                     PS_CTR_MAX_FACTORS);
  const struct {
    const char *name;
    double v;
  } scales[] = {{"weight_scale", c->weight_scale},
                {"factor_scale", c->factor_scale},
                {"dense_scale", c->dense_scale}};
  for (size_t i = 0; i < sizeof scales / sizeof scales[0]; i++)
    if (!(scales[i].v >= 0.0 && isfinite(scales[i].v)))
      return ps_seterr(err, PS_EINVAL, "synthetic CTR data: %s %g is not finite and >= 0",
                       scales[i].name, scales[i].v);
  if (!isfinite(c->bias))
    return ps_seterr(err, PS_EINVAL, "synthetic CTR data: bias %g is not finite", c->bias);
  return PS_OK;
}

/* Uniform in [0, 1) with 53 bits. */
static inline double ctr__unit(uint64_t x) {
  return (double)(x >> 11) * (1.0 / 9007199254740992.0);
}

/* Zipf(s) over ranks 1..n by rejection-inversion (W. Hörmann and G.
 * Derflinger, "Rejection-inversion to generate variates from monotone
 * discrete distributions", 1996): invert the integral H of the density
 * h(x) = x^-s over [1/2, n + 1/2], round to the nearest rank k, and accept
 * when the draw fell under h(k)'s share; most draws are accepted at once.
 * O(1) per draw, no tables, any n. */
typedef struct {
  double s;
  double h_lo, h_hi; /* H(3/2) - h(1) and H(n + 1/2): the range inverted */
  double shortcut;   /* k - x <= this accepts without another H */
  double n;
} ctr__zipf;

/* log1p(t)/t and expm1(t)/t, continuous at t = 0 (s = 1 goes through t = 0). */
static double ctr__log1p_ratio(double t) {
  return fabs(t) > 1e-8 ? log1p(t) / t : 1.0 - t * (0.5 - t * (1.0 / 3.0 - 0.25 * t));
}
static double ctr__expm1_ratio(double t) {
  return fabs(t) > 1e-8 ? expm1(t) / t : 1.0 + t * 0.5 * (1.0 + t / 3.0 * (1.0 + 0.25 * t));
}
/* H(x) = (x^(1-s) - 1) / (1 - s), log x at s = 1; and its inverse. */
static double ctr__zipf_H(const ctr__zipf *z, double x) {
  double lx = log(x);
  return ctr__expm1_ratio((1.0 - z->s) * lx) * lx;
}
static double ctr__zipf_Hinv(const ctr__zipf *z, double y) {
  return exp(ctr__log1p_ratio((1.0 - z->s) * y) * y);
}
static double ctr__zipf_h(const ctr__zipf *z, double x) { return exp(-z->s * log(x)); }

static void ctr__zipf_init(ctr__zipf *z, double s, uint64_t n) {
  z->s = s;
  z->n = (double)n;
  z->h_lo = ctr__zipf_H(z, 1.5) - 1.0;
  z->h_hi = ctr__zipf_H(z, z->n + 0.5);
  z->shortcut = 2.0 - ctr__zipf_Hinv(z, ctr__zipf_H(z, 2.5) - ctr__zipf_h(z, 2.0));
}

/* A rank in [0, n) (rank 0 the most frequent) from the stream of hashes
 * mix(state + j * GOLDEN), j = 1, 2, ... */
static uint64_t ctr__zipf_draw(const ctr__zipf *z, uint64_t state) {
  for (;;) {
    state += GOLDEN;
    double u = z->h_hi + ctr__unit(ctr__mix(state)) * (z->h_lo - z->h_hi);
    double x = ctr__zipf_Hinv(z, u);
    double k = floor(x + 0.5);
    if (k < 1.0) k = 1.0;
    if (k > z->n) k = z->n;
    if (k - x <= z->shortcut || u >= ctr__zipf_H(z, k + 0.5) - ctr__zipf_h(z, k))
      return (uint64_t)k - 1;
  }
}

/* Two roughly standard normal values from one hash: each 32-bit half is
 * the sum of its four bytes (Irwin-Hall, mean 510, variance 4 * 65535/12)
 * scaled to unit variance. Enough for the hidden model's parameters, at a
 * fraction of the cost of Box-Muller. */
static inline void ctr__normal2(uint64_t x, double out[2]) {
  uint64_t t = (x & 0x00ff00ff00ff00ffull) + ((x >> 8) & 0x00ff00ff00ff00ffull);
  t = (t & 0x0000ffff0000ffffull) + ((t >> 16) & 0x0000ffff0000ffffull);
  const double scale = 1.7320508075688772 / 255.99804686;
  out[0] = ((double)(int64_t)(t & 0xffffffffull) - 510.0) * scale;
  out[1] = ((double)(int64_t)(t >> 32) - 510.0) * scale;
}

static void ctr__hex8(uint32_t v, char out[8]) {
  for (int c = 7; c >= 0; c--) {
    out[c] = "0123456789abcdef"[v & 15];
    v >>= 4;
  }
}

/* Ranks of a field whose weights and factors give its centre (below). */
#define CENTER_RANKS 2048

/* What a synthetic set's examples share: the sampler, the dense features'
 * means m_j and weights u_j, and each field's centre. */
typedef struct {
  const ps_ctr_synth_cfg *cfg;
  ctr__zipf zipf;
  uint64_t key_example, key_value, key_model;
  double dense_mean[PS_CTR_MAX_FIELDS], dense_w[PS_CTR_MAX_FIELDS];
  /* (n_cat, 1 + k): the Zipf-weighted mean of the weight and the factors
   * over the field's most frequent values, subtracted from each value's,
   * so that a field's few hot values do not shift every example's logit
   * by a seed-dependent amount (the click rate stays near its aim for
   * every seed) */
  double *center;
  float dense_value[DENSE_TABLE]; /* ps_ctr_dense_value(c) */
  double *scratch;                /* (k + 3): room for one value's parameters */
} ctr__gen;

/* Field f's value of the given rank: its number (the value string's 8 hex
 * digits) and its id. */
static uint64_t ctr__value(const ctr__gen *g, int f, uint64_t rank, uint32_t *value) {
  *value = (uint32_t)ctr__mix(g->key_value + rank * 0x100000001b3ull + (uint64_t)f * GOLDEN);
  char text[8];
  ctr__hex8(*value, text);
  return ps_ctr_feature_id(f, text, 8);
}

/* The hidden model's weight and k factors of id, before centring, into
 * p[0], p[1 .. k] (p holds k + 2): a hash sequence of (model key, id). */
static void ctr__params(const ctr__gen *g, uint64_t id, double *p) {
  const ps_ctr_synth_cfg *cfg = g->cfg;
  uint64_t base = ctr__mix(g->key_model ^ id);
  for (int c = 0; c <= cfg->factors; c += 2) {
    base += GOLDEN;
    ctr__normal2(ctr__mix(base), p + c);
  }
  p[0] *= cfg->weight_scale;
  for (int c = 1; c <= cfg->factors; c++) p[c] *= cfg->factor_scale;
}

static int ctr__gen_init(ctr__gen *g, const ps_ctr_synth_cfg *cfg) {
  memset(g, 0, sizeof *g);
  g->cfg = cfg;
  int np = 1 + cfg->factors;
  g->center = calloc((size_t)cfg->n_cat * (size_t)np + 1, sizeof(double));
  g->scratch = calloc((size_t)np + 2, sizeof(double));
  if (!g->center || !g->scratch) return -1;
  ctr__zipf_init(&g->zipf, cfg->zipf_s, cfg->vocab);
  g->key_example = ctr__mix(cfg->seed ^ KEY_EXAMPLE);
  g->key_value = ctr__mix(cfg->seed ^ KEY_VALUE);
  g->key_model = ctr__mix(cfg->seed ^ KEY_MODEL);
  uint64_t key_dense = ctr__mix(cfg->seed ^ KEY_DENSE);
  for (int j = 0; j < cfg->n_dense; j++) {
    uint64_t h = ctr__mix(key_dense + (uint64_t)(j + 1) * GOLDEN);
    double z[2];
    ctr__normal2(ctr__mix(h), z);
    g->dense_mean[j] = DENSE_MEAN_MAX * ctr__unit(h);
    g->dense_w[j] = cfg->dense_scale * z[0];
  }
  for (int c = 0; c < DENSE_TABLE; c++) g->dense_value[c] = ps_ctr_dense_value(c);
  uint64_t ranks = cfg->vocab < CENTER_RANKS ? cfg->vocab : CENTER_RANKS;
  for (int f = 0; f < cfg->n_cat; f++) {
    double *ctr = g->center + (size_t)f * (size_t)np, mass = 0.0;
    for (uint64_t r = 0; r < ranks; r++) {
      uint32_t value;
      uint64_t id = ctr__value(g, f, r, &value);
      double pr = ctr__zipf_h(&g->zipf, (double)(r + 1));
      ctr__params(g, id, g->scratch);
      for (int c = 0; c < np; c++) ctr[c] += pr * g->scratch[c];
      mass += pr;
    }
    for (int c = 0; c < np; c++) ctr[c] /= mass;
  }
  return 0;
}

static void ctr__gen_free(ctr__gen *g) {
  free(g->center);
  free(g->scratch);
}

/* Example i into row `row` of d: dense counts, categorical values and ids,
 * the hidden model's probability and the label. */
static void ctr__gen_example(const ctr__gen *g, int64_t i, ps_ctr_data *d, int64_t row,
                             double *sum_v) {
  const ps_ctr_synth_cfg *cfg = g->cfg;
  const int k = cfg->factors, np = 1 + k;
  uint64_t key = ctr__mix(g->key_example ^ ctr__mix((uint64_t)i + GOLDEN));
  double logit = cfg->bias;

  float *dense = d->dense + row * cfg->n_dense;
  for (int j = 0; j < cfg->n_dense; j += 2) {
    double z[2];
    ctr__normal2(ctr__mix(key + CTR_DENSE(j) * GOLDEN), z);
    for (int t = 0; t < 2 && j + t < cfg->n_dense; t++) {
      double c = floor(exp(g->dense_mean[j + t] + DENSE_SIGMA * z[t]));
      if (c > PS_CTR_SYNTH_MAX_COUNT) c = PS_CTR_SYNTH_MAX_COUNT;
      float x = c < DENSE_TABLE ? g->dense_value[(int)c] : ps_ctr_dense_value((int64_t)c);
      dense[j + t] = x;
      logit += g->dense_w[j + t] * ((double)x - g->dense_mean[j + t]);
    }
  }

  /* The pairwise term sum_{f<g} <v_f, v_g> as (|sum_f v_f|^2 -
   * sum_f |v_f|^2) / 2: O(fields * k), not O(fields^2 * k). */
  double sq = 0.0, p[PS_CTR_MAX_FACTORS + 2];
  for (int c = 0; c < k; c++) sum_v[c] = 0.0;
  uint64_t *ids = d->ids + row * cfg->n_cat;
  uint32_t *values = d->values ? d->values + row * cfg->n_cat : NULL;
  for (int f = 0; f < cfg->n_cat; f++) {
    uint64_t rank = ctr__zipf_draw(&g->zipf, ctr__mix(key + CTR_FIELD(f) * GOLDEN));
    uint32_t value;
    ids[f] = ctr__value(g, f, rank, &value);
    if (values) values[f] = value;
    ctr__params(g, ids[f], p);
    const double *ctr = g->center + (size_t)f * (size_t)np;
    logit += p[0] - ctr[0];
    for (int c = 1; c <= k; c++) {
      double v = p[c] - ctr[c];
      sum_v[c - 1] += v;
      sq += v * v;
    }
  }
  double pair = -sq;
  for (int c = 0; c < k; c++) pair += sum_v[c] * sum_v[c];
  logit += 0.5 * pair;

  float truth = (float)(1.0 / (1.0 + exp(-logit)));
  d->truth[row] = truth;
  d->labels[row] =
      ctr__unit(ctr__mix(key + CTR_LABEL * GOLDEN + 0x5851f42d4c957f2dull)) < (double)truth ? 1.0f
                                                                                            : 0.0f;
}

/* Examples first + part + k * parts for k < count, with their value
 * strings or not. */
static int ctr__synthetic(const ps_ctr_synth_cfg *cfg, int64_t first, int64_t count, int part,
                          int parts, int with_values, ps_ctr_data *out, char *err) {
  size_t per = (size_t)cfg->n_cat * (sizeof(uint64_t) + sizeof(uint32_t)) +
               (size_t)cfg->n_dense * sizeof(float) + 2 * sizeof(float);
  if ((uint64_t)count > SIZE_MAX / per)
    return ps_seterr(err, PS_ENOMEM, "synthetic CTR data: %lld examples do not fit in memory",
                     (long long)count);
  ps_ctr_data d = {.n = count, .n_dense = cfg->n_dense, .n_cat = cfg->n_cat};
  size_t un = (size_t)count;
  d.dense = malloc(un * (size_t)cfg->n_dense * sizeof(float) + 1);
  d.ids = malloc(un * (size_t)cfg->n_cat * sizeof(uint64_t) + 1);
  d.values = with_values ? malloc(un * (size_t)cfg->n_cat * sizeof(uint32_t) + 1) : NULL;
  d.labels = malloc(un * sizeof(float));
  d.truth = malloc(un * sizeof(float));
  ctr__gen *g = calloc(1, sizeof *g);
  if (!d.dense || !d.ids || (with_values && !d.values) || !d.labels || !d.truth || !g ||
      ctr__gen_init(g, cfg)) {
    if (g) ctr__gen_free(g);
    free(g);
    ps_ctr_free(&d);
    return ps_seterr(err, PS_ENOMEM, "synthetic CTR data: out of memory for %lld examples",
                     (long long)count);
  }
  for (int64_t r = 0; r < count; r++)
    ctr__gen_example(g, first + part + r * parts, &d, r, g->scratch);
  ctr__gen_free(g);
  free(g);
  *out = d;
  return PS_OK;
}

int ps_ctr_synthetic(const ps_ctr_synth_cfg *cfg, int64_t first, int64_t n, ps_ctr_data *out,
                     char *err) {
  memset(out, 0, sizeof *out);
  int rc = ps_ctr_synth_check(cfg, err);
  if (rc != 0) return rc;
  if (first < 0 || n < 1 || n > INT64_MAX - first)
    return ps_seterr(err, PS_ERANGE,
                     "synthetic CTR data: examples [%lld, +%lld): wants first >= 0, n >= 1",
                     (long long)first, (long long)n);
  return ctr__synthetic(cfg, first, n, 0, 1, 1, out, err);
}

int ps_ctr_synthetic_part(const ps_ctr_synth_cfg *cfg, int64_t first, int64_t n, int part,
                          int parts, ps_ctr_data *out, char *err) {
  memset(out, 0, sizeof *out);
  int rc = ps_ctr_synth_check(cfg, err);
  if (rc != 0) return rc;
  if (first < 0 || n < 1 || n > INT64_MAX - first || parts < 1 || part < 0 || part >= parts ||
      part >= n)
    return ps_seterr(err, PS_ERANGE,
                     "synthetic CTR data: part %d of %d of examples [%lld, +%lld): wants first "
                     ">= 0, 0 <= part < parts and part < n",
                     part, parts, (long long)first, (long long)n);
  return ctr__synthetic(cfg, first, (n - part + parts - 1) / parts, part, parts, 0, out, err);
}

/* ---- the writer ---- */

/* The integer whose dense value x is, if one of magnitude at most
 * PS_CTR_SYNTH_MAX_COUNT maps exactly to x. */
static int ctr__dense_count(float x, int64_t *out) {
  if (!isfinite(x)) return -1;
  double c = floor(expm1(fabs((double)x)) + 0.5);
  if (c > PS_CTR_SYNTH_MAX_COUNT) return -1;
  int64_t v = x < 0 ? -(int64_t)c : (int64_t)c;
  if (ps_ctr_dense_value(v) != x) return -1;
  *out = v;
  return 0;
}

/* Writes v in decimal at p; returns the characters written. */
static size_t ctr__put_int(char *p, int64_t v) {
  char tmp[24];
  size_t n = 0, len = 0;
  uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
  if (v < 0) p[len++] = '-';
  do {
    tmp[n++] = (char)('0' + u % 10);
    u /= 10;
  } while (u);
  while (n) p[len++] = tmp[--n];
  return len;
}

/* Whether rows [first, first + count) of d can be written: labels 0/1,
 * dense values of small integers, value strings (and truth) present. */
static int ctr__check_writable(const ps_ctr_data *d, int64_t first, int64_t count, int with_truth,
                               char *err) {
  if (ctr__check_shape(d->n_dense, d->n_cat, err) != 0) return PS_EINVAL;
  if (first < 0 || count < 0 || first > d->n || count > d->n - first)
    return ps_seterr(err, PS_ERANGE, "CTR data: rows [%lld, +%lld) of a set of %lld",
                     (long long)first, (long long)count, (long long)d->n);
  if (d->n_cat > 0 && !d->values)
    return ps_seterr(err, PS_EINVAL,
                     "CTR data: no categorical value strings to write (only synthetic sets "
                     "keep them; a set read from TSV holds hashed ids)");
  if (with_truth && !d->truth)
    return ps_seterr(err, PS_EINVAL, "CTR data: no ground truth to write");
  for (int64_t i = first; i < first + count; i++) {
    if (d->labels[i] != 0.0f && d->labels[i] != 1.0f)
      return ps_seterr(err, PS_EINVAL, "CTR data: row %lld: label %g is not 0 or 1", (long long)i,
                       (double)d->labels[i]);
    if (with_truth && !(d->truth[i] >= 0.0f && d->truth[i] <= 1.0f))
      return ps_seterr(err, PS_EINVAL, "CTR data: row %lld: truth %g is not in [0, 1]",
                       (long long)i, (double)d->truth[i]);
    for (int j = 0; j < d->n_dense; j++) {
      int64_t c;
      if (ctr__dense_count(d->dense[i * d->n_dense + j], &c) != 0)
        return ps_seterr(err, PS_EINVAL,
                         "CTR data: row %lld, I%d: %g is not the dense value of an integer of "
                         "magnitude at most %d",
                         (long long)i, j + 1, (double)d->dense[i * d->n_dense + j],
                         PS_CTR_SYNTH_MAX_COUNT);
    }
  }
  return PS_OK;
}

int ps_ctr_write_tsv_rows(FILE *f, const ps_ctr_data *d, int64_t first_row, int64_t count,
                          int with_truth, char *err) {
  int rc = ctr__check_writable(d, first_row, count, with_truth, err);
  if (rc != 0) return rc;
  size_t cap = 2 + (size_t)d->n_dense * (1 + DENSE_MAX_CHARS) + (size_t)d->n_cat * 9 + 40;
  char *line = malloc(cap);
  if (!line) return ps_seterr(err, PS_ENOMEM, "CTR data: out of memory");
  for (int64_t i = first_row; i < first_row + count; i++) {
    char *p = line;
    *p++ = d->labels[i] != 0.0f ? '1' : '0';
    for (int j = 0; j < d->n_dense; j++) {
      int64_t c = 0;
      ctr__dense_count(d->dense[i * d->n_dense + j], &c); /* checked above */
      *p++ = '\t';
      p += ctr__put_int(p, c);
    }
    for (int k = 0; k < d->n_cat; k++) {
      *p++ = '\t';
      ctr__hex8(d->values[i * d->n_cat + k], p);
      p += 8;
    }
    if (with_truth) p += (size_t)snprintf(p, 32, "\t%.9g", (double)d->truth[i]);
    *p++ = '\n';
    if (fwrite(line, 1, (size_t)(p - line), f) != (size_t)(p - line)) {
      free(line);
      return ps_seterr(err, PS_EIO, "cannot write CTR data: %s", strerror(errno));
    }
  }
  free(line);
  return PS_OK;
}

int ps_ctr_write_tsv(FILE *f, const ps_ctr_data *d, int64_t first_row, char *err) {
  if (first_row < 0 || first_row > d->n)
    return ps_seterr(err, PS_ERANGE, "CTR data: first row %lld of a set of %lld",
                     (long long)first_row, (long long)d->n);
  return ps_ctr_write_tsv_rows(f, d, first_row, d->n - first_row, 0, err);
}
