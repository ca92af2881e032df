/* Tests of common/util.c: scattered-byte views, host:port parsing, files. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../common/util.h"
#include "check.h"

typedef struct {
  float *out;
  size_t calls;
  size_t expect_next;
  int in_order;
  int aligned;
} collect;

static int collect_fn(const ps_ufloat *v, size_t n, size_t first, void *user) {
  collect *c = user;
  if (first != c->expect_next) c->in_order = 0;
  (void)c->aligned; /* pieces may sit at any address now */
  memcpy(c->out + first, (const void *)v, n * sizeof(float));
  c->expect_next = first + n;
  c->calls++;
  return 0;
}

/* Floats split at every awkward place: inside a value, at odd addresses. */
static void test_each_float_splits(void) {
  enum { N = 10007 };
  float *src = malloc(N * sizeof(float));
  for (int i = 0; i < N; i++) src[i] = (float)i * 0.5f - 7.0f;
  /* A byte buffer offset by one so that segments start misaligned. */
  uint8_t *raw = malloc(N * sizeof(float) + 1);
  memcpy(raw + 1, src, N * sizeof(float));
  const size_t cuts[][4] = {{0, 0, 0, 0}, {1, 2, 3, 0}, {4001, 4002, 9999, 0}, {13, 17, 40000, 0}};
  for (size_t t = 0; t < sizeof cuts / sizeof cuts[0]; t++) {
    ps_seg segs[5];
    size_t prev = 0;
    int ns = 0;
    for (int k = 0; k < 4 && cuts[t][k]; k++) {
      segs[ns++] = (ps_seg){raw + 1 + prev, cuts[t][k] - prev};
      prev = cuts[t][k];
    }
    segs[ns++] = (ps_seg){raw + 1 + prev, N * sizeof(float) - prev};
    ps_segview v = {segs, ns, N * sizeof(float)};
    float *out = calloc(N, sizeof(float));
    collect c = {out, 0, 0, 1, 1};
    CHECK(ps_segview_each_float(&v, collect_fn, &c) == 0);
    CHECK(c.in_order && c.aligned);
    CHECK(c.expect_next == N);
    CHECK(memcmp(out, src, N * sizeof(float)) == 0);
    free(out);
  }
  free(raw);
  free(src);
}

static int stop_at_3(const ps_ufloat *v, size_t n, size_t first, void *user) {
  return first + n > 3 ? 42 : 0;
}

static void test_each_float_stops(void) {
  float vals[8] = {0};
  ps_seg segs[3] = {{(uint8_t *)vals, 8}, {(uint8_t *)vals + 8, 8}, {(uint8_t *)vals + 16, 16}};
  ps_segview v = {segs, 3, 32};
  CHECK(ps_segview_each_float(&v, stop_at_3, NULL) == 42);
}

static void test_segview_copy(void) {
  uint8_t a[] = {1, 2, 3}, b[] = {4, 5}, c[] = {6, 7, 8, 9};
  ps_seg segs[3] = {{a, 3}, {b, 2}, {c, 4}};
  ps_segview v = {segs, 3, 9};
  uint8_t out[9] = {0};
  CHECK(ps_segview_copy(&v, 2, out, 5) == 0);
  CHECK(out[0] == 3 && out[1] == 4 && out[2] == 5 && out[3] == 6 && out[4] == 7);
  uint8_t guard[4] = {0xee, 0xee, 0xee, 0xee};
  CHECK(ps_segview_copy(&v, 7, guard, 3) == PS_ERANGE);
  CHECK(guard[0] == 0xee); /* untouched on error */
  CHECK(ps_segview_copy(&v, 9, out, 0) == 0);
}

static void test_hostport(void) {
  char host[64];
  int port = 0;
  CHECK(ps_parse_hostport("127.0.0.1:5000", host, sizeof host, &port) == 0);
  CHECK(strcmp(host, "127.0.0.1") == 0 && port == 5000);
  CHECK(ps_parse_hostport("[::1]:7", host, sizeof host, &port) == 0);
  CHECK(strcmp(host, "[::1]") == 0 && port == 7);
  CHECK(ps_parse_hostport("nohost", host, sizeof host, &port) != 0);
  CHECK(ps_parse_hostport(":80", host, sizeof host, &port) != 0);
  CHECK(ps_parse_hostport("h:99999", host, sizeof host, &port) != 0);
  CHECK(ps_parse_hostport("h:12x", host, sizeof host, &port) != 0);
}

static void test_read_file(void) {
  char path[] = "/tmp/ps-test-util-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  CHECK(write(fd, "hello\n", 6) == 6);
  close(fd);
  char *text = NULL, err[PS_ERRLEN];
  size_t len = 0;
  CHECK(ps_read_file(path, &text, &len, err) == 0);
  CHECK(len == 6 && strcmp(text, "hello\n") == 0);
  free(text);
  unlink(path);
  CHECK(ps_read_file(path, &text, &len, err) == PS_EIO);
  CHECK(strstr(err, path) != NULL);
  CHECK(text == NULL);
}

static void test_alloc(void) {
  float *p = ps_alloc(100 * sizeof(float));
  CHECK(p != NULL && ((uintptr_t)p & 63) == 0);
  int zero = 1;
  for (int i = 0; i < 100; i++) zero &= p[i] == 0.0f;
  CHECK(zero);
  ps_free(p);
  CHECK(ps_alloc(SIZE_MAX - 10) == NULL);
}

/* A sub-range of the floats, over segments cut at every awkward place,
 * equals the same sub-range of the whole. */
static void test_each_float_range(void) {
  enum { N = 1001 };
  float src[N];
  for (int i = 0; i < N; i++) src[i] = (float)i * 0.25f + 1.0f;
  uint8_t *raw = malloc(N * 4 + 1);
  memcpy(raw + 1, src, N * 4);
  const size_t cuts[] = {1, 2, 7, 400, 401, 2001, 2003, 4003};
  ps_seg segs[9];
  size_t prev = 0;
  int ns = 0;
  for (int k = 0; k < 8; k++) {
    segs[ns++] = (ps_seg){raw + 1 + prev, cuts[k] - prev};
    prev = cuts[k];
  }
  segs[ns++] = (ps_seg){raw + 1 + prev, N * 4 - prev};
  ps_segview v = {segs, ns, N * 4};
  const size_t ranges[][2] = {{0, N}, {0, 1}, {1, 1}, {100, 401}, {500, 501}, {N - 1, 1}, {3, 0}};
  for (size_t t = 0; t < sizeof ranges / sizeof ranges[0]; t++) {
    float *out = calloc(N, sizeof(float));
    collect c = {out, 0, ranges[t][0], 1, 1};
    CHECK(ps_segview_each_float_range(&v, ranges[t][0], ranges[t][1], collect_fn, &c) == 0);
    CHECK(c.in_order && c.expect_next == ranges[t][0] + ranges[t][1]);
    CHECK(memcmp(out + ranges[t][0], src + ranges[t][0], ranges[t][1] * 4) == 0);
    free(out);
  }
  float dummy[1];
  collect c = {dummy, 0, 0, 1, 1};
  CHECK(ps_segview_each_float_range(&v, N - 1, 2, collect_fn, &c) == PS_ERANGE);
  free(raw);
}

int main(void) {
  RUN(test_each_float_range);
  RUN(test_each_float_splits);
  RUN(test_each_float_stops);
  RUN(test_segview_copy);
  RUN(test_hostport);
  RUN(test_read_file);
  RUN(test_alloc);
  return check_summary();
}
