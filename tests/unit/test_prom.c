/* Tests of common/prom.c: the exposition text (families, labels escaped,
 * cumulative histogram buckets, NaN and infinities, process metrics) and
 * the HTTP endpoint over a real socket (the token, the paths and methods,
 * a port the kernel picks, an address in use refused with a message). */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "../../common/prom.h"
#include "../../common/util.h"
#include "check.h"

static void test_text(void) {
  ps_prom_buf *b = ps_prom_buf_new();
  ps_prom_metric(b, "x_total", "counter", "A count.", "shard=\"1\"", 42);
  ps_prom_sample(b, "g", NULL, 0.25);
  ps_prom_sample(b, "n", NULL, NAN);
  ps_prom_sample(b, "p", NULL, INFINITY);
  ps_prom_sample(b, "m", NULL, -INFINITY);
  ps_prom_sample(b, "big", NULL, 18446744073709551615.0);
  double bounds[2] = {0.5, 1};
  uint64_t counts[3] = {2, 3, 4};
  ps_prom_family(b, "h", "histogram", "A histogram.");
  ps_prom_histogram(b, "h", "a=\"b\"", bounds, counts, 2, 7.5);
  ps_prom_histogram(b, "h2", NULL, bounds, counts, 2, 1);
  size_t len;
  const char *t = ps_prom_text(b, &len);
  CHECK(len == strlen(t));
  CHECK(strstr(t, "# HELP x_total A count.\n# TYPE x_total counter\nx_total{shard=\"1\"} 42\n"));
  CHECK(strstr(t, "\ng 0.25\n"));
  CHECK(strstr(t, "\nn NaN\n"));
  CHECK(strstr(t, "\np +Inf\n"));
  CHECK(strstr(t, "\nm -Inf\n"));
  CHECK_MSG(strstr(t, "\nbig 1.84467440737096e+19\n"), "%s", t);
  /* buckets are cumulative, +Inf holds the count */
  CHECK(strstr(t, "h_bucket{a=\"b\",le=\"0.5\"} 2\nh_bucket{a=\"b\",le=\"1\"} 5\n"
                  "h_bucket{a=\"b\",le=\"+Inf\"} 9\nh_sum{a=\"b\"} 7.5\nh_count{a=\"b\"} 9\n"));
  CHECK(strstr(t, "h2_bucket{le=\"0.5\"} 2\n"));
  CHECK(strstr(t, "h2_count 9\n"));
  ps_prom_buf_free(b);
}

static void test_label(void) {
  char l[64];
  CHECK(strcmp(ps_prom_label(l, sizeof l, "job", "a\"b\\c"), "job=\"a\\\"b\\\\c\"") == 0);
  /* control characters and invalid UTF-8 do not pass */
  ps_prom_label(l, sizeof l, "h", "x\ny\xff");
  CHECK(strchr(l, '\n') == NULL);
  CHECK(ps_utf8_valid_len(l, strlen(l)) == strlen(l));
  /* cut on a character boundary, closed */
  char s[12];
  ps_prom_label(s, sizeof s, "k", "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9");
  CHECK_MSG(strlen(s) < sizeof s && s[strlen(s) - 1] == '"', "%s", s);
  CHECK(ps_utf8_valid_len(s, strlen(s)) == strlen(s));
  CHECK(strcmp(s, "k=\"\xc3\xa9\xc3\xa9\xc3\xa9\"") == 0);
}

static void test_process(void) {
  ps_prom_buf *b = ps_prom_buf_new();
  ps_prom_process(b, "test");
  const char *t = ps_prom_text(b, NULL);
  CHECK(strstr(t, "ps_build_info{program=\"test\",version=\""));
  /* the samples (after a newline: not the # HELP lines) */
  const char *names[] = {"\nprocess_resident_memory_bytes ", "\nprocess_open_fds ",
                         "\nprocess_max_fds ", "\nprocess_start_time_seconds ",
                         "\nprocess_threads "};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    const char *p = strstr(t, names[i]);
    CHECK_MSG(p != NULL, "%s missing", names[i]);
    if (p) CHECK_MSG(strtod(p + strlen(names[i]), NULL) > 0, "%s not positive", names[i]);
  }
  /* the start time is this process's: within a day of now */
  CHECK(strstr(t, "\nprocess_cpu_seconds_total ") != NULL);
  const char *p = strstr(t, "\nprocess_start_time_seconds ");
  if (p) CHECK(fabs(strtod(p + 28, NULL) - ps_wall_s()) < 86400);
  ps_prom_buf_free(b);
}

static int scrapes;
static void collect(ps_prom_buf *b, void *user) {
  scrapes++;
  ps_prom_metric(b, "t_value", "gauge", "A value.", NULL, *(double *)user);
}

/* One HTTP/1.0 exchange with 127.0.0.1:port; the reply in out. The status
 * code, or -1. */
