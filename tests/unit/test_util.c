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
  ps_host_unbracket(host);
  CHECK(strcmp(host, "::1") == 0);
  char plain[] = "h[1]", one[] = "[";
  ps_host_unbracket(plain);
  ps_host_unbracket(one);
  CHECK(strcmp(plain, "h[1]") == 0 && strcmp(one, "[") == 0);
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

/* ---- UTF-8 and the logger ---- */

static void test_utf8_char_len(void) {
  const struct {
    const char *s;
    size_t n, want;
  } cases[] = {
      {"a", 1, 1},
      {"\x7f", 1, 1},
      {"\xc3\xa9", 2, 2},
      {"\xc3", 1, 0}, /* cut short */
      {"\xc3\x41", 2, 0},
      {"\x80", 1, 0}, /* lone continuation */
      {"\xc0\xaf", 2, 0},
      {"\xc1\xbf", 2, 0}, /* overlong 2-byte */
      {"\xe0\x80\xaf", 3, 0},
      {"\xe0\xa0\x80", 3, 3}, /* overlong / U+0800 */
      {"\xe2\x82\xac", 3, 3},
      {"\xed\x9f\xbf", 3, 3}, /* U+D7FF */
      {"\xed\xa0\x80", 3, 0},
      {"\xed\xbf\xbf", 3, 0}, /* surrogates */
      {"\xef\xbf\xbd", 3, 3},
      {"\xf0\x8f\xbf\xbf", 4, 0}, /* overlong 4-byte */
      {"\xf0\x9d\x84\x9e", 4, 4},
      {"\xf4\x8f\xbf\xbf", 4, 4}, /* U+10FFFF */
      {"\xf4\x90\x80\x80", 4, 0},
      {"\xf5\x80\x80\x80", 4, 0}, /* above it */
      {"\xf0\x9d\x84", 3, 0},
      {"\xff", 1, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    CHECK_MSG(ps_utf8_char_len((const uint8_t *)cases[i].s, cases[i].n) == cases[i].want,
              "case %zu", i);
  CHECK(ps_utf8_valid_len("ab\xc3\xa9\xe2\x82\xac", 7) == 7);
  CHECK(ps_utf8_valid_len("ab\xc3\xa9\xe2\x82", 6) == 4);
  CHECK(ps_utf8_valid_len("a\0b", 3) == 3); /* NUL is valid UTF-8 */
  CHECK(ps_utf8_valid_len("", 0) == 0);
}

/* Host names as a hostile worker sends them: too long for the field with
 * multi-byte characters, invalid bytes, control characters. */
static void test_utf8_sanitize(void) {
  char in[128], out[64];
  /* "a" then 23 euro signs: 70 bytes; 63 would cut the 21st sign. */
  strcpy(in, "a");
  for (int i = 0; i < 23; i++) strcat(in, "\xe2\x82\xac");
  CHECK(strlen(in) == 70);
  CHECK(ps_utf8_sanitize(out, sizeof out, in) == 61);
  CHECK(strlen(out) == 61 && memcmp(out, in, 61) == 0);
  CHECK(ps_utf8_valid_len(out, strlen(out)) == strlen(out));
  /* 35 e-acutes: 70 bytes, cut to 62. */
  in[0] = '\0';
  for (int i = 0; i < 35; i++) strcat(in, "\xc3\xa9");
  CHECK(ps_utf8_sanitize(out, sizeof out, in) == 62 && memcmp(out, in, 62) == 0);
  /* Control characters (newline, ESC, DEL, C1 CSI) and invalid bytes each
   * become U+FFFD; the rest is kept. */
  ps_utf8_sanitize(out, sizeof out, "h\nx\x1b[31m\x7f\xc2\x9b\xff\xc3\xa9");
  CHECK_MSG(
      strcmp(out, "h\xef\xbf\xbdx\xef\xbf\xbd[31m\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xc3\xa9") ==
          0,
      "%s", out);
  /* An overlong form is several invalid bytes, each replaced. */
  ps_utf8_sanitize(out, sizeof out, "\xc0\xaf");
  CHECK(strcmp(out, "\xef\xbf\xbd\xef\xbf\xbd") == 0);
  /* A replacement that does not fit is left out whole. */
  char small[5];
  CHECK(ps_utf8_sanitize(small, sizeof small, "ab\xff") == 2 && strcmp(small, "ab") == 0);
  CHECK(ps_utf8_sanitize(small, sizeof small, NULL) == 0 && small[0] == '\0');
  CHECK(ps_utf8_sanitize(small, 1, "abc") == 0 && small[0] == '\0');
}

/* What ps_log writes to stderr for one message. */
static char *log_line(const char *arg) {
  char path[] = "/tmp/test_util_log.XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) return NULL;
  fflush(stderr);
  int saved = dup(2);
  dup2(fd, 2);
  ps_log(PS_LOG_WARN, "worker registered (host %s)", arg);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  char *text = NULL;
  ps_read_file(path, &text, NULL, NULL);
  unlink(path);
  return text;
}

/* No message, whatever a caller passes in, makes more than one line or
 * reaches the terminal as a control sequence. */
static void test_log_escapes(void) {
  char *line = log_line(
      "evil\n12:00:00.000 ps-server info: forged\r\x1b[31mred\x7f"
      "\xc2\x9b\xff\t\xc3\xa9");
  CHECK(line != NULL);
  if (!line) return;
  size_t n = strlen(line);
  CHECK(n > 0 && line[n - 1] == '\n' && strchr(line, '\n') == line + n - 1);
  int ctl = 0;
  for (size_t i = 0; i + 1 < n; i++) ctl |= (unsigned char)line[i] < 0x20 || line[i] == 0x7f;
  CHECK(!ctl);
  CHECK(ps_utf8_valid_len(line, n) == n);
  CHECK_MSG(strstr(line,
                   "warn: worker registered (host evil\\n12:00:00.000 ps-server info: "
                   "forged\\r\\x1b[31mred\\x7f\\xc2\\x9b\\xff\\t\xc3\xa9)\n") != NULL,
            "%s", line);
  free(line);
  /* Characters that reorder or break a line on a terminal: escaped too. */
  line = log_line("a\xe2\x80\xae" "b\xe2\x80\xa8" "c\xe2\x81\xa6" "d\xe2\x80\x8f" "e\xd8\x9c" "\xe2\x82\xac");
  CHECK(line && strstr(line, "a\\xe2\\x80\\xaeb\\xe2\\x80\\xa8c\\xe2\\x81\\xa6d\\xe2\\x80\\x8fe\\xd8\\x9c\xe2\x82\xac)"));
  free(line);
  char clean[32];
  ps_utf8_sanitize(clean, sizeof clean, "x\xe2\x80\xaey");
  CHECK(strcmp(clean, "x\xef\xbf\xbdy") == 0);
}

static void test_little_endian(void) {
  /* The byte layout of files and requests, whatever the CPU's order, at
   * any alignment. */
  uint8_t b[16];
  for (int off = 0; off < 4; off++) {
    memset(b, 0xee, sizeof b);
    ps_put_le64(b + off, 0x0102030405060708ULL);
    ps_put_le32(b + off + 8, 0x0a0b0c0dU);
    const uint8_t want[12] = {8, 7, 6, 5, 4, 3, 2, 1, 0x0d, 0x0c, 0x0b, 0x0a};
    CHECK(memcmp(b + off, want, sizeof want) == 0);
    CHECK(ps_get_le64(b + off) == 0x0102030405060708ULL);
    CHECK(ps_get_le32(b + off + 8) == 0x0a0b0c0dU);
    if (off) CHECK(b[off - 1] == 0xee);
  }
}

int main(void) {
  RUN(test_utf8_char_len);
  RUN(test_little_endian);
  RUN(test_utf8_sanitize);
  RUN(test_log_escapes);
  RUN(test_each_float_range);
  RUN(test_each_float_splits);
  RUN(test_each_float_stops);
  RUN(test_segview_copy);
  RUN(test_hostport);
  RUN(test_read_file);
  RUN(test_alloc);
  return check_summary();
}
