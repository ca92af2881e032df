/* Table-driven command-line flags: parsing, --help and the README's
 * Markdown table from one description (see options.h). */
#include "options.h"

#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { HELP_ID = 1000, MARKDOWN_ID = 1001 };

/* Writes "a, b or c" for a choice list. */
static void choices_text(const char *const *c, char *buf, size_t len) {
  size_t n = 0, used = 0;
  while (c[n]) n++;
  buf[0] = '\0';
  for (size_t i = 0; i < n && used < len; i++) {
    const char *sep = i == 0 ? "" : i + 1 == n ? " or " : ", ";
    int k = snprintf(buf + used, len - used, "%s%s", sep, c[i]);
    if (k < 0) break;
    used += (size_t)k;
  }
}

/* Parses one value by the row's rule into out; on failure prints why. */
static int set_value(const char *prog, const ps_option *o, const char *arg, void *out) {
  char *field = (char *)out + o->offset;
  char *end = NULL;
  switch (o->kind) {
    case PS_OPT_FLAG:
      *(int *)field = 1;
      return 0;
    case PS_OPT_INT:
    case PS_OPT_I64: {
      long long v = strtoll(arg, &end, 10);
      if (!*arg || *end || (double)v < o->lo || (double)v > o->hi) {
        fprintf(stderr, "%s: --%s wants an integer in [%.0f, %.0f], not '%s'\n", prog, o->name,
                o->lo, o->hi, arg);
        return -1;
      }
      if (o->kind == PS_OPT_INT)
        *(int *)field = (int)v;
      else
        *(int64_t *)field = (int64_t)v;
      return 0;
    }
    case PS_OPT_SECS: {
      double v = strtod(arg, &end);
      int low = o->excl_lo ? !(v > o->lo) : !(v >= o->lo);
      if (!*arg || *end || !isfinite(v) || low) {
        fprintf(stderr, "%s: --%s wants a number %s %s %g, not '%s'\n", prog, o->name,
                o->arg ? o->arg : "", o->excl_lo ? ">" : ">=", o->lo, arg);
        return -1;
      }
      *(double *)field = v;
      return 0;
    }
    case PS_OPT_STR:
      *(const char **)field = arg;
      return 0;
    case PS_OPT_CHOICE:
      for (int i = 0; o->choices[i]; i++)
        if (strcmp(arg, o->choices[i]) == 0) {
          *(int *)field = i;
          return 0;
        }
      char list[256];
      choices_text(o->choices, list, sizeof list);
      fprintf(stderr, "%s: --%s wants %s, not '%s'\n", prog, o->name, list, arg);
      return -1;
  }
  return -1;
}

int ps_options_defaults(const ps_optspec *s, void *out) {
  for (int i = 0; i < s->n_opts; i++) {
    const ps_option *o = &s->opts[i];
    if (o->def && o->kind != PS_OPT_FLAG && set_value(s->prog, o, o->def, out) != 0) return -1;
  }
  return 0;
}

int ps_options_parse(const ps_optspec *s, int argc, char **argv, void *out) {
  struct option *lo = calloc((size_t)s->n_opts + 3, sizeof *lo);
  if (!lo) {
    fprintf(stderr, "%s: out of memory\n", s->prog);
    return 2;
  }
  for (int i = 0; i < s->n_opts; i++) {
    lo[i].name = s->opts[i].name;
    lo[i].has_arg = s->opts[i].kind == PS_OPT_FLAG ? no_argument : required_argument;
    lo[i].val = i;
  }
  lo[s->n_opts] = (struct option){"help", no_argument, 0, HELP_ID};
  lo[s->n_opts + 1] = (struct option){"help-markdown", no_argument, 0, MARKDOWN_ID};
  int rc = 0, c;
  optind = 0; /* GNU getopt: start afresh (a program or a test may parse twice) */
  opterr = 1; /* getopt says which flag is unknown or lacks its argument */
  while (rc == 0 && (c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
    if (c == 'h' || c == HELP_ID) {
      ps_options_help(s, stdout);
      rc = 1;
    } else if (c == MARKDOWN_ID) {
      ps_options_markdown(s, stdout);
      rc = 1;
    } else if (c >= 0 && c < s->n_opts) {
      if (set_value(s->prog, &s->opts[c], optarg, out) != 0) rc = 2;
    } else {
      fprintf(stderr, "%s: see --help for the flags\n", s->prog);
      rc = 2;
    }
  }
  if (rc == 0 && optind < argc) {
    fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", s->prog, argv[optind]);
    rc = 2;
  }
  free(lo);
  return rc;
}

/* The default as shown to users: the def value, or the words for it. */
static const char *default_text(const ps_option *o) {
  if (o->def_doc) return o->def_doc;
  if (o->kind == PS_OPT_FLAG) return NULL;
  return o->def;
}

/* Prints text without backticks, wrapped at width 79 from column col,
 * each continuation line indented to col. */
static void wrap(FILE *f, const char *text, int col, int first_col) {
  const int width = 79;
  int at = first_col;
  const char *p = text;
  while (*p) {
    while (*p == ' ') p++;
    if (!*p) break;
    const char *w = p;
    int len = 0;
    while (*p && *p != ' ') {
      if (*p != '`') len++;
      p++;
    }
    if (at > col && at + 1 + len > width) {
      fprintf(f, "\n%*s", col, "");
      at = col;
    } else if (at > col) {
      fputc(' ', f);
      at++;
    } else if (at < col) {
      fprintf(f, "%*s", col - at, "");
      at = col;
    }
    for (const char *q = w; q < p; q++)
      if (*q != '`') fputc(*q, f);
    at += len;
  }
  fputc('\n', f);
}

void ps_options_help(const ps_optspec *s, FILE *f) {
  fprintf(f, "%s\n", s->synopsis);
  enum { COL = 24 };
  for (int i = 0; i < s->n_opts; i++) {
    const ps_option *o = &s->opts[i];
    char head[96];
    int n = snprintf(head, sizeof head, "  --%s%s%s", o->name, o->arg ? " " : "",
                     o->arg ? o->arg : "");
    fputs(head, f);
    char text[2048];
    const char *d = default_text(o);
    if (d)
      snprintf(text, sizeof text, "%s (default: %s)", o->help, d);
    else
      snprintf(text, sizeof text, "%s", o->help);
    if (n + 1 >= COL) {
      fputc('\n', f);
      n = 0;
    }
    wrap(f, text, COL, n);
  }
  fputs("  --help", f);
  wrap(f, "this text; --help-markdown: the flag table in Markdown, as in docs/flags.md", COL, 8);
  if (s->footer) fprintf(f, "\n%s\n", s->footer);
}

/* Writes text with '|' escaped, for a Markdown table cell. */
static void md_cell(FILE *f, const char *text) {
  for (const char *p = text; *p; p++) {
    if (*p == '|') fputc('\\', f);
    fputc(*p, f);
  }
}

void ps_options_markdown(const ps_optspec *s, FILE *f) {
  fprintf(f, "| flag | default | meaning |\n| --- | --- | --- |\n");
  for (int i = 0; i < s->n_opts; i++) {
    const ps_option *o = &s->opts[i];
    fprintf(f, "| `--%s%s%s` | ", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
    if (o->def_doc)
      md_cell(f, o->def_doc);
    else if (o->def && o->kind != PS_OPT_FLAG)
      fprintf(f, "`%s`", o->def);
    fputs(" | ", f);
    md_cell(f, o->help);
    fputs(" |\n", f);
  }
}
