#include "util.h"

#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

const char *ps_strerror(int code) {
  switch (code) {
    case PS_OK: return "ok";
    case PS_EINVAL: return "invalid argument or input";
    case PS_ENOMEM: return "out of memory";
    case PS_EIO: return "input/output error";
    case PS_ERANGE: return "out of range";
    case PS_ENOTFOUND: return "not found";
    case PS_EPROTO: return "protocol mismatch";
    case PS_ESTATE: return "invalid state";
    case PS_ETIMEDOUT: return "timed out";
    case PS_EUNAVAIL: return "unavailable";
    default: return "unknown error";
  }
}

int ps_seterr(char *err, int code, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, PS_ERRLEN, fmt, ap);
    va_end(ap);
  }
  return code;
}

int64_t ps_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

double ps_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

double ps_wall_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

double ps_cpu_s(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

void ps_malloc_tune(void) {
#ifdef M_TRIM_THRESHOLD
  const char *t = getenv("GLIBC_TUNABLES");
  if (t && (strstr(t, "malloc.trim_threshold") || strstr(t, "malloc.mmap_threshold"))) return;
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
#endif
}

void ps_sleep_ms(int64_t ms) {
  if (ms <= 0) return;
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
  }
}

void *ps_alloc(size_t bytes) {
  void *p = NULL;
  if (bytes == 0) bytes = 1;
  size_t rounded = (bytes + 63) & ~(size_t)63;
  if (rounded < bytes) return NULL;
  if (posix_memalign(&p, 64, rounded) != 0) return NULL;
  memset(p, 0, rounded);
  return p;
}

void ps_free(void *p) { free(p); }

int ps_read_file(const char *path, char **out, size_t *len, char *err) {
  *out = NULL;
  if (len) *len = 0;
  FILE *f = fopen(path, "rb");
  if (!f) return ps_seterr(err, PS_EIO, "cannot open '%s': %s", path, strerror(errno));
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  if (!buf) {
    fclose(f);
    return ps_seterr(err, PS_ENOMEM, "out of memory reading '%s'", path);
  }
  for (;;) {
    if (n + 1 >= cap) {
      char *nb = realloc(buf, cap * 2);
      if (!nb) {
        free(buf);
        fclose(f);
        return ps_seterr(err, PS_ENOMEM, "out of memory reading '%s'", path);
      }
      buf = nb;
      cap *= 2;
    }
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    free(buf);
    return ps_seterr(err, PS_EIO, "error reading '%s'", path);
  }
  buf[n] = '\0';
  *out = buf;
  if (len) *len = n;
  return PS_OK;
}

int ps_parse_hostport(const char *s, char *host, size_t hostlen, int *port) {
  if (!s || !*s) return PS_EINVAL;
  const char *colon = strrchr(s, ':');
  if (!colon || colon == s) return PS_EINVAL;
  size_t hl = (size_t)(colon - s);
  if (hl + 1 > hostlen) return PS_EINVAL;
  char *end = NULL;
  errno = 0;
  long p = strtol(colon + 1, &end, 10);
  if (errno || !end || *end != '\0' || end == colon + 1 || p < 0 || p > 65535) return PS_EINVAL;
  memcpy(host, s, hl);
  host[hl] = '\0';
  *port = (int)p;
  return PS_OK;
}

void ps_host_unbracket(char *host) {
  size_t n = strlen(host);
  if (n >= 2 && host[0] == '[' && host[n - 1] == ']') {
    memmove(host, host + 1, n - 2);
    host[n - 2] = 0;
  }
}

/* ---- UTF-8 ---- */

size_t ps_utf8_char_len(const uint8_t *s, size_t n) {
  if (n == 0) return 0;
  uint8_t b = s[0];
  if (b < 0x80) return 1;
  size_t len;
  uint8_t lo = 0x80, hi = 0xbf; /* the allowed range of the second byte */
  if (b >= 0xc2 && b <= 0xdf) {
    len = 2;
  } else if (b >= 0xe0 && b <= 0xef) {
    len = 3;
    if (b == 0xe0) lo = 0xa0; /* overlong */
    if (b == 0xed) hi = 0x9f; /* surrogates */
  } else if (b >= 0xf0 && b <= 0xf4) {
    len = 4;
    if (b == 0xf0) lo = 0x90; /* overlong */
    if (b == 0xf4) hi = 0x8f; /* above U+10FFFF */
  } else {
    return 0; /* a continuation byte, an overlong lead (C0, C1) or F5..FF */
  }
  if (n < len || s[1] < lo || s[1] > hi) return 0;
  for (size_t i = 2; i < len; i++)
    if ((s[i] & 0xc0) != 0x80) return 0;
  return len;
}

