/* Tests of common/tbevents.c: event files read back by a reader of their
 * own (TFRecord framing, both masked CRCs, the Events unpacked), the
 * checksums against known values, and the errors. */
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../../common/crc32c.h"
#include "../../common/tbevents.h"
#include "../../common/util.h"
#include "check.h"
#include "tmp_tree.h"
#include "proto/tb_event.pb-c.h"

/* CRC-32C bit by bit, from the definition: the reader's own. */
static uint32_t crc32c_bits(const uint8_t *p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; i++) {
    c ^= p[i];
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

static uint32_t masked(const uint8_t *p, size_t n) {
  uint32_t c = crc32c_bits(p, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static uint64_t le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int reader_quiet; /* set while a corrupt file is read on purpose */
#define SAY(...) (reader_quiet ? 0 : fprintf(stderr, __VA_ARGS__))

/* Splits buf into TFRecords and unpacks each as an Event: the count, or
 * -1 when a length, a checksum or an Event is wrong (said on stderr; the
 * Events unpacked so far freed). */
static int parse_records(const uint8_t *buf, size_t len, Tb__Event **evs, int max) {
  size_t pos = 0;
  int n = 0;
  while (pos < len) {
    if (len - pos < 16) {
      SAY("record %d: %zu bytes left, not a whole record\n", n, len - pos);
      goto bad;
    }
    uint64_t dlen = le64(buf + pos);
    if (le32(buf + pos + 8) != masked(buf + pos, 8)) {
      SAY("record %d: bad length checksum\n", n);
      goto bad;
    }
    if (dlen > len - pos - 16) {
      SAY("record %d: length %llu past the end\n", n, (unsigned long long)dlen);
      goto bad;
    }
    const uint8_t *data = buf + pos + 12;
    if (le32(data + dlen) != masked(data, (size_t)dlen)) {
      SAY("record %d: bad data checksum\n", n);
      goto bad;
    }
    if (n >= max) {
      SAY("more than %d records\n", max);
      goto bad;
    }
    evs[n] = tb__event__unpack(NULL, (size_t)dlen, data);
    if (!evs[n]) {
      SAY("record %d: not an Event\n", n);
      goto bad;
    }
    n++;
    pos += 16 + (size_t)dlen;
  }
  return n;
bad:
  for (int i = 0; i < n; i++) tb__event__free_unpacked(evs[i], NULL);
  return -1;
}

static int read_events(const char *path, Tb__Event **evs, int max) {
  char *buf;
  size_t len;
  char err[PS_ERRLEN];
  if (ps_read_file(path, &buf, &len, err) != 0) {
    fprintf(stderr, "%s\n", err);
    return -1;
  }
  int n = parse_records((const uint8_t *)buf, len, evs, max);
  free(buf);
  return n;
}

static void free_events(Tb__Event **evs, int n) {
  for (int i = 0; i < n; i++) tb__event__free_unpacked(evs[i], NULL);
}

/* The names in dir that hold "tfevents": how many, the first in first. */
static int event_files(const char *dir, char *first, size_t cap) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (strstr(e->d_name, "tfevents") && n++ == 0) snprintf(first, cap, "%s/%s", dir, e->d_name);
  closedir(d);
  return n;
}

static char tmp_root[64];

static void make_tmp_root(void) {
  snprintf(tmp_root, sizeof tmp_root, "/tmp/ps-test-tb.XXXXXX");
  if (!mkdtemp(tmp_root)) {
    perror("mkdtemp");
    exit(1);
  }
}

static void test_crc_vectors(void) {
  CHECK(ps_crc32c(0, "123456789", 9) == 0xE3069283u);
  CHECK(crc32c_bits((const uint8_t *)"123456789", 9) == 0xE3069283u);
  uint8_t zeros[32] = {0};
  CHECK(ps_crc32c(0, zeros, 32) == 0x8A9136AAu); /* RFC 3720 B.4 */
  /* (0xE3069283 rotated right by 15) + 0xa282ead8 */
  CHECK(ps_tb_masked_crc("123456789", 9) == 0xC78AB0E5u);
  CHECK(ps_tb_masked_crc(zeros, 8) == 0x07980329u); /* a record of 0 bytes' header */
  CHECK(masked((const uint8_t *)"123456789", 9) == ps_tb_masked_crc("123456789", 9));
}

static int has_tag(const Tb__Event *e, int i, const char *tag) {
  return e->what_case == TB__EVENT__WHAT_SUMMARY && e->summary && (int)e->summary->n_value > i &&
         !strcmp(e->summary->value[i]->tag, tag) &&
         e->summary->value[i]->value_case == TB__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
}

static void test_write_read(void) {
  char dir[128], path[512], err[PS_ERRLEN] = "";
  snprintf(dir, sizeof dir, "%s/a/b//run/", tmp_root); /* parents made, slashes doubled */
  double t0 = ps_wall_s();
  ps_tb *w = ps_tb_open(dir, err);
  CHECK_MSG(w != NULL, "%s", err);
  if (!w) return;
  CHECK(strstr(ps_tb_path(w), "/events.out.tfevents.") != NULL);
  CHECK(ps_tb_scalar(w, "train/loss", 1, 0.5f, err) == 0);
  const char *tags[] = {"test/accuracy", "staleness/mean", "a", "b", "c"};
  const float vals[] = {0.875f, 0.0f, NAN, INFINITY, -3.25f};
  CHECK(ps_tb_scalars(w, (int64_t)1 << 40, 5, tags, vals, err) == 0);
  CHECK(ps_tb_scalar(w, "train/loss", 0, -0.0f, err) == 0); /* step 0: off the wire, still 0 */
  CHECK(ps_tb_scalars(w, 3, 0, tags, vals, err) == PS_EINVAL);
  CHECK(ps_tb_scalars(NULL, 3, 1, tags, vals, err) == PS_EINVAL);
  CHECK(ps_tb_close(w, err) == 0);

  char rundir[128];
  snprintf(rundir, sizeof rundir, "%s/a/b/run", tmp_root);
  CHECK(event_files(rundir, path, sizeof path) == 1);
  Tb__Event *evs[8];
  int n = read_events(path, evs, 8);
  CHECK_MSG(n == 4, "%d events", n);
  if (n != 4) {
    if (n > 0) free_events(evs, n);
    return;
  }
  CHECK(evs[0]->what_case == TB__EVENT__WHAT_FILE_VERSION &&
        !strcmp(evs[0]->file_version, "brain.Event:2"));
  CHECK(evs[0]->wall_time >= t0 - 1 && evs[0]->wall_time <= ps_wall_s() + 1);
  CHECK(evs[1]->step == 1 && has_tag(evs[1], 0, "train/loss") && evs[1]->summary->n_value == 1);
  CHECK(evs[1]->summary->value[0]->simple_value == 0.5f);
  CHECK(evs[1]->wall_time >= evs[0]->wall_time);
  CHECK(evs[2]->step == (int64_t)1 << 40 && evs[2]->summary->n_value == 5);
  for (int i = 0; i < 5; i++) CHECK(has_tag(evs[2], i, tags[i]));
  const Tb__Summary__Value *const *v = (const Tb__Summary__Value *const *)evs[2]->summary->value;
  CHECK(v[0]->simple_value == 0.875f && v[1]->simple_value == 0.0f);
  CHECK(isnan(v[2]->simple_value) && isinf(v[3]->simple_value) && v[3]->simple_value > 0);
  CHECK(v[4]->simple_value == -3.25f);
  CHECK(evs[3]->step == 0 && has_tag(evs[3], 0, "train/loss"));
  CHECK(evs[3]->summary->value[0]->simple_value == 0.0f);
  free_events(evs, n);

  /* The reader sees a flipped byte. */
  char *buf;
  size_t len;
  CHECK(ps_read_file(path, &buf, &len, err) == 0);
  buf[len - 6] ^= 1;
  reader_quiet = 1;
  CHECK(parse_records((const uint8_t *)buf, len, evs, 8) == -1);
  reader_quiet = 0;
  free(buf);

  /* A second file in the same directory (the same second, likely): a new name. */
  w = ps_tb_open(rundir, err);
  CHECK_MSG(w != NULL, "%s", err);
  CHECK(w && strcmp(ps_tb_path(w), path) != 0);
  CHECK(ps_tb_close(w, err) == 0);
  CHECK(event_files(rundir, path, sizeof path) == 2);
}

enum { THREADS = 4, PER_THREAD = 200 };

typedef struct {
  ps_tb *w;
  int id, fails;
} writer_arg;

static void *writer_main(void *p) {
  writer_arg *a = p;
  char err[PS_ERRLEN];
  char tag[32];
  snprintf(tag, sizeof tag, "thread/%d", a->id);
  for (int i = 0; i < PER_THREAD; i++)
    if (ps_tb_scalar(a->w, tag, i, (float)(a->id * 1000 + i), err) != 0) a->fails++;
  return NULL;
}

/* Threads writing at once: every record whole, none lost. */
static void test_threads(void) {
  char dir[128], path[512], err[PS_ERRLEN] = "";
  snprintf(dir, sizeof dir, "%s/threads", tmp_root);
  ps_tb *w = ps_tb_open(dir, err);
  CHECK_MSG(w != NULL, "%s", err);
  if (!w) return;
  pthread_t th[THREADS];
  writer_arg args[THREADS];
  for (int t = 0; t < THREADS; t++) {
    args[t] = (writer_arg){w, t, 0};
    pthread_create(&th[t], NULL, writer_main, &args[t]);
  }
  for (int t = 0; t < THREADS; t++) {
    pthread_join(th[t], NULL);
    CHECK(args[t].fails == 0);
  }
  CHECK(ps_tb_close(w, err) == 0);
  CHECK(event_files(dir, path, sizeof path) == 1);
  enum { MAX = 1 + THREADS * PER_THREAD };
  Tb__Event **evs = calloc(MAX, sizeof *evs);
  int n = read_events(path, evs, MAX);
  CHECK_MSG(n == MAX, "%d events", n);
  int next[THREADS] = {0}, in_order = 1;
  for (int i = 1; i < n; i++) {
    int t = -1;
    if (evs[i]->summary && evs[i]->summary->n_value == 1)
      sscanf(evs[i]->summary->value[0]->tag, "thread/%d", &t);
    if (t < 0 || t >= THREADS || evs[i]->step != next[t] ||
        evs[i]->summary->value[0]->simple_value != (float)(t * 1000 + next[t])) {
      in_order = 0;
      break;
    }
    next[t]++;
  }
  CHECK(in_order);
  if (n > 0) free_events(evs, n);
  free(evs);
}

static void test_errors(void) {
  char file[128], sub[160], err[PS_ERRLEN] = "";
  snprintf(file, sizeof file, "%s/plain-file", tmp_root);
  FILE *f = fopen(file, "w");
  CHECK(f != NULL);
  if (f) fclose(f);
  /* DIR is a regular file. */
  CHECK(ps_tb_open(file, err) == NULL);
  CHECK_MSG(strstr(err, "not a directory") && strstr(err, "plain-file"), "%s", err);
  /* A parent of DIR is a regular file. */
  err[0] = '\0';
  snprintf(sub, sizeof sub, "%s/run", file);
  CHECK(ps_tb_open(sub, err) == NULL);
  CHECK_MSG(strstr(err, "cannot create TensorBoard directory") && strstr(err, "plain-file"), "%s",
            err);
  err[0] = '\0';
  CHECK(ps_tb_open("", err) == NULL && err[0]);
  CHECK(ps_tb_open(NULL, NULL) == NULL);
  CHECK(ps_tb_close(NULL, err) == 0);
  /* A directory that cannot be written (not as root, who may). */
  if (geteuid() != 0) {
    snprintf(sub, sizeof sub, "%s/ro", tmp_root);
    CHECK(mkdir(sub, 0555) == 0);
    err[0] = '\0';
    CHECK(ps_tb_open(sub, err) == NULL);
    CHECK_MSG(strstr(err, "cannot create TensorBoard file"), "%s", err);
  }
}

int main(void) {
  make_tmp_root();
  RUN(test_crc_vectors);
  RUN(test_write_read);
  RUN(test_threads);
  RUN(test_errors);
  remove_tree(tmp_root);
  return check_summary();
}