static int http(int port, const char *request, char *out, size_t cap) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  if (write(fd, request, strlen(request)) != (ssize_t)strlen(request)) {
    close(fd);
    return -1;
  }
  size_t n = 0;
  for (int i = 0; i < 1000 && n + 1 < cap; i++) {
    ssize_t r = read(fd, out + n, cap - 1 - n);
    if (r <= 0) break;
    n += (size_t)r;
  }
  out[n] = 0;
  close(fd);
  int code = -1;
  if (sscanf(out, "HTTP/1.%*d %d", &code) != 1) return -1;
  return code;
}

static void test_endpoint(void) {
  ps_token tok = {.len = 20};
  memcpy(tok.bytes, "0123456789abcdefghij", 20);
  double value = 3.5;
  char err[PS_ERRLEN], reply[8192];
  ps_prom_opts o = {.host = "127.0.0.1", .port = 0, .tokens = {&tok, NULL}};
  ps_prom_server *s = ps_prom_start(&o, collect, &value, err);
  CHECK_MSG(s != NULL, "%s", err);
  if (!s) return;
  int port = ps_prom_port(s);
  CHECK(port > 0);
  CHECK(http(port, "GET /metrics HTTP/1.0\r\n\r\n", reply, sizeof reply) == 401);
  CHECK(strstr(reply, "WWW-Authenticate: Bearer") != NULL);
  CHECK(http(port, "GET /metrics HTTP/1.0\r\nAuthorization: Bearer 0123456789abcdefghiX\r\n\r\n",
             reply, sizeof reply) == 401);
  CHECK(http(port, "GET /metrics HTTP/1.0\r\nAuthorization: Bearer 0123456789abcdefghi\r\n\r\n",
             reply, sizeof reply) == 401); /* a prefix is not the token */
  CHECK(scrapes == 0);
  CHECK(http(port, "GET /metrics HTTP/1.0\r\nAuthorization: Bearer 0123456789abcdefghij\r\n\r\n",
             reply, sizeof reply) == 200);
  CHECK(scrapes == 1);
  CHECK(strstr(reply, "Content-Type: text/plain; version=0.0.4") != NULL);
  CHECK(strstr(reply, "\r\n\r\n# HELP t_value A value.\n# TYPE t_value gauge\nt_value 3.5\n"));
  CHECK(http(port, "GET /other HTTP/1.0\r\nAuthorization: bearer 0123456789abcdefghij\r\n\r\n",
             reply, sizeof reply) == 404);
  CHECK(http(port, "POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc", reply,
             sizeof reply) == 405);
  CHECK(http(port, "GET / HTTP/1.0\r\nAuthorization: Bearer 0123456789abcdefghij\r\n\r\n",
             reply, sizeof reply) == 200);
  CHECK(strstr(reply, "/metrics") != NULL);
  /* garbage instead of a request: refused, and the endpoint goes on */
  int g = http(port, "\x01\x02 junk\r\n\r\n", reply, sizeof reply);
  CHECK_MSG(g == 400 || g == -1, "garbage answered %d", g);
  char big[9000];
  memset(big, 'a', sizeof big);
  memcpy(big, "GET /", 5);
  memcpy(big + sizeof big - 20, " HTTP/1.0\r\n\r\n", 14);
  big[sizeof big - 6] = 0;
  g = http(port, big, reply, sizeof reply);
  CHECK_MSG(g == 414 || g == 400 || g == 431 || g == 404 || g == 401 || g == -1,
            "a long path answered %d", g);
  CHECK(http(port, "GET /metrics HTTP/1.0\r\nAuthorization: Bearer 0123456789abcdefghij\r\n\r\n",
             reply, sizeof reply) == 200);
  /* a second endpoint on the same port is refused, with the reason */
  ps_prom_opts o2 = {.host = "127.0.0.1", .port = port};
  ps_prom_server *s2 = ps_prom_start(&o2, collect, &value, err);
  CHECK(s2 == NULL);
  CHECK_MSG(strstr(err, "in use") != NULL, "%s", err);
  ps_prom_stop(s2);
  /* a name that does not resolve */
  ps_prom_opts o3 = {.host = "no-such-host.invalid", .port = 0};
  CHECK(ps_prom_start(&o3, collect, &value, err) == NULL);
  CHECK_MSG(strstr(err, "cannot resolve") != NULL, "%s", err);
  /* a certificate without its key */
  ps_prom_opts o4 = {.host = "127.0.0.1", .tls_cert = "/nonexistent.pem"};
  CHECK(ps_prom_start(&o4, collect, &value, err) == NULL);
  ps_prom_stop(s);
  /* stopped: the port is closed */
  CHECK(http(port, "GET /metrics HTTP/1.0\r\n\r\n", reply, sizeof reply) == -1);
  /* without tokens the endpoint is open */
  ps_prom_opts open = {.host = "127.0.0.1"};
  s = ps_prom_start(&open, collect, &value, err);
  CHECK_MSG(s != NULL, "%s", err);
  if (s) {
    CHECK(http(ps_prom_port(s), "GET /metrics HTTP/1.0\r\n\r\n", reply, sizeof reply) == 200);
    ps_prom_stop(s);
  }
}

int main(void) {
  RUN(test_text);
  RUN(test_label);
  RUN(test_process);
  RUN(test_endpoint);
  return check_summary();
}