size_t ps_utf8_valid_len(const void *s, size_t n) {
  const uint8_t *p = s;
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) { /* the common case, a byte at a time */
      i++;
      continue;
    }
    size_t k = ps_utf8_char_len(p + i, n - i);
    if (k == 0) break;
    i += k;
  }
  return i;
}

/* A control character: C0, DEL, or C1 (U+0080..U+009F, encoded C2 80..C2 9F)
 * starting at s, whose valid UTF-8 length is len. */
/* C0, DEL and C1 controls, and the characters that move or reorder text
 * on a terminal: LRM, RLM, ALM, the line and paragraph separators (U+2028,
 * U+2029) and the bidirectional embeddings, overrides and isolates
 * (U+202A-202E, U+2066-2069), which can make a log line read as another. */
static int utf8_is_control(const uint8_t *s, size_t len) {
  if (len == 1) return s[0] < 0x20 || s[0] == 0x7f;
  if (len == 2) return (s[0] == 0xc2 && s[1] < 0xa0) || (s[0] == 0xd8 && s[1] == 0x9c);
  if (len == 3 && s[0] == 0xe2 && s[1] == 0x80)
    return s[2] == 0x8e || s[2] == 0x8f || (s[2] >= 0xa8 && s[2] <= 0xae);
  if (len == 3 && s[0] == 0xe2 && s[1] == 0x81) return s[2] >= 0xa6 && s[2] <= 0xa9;
  return 0;
}

/* Copies the NUL-terminated src into dst (cap bytes, cap > 0), writing in
 * place of each byte that is not valid UTF-8 and each control character
 * (the k bytes at s) what replace puts in out (at most 16 bytes); cut before
 * the first character or replacement that does not fit. Returns the length
 * written. */
typedef size_t (*text_replace_fn)(const uint8_t *s, size_t k, char *out);
static size_t text_copy(char *dst, size_t cap, const char *src, text_replace_fn replace) {
  const uint8_t *p = (const uint8_t *)(src ? src : "");
  size_t n = strlen((const char *)p), out = 0;
  for (size_t i = 0; i < n;) {
    size_t len = ps_utf8_char_len(p + i, n - i);
    char rep[16];
    const char *piece = (const char *)p + i;
    size_t plen = len;
    if (len == 0 || utf8_is_control(p + i, len)) {
      len = len ? len : 1;
      plen = replace(p + i, len, rep);
      piece = rep;
    }
    if (out + plen > cap - 1) break; /* never inside a character */
    memcpy(dst + out, piece, plen);
    out += plen;
    i += len;
  }
  dst[out] = '\0';
  return out;
}

static size_t replacement_char(const uint8_t *s, size_t k, char *out) {
  (void)s;
  (void)k;
  memcpy(out, "\xef\xbf\xbd", 3); /* U+FFFD */
  return 3;
}

size_t ps_utf8_sanitize(char *dst, size_t cap, const char *src) {
  return text_copy(dst, cap, src, replacement_char);
}

/* ---- logging ---- */
static char log_prog[32] = "ps";
static int log_level = PS_LOG_INFO;
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;

int ps_log_level_parse(const char *s) {
  if (!s) return -1;
  if (!strcmp(s, "debug")) return PS_LOG_DEBUG;
  if (!strcmp(s, "info")) return PS_LOG_INFO;
  if (!strcmp(s, "warn")) return PS_LOG_WARN;
  if (!strcmp(s, "error")) return PS_LOG_ERROR;
  return -1;
}

void ps_log_init(const char *prog, int level) {
  snprintf(log_prog, sizeof log_prog, "%s", prog);
  log_level = level;
}

/* \n, \r, \t, or \xNN for each of the k bytes at s (k <= 3: a bidi
 * control is the longest character escaped). */
static size_t log_escape(const uint8_t *s, size_t k, char *out) {
  size_t e = 0;
  for (size_t j = 0; j < k; j++) {
    if (s[j] == '\n' || s[j] == '\r' || s[j] == '\t') {
      out[e++] = '\\';
      out[e++] = s[j] == '\n' ? 'n' : s[j] == '\r' ? 'r' : 't';
    } else {
      e += (size_t)snprintf(out + e, 5, "\\x%02x", s[j]);
    }
  }
  return e;
}

