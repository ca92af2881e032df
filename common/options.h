/* Command-line flags described once: a program lists its flags in one
 * table (name, argument, kind and bounds, default, help text), and that
 * table drives parsing, `--help`, and the Markdown flag table of
 * docs/flags.md (`--help-markdown` prints it; a test checks docs/flags.md
 * holds exactly that). Adding a flag is adding one row.
 *
 * Values are written into the program's options struct at each row's
 * offset, so the table needs no parsing code of its own. */
#ifndef PS_COMMON_OPTIONS_H
#define PS_COMMON_OPTIONS_H

#include <stddef.h>
#include <stdio.h>

typedef enum {
  PS_OPT_FLAG,   /* no argument: the int at offset becomes 1 */
  PS_OPT_INT,    /* int in [lo, hi] */
  PS_OPT_I64,    /* int64_t in [lo, hi] */
  PS_OPT_SECS,   /* double: a finite number >= lo (> lo when excl_lo): seconds, or any
                  * other quantity (the error names it by the row's arg) */
  PS_OPT_STR,    /* const char *: the argument itself (argv's storage) */
  PS_OPT_CHOICE, /* int: the index of the argument in choices */
} ps_opt_kind;

typedef struct {
  const char *name;  /* without the dashes: "max-steps" */
  const char *arg;   /* what the argument is, for help: "N", "FILE"; NULL for a flag */
  ps_opt_kind kind;
  size_t offset;     /* offsetof(the options struct, the field) */
  double lo, hi;     /* INT, I64: bounds (inclusive); SECS: lo */
  int excl_lo;       /* SECS: the value must be above lo, not equal to it */
  const char *const *choices; /* CHOICE: NULL-terminated */
  /* The value before parsing, written as a user would write the flag's
   * argument (parsed by the row's own rule), or NULL: the field keeps what
   * the program set, and def_doc says what that means ("the job's"). */
  const char *def;
  const char *def_doc;
  /* One paragraph; `code` in backticks (kept in Markdown, dropped in
   * --help). */
  const char *help;
} ps_option;

typedef struct {
  const char *prog;     /* "ps-worker": the prefix of every message */
  const char *synopsis; /* the usage lines and a sentence, printed before the flags */
  const ps_option *opts;
  int n_opts;
  const char *footer;   /* printed after the flags (may be NULL) */
} ps_optspec;

/* Sets every field whose row has a def to that value. Returns 0, or -1 if
 * a def does not parse (a bug in the table; the message is on stderr). */
int ps_options_defaults(const ps_optspec *s, void *out);

/* Parses argv into out (after ps_options_defaults and the program's own
 * initial values). Returns 0 to go on; 1 when --help or --help-markdown
 * was printed on stdout (the program exits 0); 2 on a bad flag, a bad
 * value or a stray argument, with a message on stderr that names the flag
 * and what it wants (the program exits 2). Fields of flags not given keep
 * their values. */
int ps_options_parse(const ps_optspec *s, int argc, char **argv, void *out);

/* --help: the synopsis, one entry per flag with its default, the footer. */
void ps_options_help(const ps_optspec *s, FILE *f);

/* The flag table in Markdown (| flag | default | meaning |), as
 * docs/flags.md holds it. */
void ps_options_markdown(const ps_optspec *s, FILE *f);

#endif
