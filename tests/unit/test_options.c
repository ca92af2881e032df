/* Tests of common/options.c: one table drives parsing, --help and the
 * Markdown table; bad values are refused with the flag's name and leave
 * the other fields as they were. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../common/options.h"
#include "check.h"

typedef struct {
  const char *name;
  int count, on, mode;
  int64_t big;
  double secs, pos;
} opts;

static const char *const modes[] = {"fast", "slow", "auto", NULL};

static const ps_option table[] = {
    {"name", "S", PS_OPT_STR, offsetof(opts, name), .help = "a `name` | with a bar"},
    {"count", "N", PS_OPT_INT, offsetof(opts, count), 1, 10, .def = "3", .help = "how many"},
    {"on", NULL, PS_OPT_FLAG, offsetof(opts, on), .help = "switch on"},
    {"mode", "M", PS_OPT_CHOICE, offsetof(opts, mode), .choices = modes, .def = "auto",
     .help = "`fast`, `slow` or `auto`"},
    {"big", "N", PS_OPT_I64, offsetof(opts, big), 0, 1e12, .def_doc = "the job's",
     .help = "a large count"},
    {"secs", "SEC", PS_OPT_SECS, offsetof(opts, secs), 0, .def = "1.5", .help = "seconds"},
    {"pos", "SEC", PS_OPT_SECS, offsetof(opts, pos), 0, .excl_lo = 1, .def = "5",
     .help = "positive seconds"},
};
static const ps_optspec spec = {"prog", "Usage: prog [options]\n", table, 7, "The end."};

/* Parses a NULL-terminated argument list (argv[0] added). */
static int parse(opts *o, const char *const *args) {
  char *argv[16] = {"prog"};
  int argc = 1;
  while (args[argc - 1]) {
    argv[argc] = (char *)args[argc - 1];
    argc++;
  }
  return ps_options_parse(&spec, argc, argv, o);
}

static void test_defaults_and_values(void) {
  opts o = {.big = -1};
  CHECK(ps_options_defaults(&spec, &o) == 0);
  CHECK(o.count == 3 && o.mode == 2 && o.secs == 1.5 && o.pos == 5 && o.big == -1 && !o.name);
  const char *args[] = {"--name", "x", "--count", "10", "--on", "--mode", "slow", "--big",
                        "1000000000000", "--secs=0", "--pos", "0.25", NULL};
  CHECK(parse(&o, args) == 0);
  CHECK(o.name && strcmp(o.name, "x") == 0);
  CHECK(o.count == 10 && o.on == 1 && o.mode == 1 && o.big == 1000000000000LL);
  CHECK(o.secs == 0 && o.pos == 0.25);
}

/* Each bad value is refused (2) and changes nothing. */
static void test_refused(void) {
  const char *bad[][3] = {{"--count", "0"},   {"--count", "11"},  {"--count", "3x"},
                          {"--count", ""},    {"--mode", "Fast"}, {"--big", "-1"},
                          {"--secs", "-1"},   {"--secs", "nan"},  {"--secs", "inf"},
                          {"--pos", "0"},     {"--pos", "1s"},    {"stray"},
                          {"--unknown", "1"}, {"--count"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    opts o = {0};
    ps_options_defaults(&spec, &o);
    opts before = o;
    const char *args[4] = {bad[i][0], bad[i][1], NULL, NULL};
    CHECK_MSG(parse(&o, args) == 2, "%s %s accepted", bad[i][0], bad[i][1] ? bad[i][1] : "");
    CHECK_MSG(memcmp(&o, &before, sizeof o) == 0, "%s changed the options", bad[i][0]);
  }
}

/* Runs fn(f) and returns what it printed (malloc'd). */
static char *capture(void (*fn)(const ps_optspec *, FILE *)) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  fn(&spec, f);
  fclose(f);
  return buf;
}

static void test_help_and_markdown(void) {
  char *help = capture(ps_options_help);
  CHECK(strstr(help, "Usage: prog [options]") != NULL);
  CHECK(strstr(help, "  --count N") != NULL && strstr(help, "(default: 3)") != NULL);
  CHECK(strstr(help, "(default: the job's)") != NULL);
  CHECK(strstr(help, "fast, slow or auto") != NULL); /* backticks dropped */
  CHECK(strstr(help, "  --help") != NULL && strstr(help, "The end.") != NULL);
  for (char *line = help; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
    char *nl = strchr(line, '\n');
    size_t n = nl ? (size_t)(nl - line) : strlen(line);
    CHECK_MSG(n <= 79, "a --help line of %zu characters", n);
  }
  free(help);
  char *md = capture(ps_options_markdown);
  CHECK(strstr(md, "| flag | default | meaning |\n| --- | --- | --- |\n") == md);
  CHECK(strstr(md, "| `--name S` |  | a `name` \\| with a bar |\n") != NULL);
  CHECK(strstr(md, "| `--count N` | `3` | how many |\n") != NULL);
  CHECK(strstr(md, "| `--big N` | the job's | a large count |\n") != NULL);
  CHECK(strstr(md, "| `--on` |  | switch on |\n") != NULL);
  free(md);
  /* --help stops parsing with 1 (printed on stdout, silenced here). */
  fflush(stdout);
  int saved = dup(1);
  FILE *null = freopen("/dev/null", "w", stdout);
  opts o = {0};
  const char *args[] = {"--help", NULL};
  int rc = parse(&o, args);
  const char *args2[] = {"--help-markdown", NULL};
  int rc2 = parse(&o, args2);
  fflush(stdout);
  dup2(saved, 1);
  close(saved);
  (void)null;
  CHECK(rc == 1 && rc2 == 1);
}

int main(void) {
  RUN(test_defaults_and_values);
  RUN(test_refused);
  RUN(test_help_and_markdown);
  return check_summary();
}