void ps_log(int level, const char *fmt, ...) {
  if (level < log_level) return;
  static const char *names[] = {"debug", "info", "warn", "error"};
  char raw[1024], msg[4 * sizeof raw]; /* an escape is at most 4 bytes a byte */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(raw, sizeof raw, fmt, ap);
  va_end(ap);
  text_copy(msg, sizeof msg, raw, log_escape);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  localtime_r(&ts.tv_sec, &tm);
  pthread_mutex_lock(&log_mu);
  fprintf(stderr, "%02d:%02d:%02d.%03ld %s %s: %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
          ts.tv_nsec / 1000000, log_prog, names[level < 0 ? 0 : level > 3 ? 3 : level], msg);
  pthread_mutex_unlock(&log_mu);
}

/* ---- scattered bytes ---- */
int ps_segview_copy(const ps_segview *v, size_t pos, void *dst, size_t len) {
  if (pos > v->total || len > v->total - pos) return PS_ERANGE;
  uint8_t *out = dst;
  for (int i = 0; i < v->nsegs && len > 0; i++) {
    size_t sl = v->segs[i].len;
    if (pos >= sl) {
      pos -= sl;
      continue;
    }
    size_t take = sl - pos < len ? sl - pos : len;
    memcpy(out, v->segs[i].ptr + pos, take);
    out += take;
    len -= take;
    pos = 0;
  }
  return PS_OK;
}

int ps_segview_each_float(const ps_segview *v, ps_float_fn fn, void *user) {
  float stage[1];
  size_t first = 0;     /* index of the next float to hand out */
  uint8_t carry[4];     /* bytes of a float split across segments */
  size_t ncarry = 0;
  for (int i = 0; i < v->nsegs; i++) {
    const uint8_t *p = v->segs[i].ptr;
    size_t len = v->segs[i].len;
    if (len == 0) continue; /* an empty segment may have a NULL pointer */
    if (ncarry) {
      size_t need = 4 - ncarry, take = need < len ? need : len;
      memcpy(carry + ncarry, p, take);
      ncarry += take;
      p += take;
      len -= take;
      if (ncarry < 4) continue;
      memcpy(stage, carry, 4);
      int rc = fn(stage, 1, first, user);
      if (rc) return rc;
      first++;
      ncarry = 0;
    }
    size_t nf = len / 4;
    if (nf) {
      int rc = fn((const ps_ufloat *)(const void *)p, nf, first, user);
      if (rc) return rc;
      first += nf;
    }
    size_t rest = len - nf * 4;
    memcpy(carry, p + nf * 4, rest);
    ncarry = rest;
  }
  return PS_OK;
}

int ps_segview_each_elem_range(const ps_segview *v, size_t esz, size_t first, size_t count,
                               ps_elem_fn fn, void *user) {
  if (esz == 0 || esz > 8) return PS_EINVAL;
  if (first > v->total / esz || count > v->total / esz - first) return PS_ERANGE;
  size_t pos = first * esz, end = (first + count) * esz; /* byte range wanted */
  size_t at = 0;                                         /* byte offset of segs[i] */
  size_t next = first;                                   /* index of the next element */
  uint8_t carry[8]; /* bytes of an element split across segments; 8-aligned */
  uint64_t stage[1];
  size_t ncarry = 0;
  for (int i = 0; i < v->nsegs && next < first + count; i++) {
    size_t len = v->segs[i].len;
    if (len == 0 || at + len <= pos) {
      at += len;
      continue;
    }
    size_t lo = pos > at ? pos - at : 0; /* within this segment */
    size_t hi = end < at + len ? end - at : len;
    const uint8_t *p = v->segs[i].ptr + lo;
    size_t n = hi - lo;
    if (ncarry) {
      size_t take = esz - ncarry < n ? esz - ncarry : n;
      memcpy(carry + ncarry, p, take);
      ncarry += take;
      p += take;
      n -= take;
      if (ncarry == esz) {
        memcpy(stage, carry, esz);
        int rc = fn(stage, 1, next, user);
        if (rc) return rc;
        next++;
        ncarry = 0;
      }
    }
    size_t ne = n / esz;
    if (ne) {
      int rc = fn(p, ne, next, user);
      if (rc) return rc;
      next += ne;
    }
    memcpy(carry + ncarry, p + ne * esz, n - ne * esz);
    ncarry += n - ne * esz;
    pos = at + hi;
    at += len;
  }
  return PS_OK;
}

typedef struct {
  ps_float_fn fn;
  void *user;
} float_tramp;

static int float_piece(const void *values, size_t n, size_t first, void *user) {
  const float_tramp *t = user;
  return t->fn(values, n, first, t->user);
}

int ps_segview_each_float_range(const ps_segview *v, size_t first, size_t count, ps_float_fn fn,
                                void *user) {
  float_tramp t = {fn, user};
  return ps_segview_each_elem_range(v, 4, first, count, float_piece, &t);
}
