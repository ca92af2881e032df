#!/usr/bin/env python3
"""The code's structure, drawn from the C sources and checked against the layers below.

Reads every .c and .cu file under ps/, worker/, tools/, common/ and kernels/ and finds which
file uses which: file A *uses* file B when A calls, or takes the address of, a function that B
alone defines without `static` (A != B). Then refuses

  circles          files that use each other, directly or through others (a strongly
                   connected set of two files or more);
  upward calls     a use of a file of a higher layer (or of a sibling folder of the same
                   rank), or a use across top folders other than tools/ -> anything,
                   ps/ and worker/ -> common/ and kernels/, kernels/ -> common/;
  long functions   a function of ps/, worker/ or tools/ (static or not) longer than
                   LONG_FUNCTION_LINES lines, from the line of its name to its closing
                   brace, unless ALLOW_LONG names it with a reason.

Prints every problem, then a summary line, and exits 1 when there is any, 0 otherwise.

  tests/docs/structure.py              check the tree (two levels above this script)
  tests/docs/structure.py --graph      the folder-level graph as Markdown (docs/ARCHITECTURE.md)
  tests/docs/structure.py --dot        the same as Graphviz dot:  ... --dot | dot -Tsvg >s.svg
  tests/docs/structure.py --root DIR   check another tree (tests/docs/structure_selftest.py)
  tests/docs/structure.py --doc F [--fix]  also check (or rewrite) the folder table in F
                                       between <!-- structure graph --> markers

A rough reader of C (comments, strings and preprocessor lines dropped, braces counted), not a
compiler: good enough to see a knot. Standard library only."""
import argparse
import bisect
import os
import re
import sys
from collections import defaultdict

# ---- the layers: edit here -----------------------------------------------------------------
# A path prefix (relative to the repository root) and its rank; the longest matching prefix
# wins; a higher rank is a higher layer. A file may use files of its own layer (same entry)
# and files of a lower rank; never a higher rank (an "upward" call), nor a sibling entry of
# the same rank (a "sideways" call: worker/data/, worker/model/ and worker/client/ are peers).
LAYERS = {
    "common/":          0,   # shared plumbing: wire format, rpc framing, options, util, metrics
    "kernels/":         1,   # the compute backends (cpu, cuda, dnnl, emu) behind kernels/ops.h
    "ps/state/":       10,   # the server's state: tables, shards, leases, membership
    "ps/core/":        11,   # the shared state struct, updates and their one apply, request rows
    "ps/repl/":        12,   # replication of a shard between replicas
    "ps/ckpt/":        13,   # checkpoints: capture, the cut across shards, writing them
    "ps/rpc/":         14,   # the RPC handlers, answering pulls, pulls that wait, the sync step
    "ps/main/":        15,   # the server process: options, build, loop, metrics, --status
    "worker/data/":    20,   # input pipelines (cifar, ctr, npy, job files)
    "worker/model/":   20,   # the model, its devices and replicas
    "worker/client/":  20,   # the client of the parameter servers
    "worker/train/":   21,   # the training steps, evaluation, embedding rows
    "worker/main/":    22,   # the worker process: main, options, the loop
    "tools/":          30,   # programs neither server nor worker (ps-export, ps-import-keras, ps-ctr-gen)
}
# Files that sit in a folder but belong lower: (file prefix, rank). They keep their folder
# (the LAYERS entry above) and take this rank: files of any higher rank may use them, and
# they may use files of a lower rank and the layers of their own rank (here ps/state/).
RANK_OVERRIDES = [
    ("ps/ckpt/checkpoint.c", 10),   # the checkpoint file format: the state's on-disk form,
    ("ps/ckpt/table_ckpt.c", 10),   #   read by ps/ at any rank and by tools/
]
# Which top folder may use which other top folder (a use within one top folder is judged by
# rank alone).
ACROSS = {
    "tools":   {"ps", "worker", "common", "kernels"},   # the tools may use anything
    "ps":      {"common", "kernels"},                   # ps/ and worker/ never use each other
    "worker":  {"common", "kernels"},
    "kernels": {"common"},
    "common":  set(),
}

# ---- long functions --------------------------------------------------------------------------
LONG_FUNCTION_LINES = 150                     # longer than this (name line .. closing brace)
LONG_FUNCTION_DIRS = ("ps/", "worker/", "tools/")
# Exempted long functions: {"path:function": "reason"}; printed with the report.
ALLOW_LONG = {
}

SOURCE_DIRS = ("ps", "worker", "tools", "common", "kernels")
SOURCE_EXTS = (".c", ".cu")

# ---- reading C -------------------------------------------------------------------------------
_LEX = re.compile(r"""
    (?P<block>/\*.*?\*/)
  | (?P<line>//(?:[^\n\\]|\\.|\\\n)*)
  | (?P<str>"(?:[^"\\\n]|\\.|\\\n)*")
  | (?P<chr>'(?:[^'\\\n]|\\.)*')
""", re.S | re.X)


def strip_comments_and_strings(text):
    """Comments become spaces, strings "" and characters ''; every newline is kept, so line
    numbers stay right."""
    def repl(m):
        s = m.group(0)
        nl = "\n" * s.count("\n")
        if m.lastgroup in ("block", "line"):
            return " " + nl
        q = s[0]
        return q + q + nl
    return _LEX.sub(repl, text)


_PP = re.compile(r"^[ \t]*#(?:[^\n\\]|\\.|\\\n)*", re.M)


def blank_preprocessor(text, keep_define):
    """Preprocessor lines (with their continuations) become blank lines; with keep_define the
    bodies of #define are kept (a macro's calls are uses of the file that holds it)."""
    def repl(m):
        s = m.group(0)
        if keep_define and re.match(r"[ \t]*#[ \t]*define\b", s):
            return s.replace("\\\n", " \n")
        return re.sub(r"[^\n]", " ", s)
    return _PP.sub(repl, text)


_TOKEN = re.compile(r"[A-Za-z_]\w*|\S")
ATTRIBUTE_WORDS = {"__attribute__", "__declspec", "__launch_bounds__", "alignas", "_Alignas",
                   "__align__", "__asm__", "asm", "__asm"}
TRAILING_WORDS = {"const", "noexcept", "override", "throw"}
NOT_NAMES = {"if", "for", "while", "switch", "return", "sizeof", "do", "else", "case",
             "_Alignof", "alignof", "typeof", "__typeof__", "_Generic", "defined"}


_TOKEN_ARROW = re.compile(r"[A-Za-z_]\w*|->|\S")
# Words after which an identifier is an expression, not a declared name.
EXPRESSION_WORDS = {"return", "case", "else", "do", "sizeof", "goto", "throw", "new", "delete",
                    "co_return", "co_await", "co_yield", "_Alignof", "alignof", "typeof",
                    "__typeof__", "decltype", "defined", "__extension__"}


class Function:
    __slots__ = ("name", "line", "end", "static")

    def __init__(self, name, line, end, static):
        self.name, self.line, self.end, self.static = name, line, end, static

    @property
    def length(self):
        return self.end - self.line + 1


def find_functions(text, lines_at):
    """The function definitions of a file: a name, a parameter list, maybe attributes, and a
    `{` at top level (or inside extern "C" { }). `text` has no comments, strings or
    preprocessor lines."""
    toks = [(m.group(0), m.start()) for m in _TOKEN.finditer(text)]
    funcs = []
    stack = []          # per open brace: "extern" (transparent), or (Function|None)
    depth = 0           # braces open that are not extern "C"
    start = 0           # index of the first token of the current top-level declaration
    for i, (t, pos) in enumerate(toks):
        if t == "{":
            if depth == 0:
                if (i >= 3 and toks[i - 1][0] == '"' and toks[i - 2][0] == '"'
                        and toks[i - 3][0] == "extern"):
                    stack.append("extern")
                    start = i + 1
                    continue
                fn = _definition(toks, start, i, lines_at)
                stack.append(fn)
            else:
                stack.append(None)
            depth += 1
        elif t == "}":
            if not stack:
                continue    # unbalanced (an #if with two openings): go on as we can
            top = stack.pop()
            if top == "extern":
                start = i + 1
                continue
            depth -= 1
            if depth == 0:
                if isinstance(top, Function):
                    top.end = lines_at(pos)
                    funcs.append(top)
                start = i + 1
        elif t == ";" and depth == 0:
            start = i + 1
    return funcs


def _definition(toks, start, brace, lines_at):
    """The Function whose body opens at toks[brace], or None (a struct, an initializer)."""
    j = brace - 1
    while j >= start:
        t = toks[j][0]
        if t in TRAILING_WORDS:
            j -= 1
            continue
        if t != ")":
            return None
        # back to the matching "("
        level, k = 0, j
        while k >= start:
            if toks[k][0] == ")":
                level += 1
            elif toks[k][0] == "(":
                level -= 1
                if level == 0:
                    break
            k -= 1
        if k < start or k - 1 < start:
            return None
        name = toks[k - 1][0]
        if name in ATTRIBUTE_WORDS:      # a trailing attribute: look further back
            j = k - 2
            continue
        if name in NOT_NAMES or not re.match(r"[A-Za-z_]\w*$", name):
            return None
        if k - 2 >= start and toks[k - 2][0] in (".", "->", "="):
            return None
        static = any(toks[m][0] == "static" for m in range(start, k - 1))
        return Function(name, lines_at(toks[k - 1][1]), 0, static)
    return None


class Source:
    def __init__(self, path, text):
        self.path = path
        clean = strip_comments_and_strings(text)
        nls = [m.start() for m in re.finditer("\n", clean)]
        self.lines_at = lambda pos: bisect.bisect_left(nls, pos) + 1
        self.functions = find_functions(blank_preprocessor(clean, False), self.lines_at)
        self.code = blank_preprocessor(clean, True)
        self.defined = {f.name for f in self.functions}

    def mentions(self):
        """Names this file calls or whose address it takes: every identifier that is not a
        member (after . or ->), not declared (after a type name: a prototype, a variable, a
        struct field) and not a name of a function this file defines itself."""
        out = set()
        toks = _TOKEN_ARROW.findall(self.code)
        for i, name in enumerate(toks):
            if not (name[0].isalpha() or name[0] == "_") or name in self.defined:
                continue
            before = toks[i - 1] if i else ""
            if before in (".", "->"):
                continue
            if (before[:1].isalpha() or before[:1] == "_") and before not in EXPRESSION_WORDS:
                if not (i >= 2 and toks[i - 2] == "define"):
                    continue        # `type name`: a declaration (but `#define X name` is not)
            out.add(name)
        return out


# ---- the checks --------------------------------------------------------------------------------
def layer_of(path):
    """(folder, rank) of a file: the longest LAYERS prefix, its rank or the file's override;
    (None, None) for a file in no layer."""
    folder = max((p for p in LAYERS if path.startswith(p)), key=len, default=None)
    if folder is None:
        return None, None
    rank = LAYERS[folder]
    over = [(p, r) for p, r in RANK_OVERRIDES if path.startswith(p)]
    if over:
        rank = max(over, key=lambda pr: len(pr[0]))[1]
    return folder, rank


def top(path):
    return path.split("/", 1)[0]


def read_tree(root):
    sources = []
    for d in SOURCE_DIRS:
        for dirpath, dirnames, names in os.walk(os.path.join(root, d)):
            dirnames.sort()
            for n in sorted(names):
                if n.endswith(SOURCE_EXTS):
                    full = os.path.join(dirpath, n)
                    rel = os.path.relpath(full, root).replace(os.sep, "/")
                    with open(full, encoding="utf-8", errors="replace") as fh:
                        sources.append(Source(rel, fh.read()))
    return sources


def use_graph(sources):
    owners = defaultdict(set)
    for s in sources:
        for f in s.functions:
            if not f.static:
                owners[f.name].add(s.path)
    unique = {name: next(iter(fs)) for name, fs in owners.items() if len(fs) == 1}
    uses = defaultdict(lambda: defaultdict(set))     # a -> b -> names
    for s in sources:
        for name in s.mentions():
            b = unique.get(name)
            if b is not None and b != s.path:
                uses[s.path][b].add(name)
    return uses


def circles(nodes, uses):
    """Strongly connected sets of two nodes or more (Tarjan, without recursion)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(uses.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(uses.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def judge(a, b):
    """None when file a may use file b, else the kind of problem."""
    ta, tb = top(a), top(b)
    if ta != tb and tb not in ACROSS.get(ta, set()):
        return "across"
    fa, ra = layer_of(a)
    fb, rb = layer_of(b)
    if ra is None or rb is None:
        return None     # reported once as a file in no layer
    if rb > ra:
        return "upward"
    if rb == ra and fa != fb and ta == tb and not (overridden(a) or overridden(b)):
        return "sideways"
    return None


def overridden(path):
    return any(path.startswith(p) for p, _ in RANK_OVERRIDES)


def names(ns, most=8):
    ns = sorted(ns)
    return ", ".join(ns[:most]) + (f" ... (+{len(ns) - most})" if len(ns) > most else "")


# ---- folder graph ------------------------------------------------------------------------------
def folder_of(path):
    f, _ = layer_of(path)
    return f or (os.path.dirname(path) + "/")


def folder_graph(sources, uses):
    edges = defaultdict(lambda: [0, set(), set()])   # (fa, fb) -> [file uses, names, kinds]
    for a, bs in uses.items():
        for b, ns in bs.items():
            fa, fb = folder_of(a), folder_of(b)
            if fa == fb:
                continue
            e = edges[(fa, fb)]
            e[0] += 1
            e[1] |= ns
            k = judge(a, b)
            if k:
                e[2].add(k)
    folders = sorted({folder_of(s.path) for s in sources},
                     key=lambda f: (-(LAYERS.get(f, -1)), f))
    return folders, edges


def graph_table(sources, uses, counts=True):
    """The folder graph as a Markdown table: each folder, its rank, and the folders it uses
    (with counts of files and functions unless counts is false: the form docs keep)."""
    folders, edges = folder_graph(sources, uses)
    rows = ["| folder | rank | uses" + (" (files · functions)" if counts else "") + " |",
            "|---|---:|---|"]
    for f in folders:
        outs = sorted(((fb, e) for (fa, fb), e in edges.items() if fa == f),
                      key=lambda x: (-(LAYERS.get(x[0], -1)), x[0]))
        cells = []
        for fb, e in outs:
            mark = f" **{'/'.join(sorted(e[2]))}**" if e[2] else ""
            cells.append(f"`{fb}`" + (f" ({e[0]} · {len(e[1])})" if counts else "") + mark)
        rows.append(f"| `{f}` | {LAYERS.get(f, '?')} | {', '.join(cells) or '—'} |")
    return rows, folders, edges


def print_graph(sources, uses, comps):
    rows, folders, edges = graph_table(sources, uses)
    in_circle = {f for c in comps for f in c}
    print("\n".join(rows))
    n_files = sum(1 for s in sources if s.path in in_circle)
    print()
    print(f"{len(folders)} folders, {len(edges)} folder uses; "
          f"{len(comps)} circles ({n_files} files)")


DOC_BEGIN, DOC_END = "<!-- structure graph -->", "<!-- end structure graph -->"


def check_doc(path, sources, uses, fix):
    """The table between DOC_BEGIN and DOC_END in path is graph_table's without counts: 0 when
    it is (or was rewritten, with fix), 1 when it differs."""
    text = open(path).read()
    if DOC_BEGIN not in text or DOC_END not in text:
        print(f"structure: {path} has no '{DOC_BEGIN}' ... '{DOC_END}' block")
        return 1
    head, rest = text.split(DOC_BEGIN, 1)
    old, tail = rest.split(DOC_END, 1)
    want = "\n" + "\n".join(graph_table(sources, uses, counts=False)[0]) + "\n"
    if old == want:
        print(f"structure: {path}'s folder table is the code's")
        return 0
    if fix:
        open(path, "w").write(head + DOC_BEGIN + want + DOC_END + tail)
        print(f"structure: rewrote {path}'s folder table")
        return 0
    print(f"structure: {path}'s folder table is not the code's; the code's is:")
    print(want.strip())
    print(f"structure: tests/docs/structure.py --doc {path} --fix rewrites it")
    return 1


def print_dot(sources, uses):
    folders, edges = folder_graph(sources, uses)
    print("digraph structure {")
    print("  rankdir=BT; node [shape=box, fontname=monospace]; edge [fontname=monospace];")
    by_rank = defaultdict(list)
    for f in folders:
        by_rank[LAYERS.get(f, -1)].append(f)
    for r in sorted(by_rank):
        print(f"  {{ rank=same; {' '.join(chr(34) + f + chr(34) for f in by_rank[r])} }}")
    for f in folders:
        print(f'  "{f}" [label="{f}\\n{LAYERS.get(f, "?")}"];')
    for (fa, fb), e in sorted(edges.items()):
        style = ", color=red, fontcolor=red" if e[2] else ""
        print(f'  "{fa}" -> "{fb}" [label="{e[0]}·{len(e[1])}"{style}];')
    print("}")


# ---- main --------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.normpath(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")),
        help="the repository root (default: two levels above this script)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--graph", action="store_true", help="print the folder graph as Markdown")
    g.add_argument("--dot", action="store_true", help="print the folder graph as Graphviz dot")
    ap.add_argument("--doc", metavar="FILE",
                    help="also check the folder table of FILE (docs/ARCHITECTURE.md) against the code")
    ap.add_argument("--fix", action="store_true", help="with --doc: rewrite FILE's table")
    args = ap.parse_args(argv)

    sources = read_tree(args.root)
    if not sources:
        print(f"structure: no .c or .cu files under {args.root} "
              f"({', '.join(d + '/' for d in SOURCE_DIRS)})", file=sys.stderr)
        return 2
    uses = use_graph(sources)
    paths = [s.path for s in sources]
    comps = circles(paths, uses)
    if args.graph:
        print_graph(sources, uses, comps)
        return 0
    if args.dot:
        print_dot(sources, uses)
        return 0
    doc_problems = check_doc(args.doc, sources, uses, args.fix) if args.doc else 0

    n_uses = sum(len(bs) for bs in uses.values())
    problems = 0

    # Files in no layer.
    unlayered = [p for p in paths if layer_of(p)[0] is None]
    for p in unlayered:
        print(f"no layer: {p} (add its folder to LAYERS in {os.path.basename(__file__)})")
    problems += len(unlayered)

    # Circles.
    for i, comp in enumerate(comps, 1):
        print(f"circle {i}: {len(comp)} files: {', '.join(comp)}")
        for a in comp:
            for b in comp:
                if b in uses.get(a, {}):
                    print(f"  {a} -> {b}: {names(uses[a][b])}")
    problems += len(comps)

    # Upward (and sideways, and across) calls.
    bad = []
    for a in sorted(uses):
        for b in sorted(uses[a]):
            kind = judge(a, b)
            if kind:
                bad.append((a, b, kind))
    for a, b, kind in bad:
        fa, ra = layer_of(a)
        fb, rb = layer_of(b)
        print(f"{kind} call: {a} ({ra}) -> {b} ({rb}): {names(uses[a][b])}")
    problems += len(bad)

    # Long functions.
    long_bad, long_ok = [], []
    seen_allow = set()
    for s in sources:
        if not s.path.startswith(LONG_FUNCTION_DIRS):
            continue
        for f in s.functions:
            if f.length > LONG_FUNCTION_LINES:
                key = f"{s.path}:{f.name}"
                if key in ALLOW_LONG:
                    seen_allow.add(key)
                    long_ok.append((s.path, f, ALLOW_LONG[key]))
                else:
                    long_bad.append((s.path, f))
    for path, f in long_bad:
        print(f"long function: {path}:{f.line}: {f.name}: {f.length} lines "
              f"(> {LONG_FUNCTION_LINES})")
    for path, f, why in long_ok:
        print(f"long function (allowed): {path}:{f.line}: {f.name}: {f.length} lines: {why}")
    for key in sorted(set(ALLOW_LONG) - seen_allow):
        print(f"note: ALLOW_LONG entry {key} names no long function now; remove it")
    problems += len(long_bad)

    extra = f", {len(unlayered)} files in no layer" if unlayered else ""
    print(f"structure: {len(sources)} files, {n_uses} uses; {len(comps)} circles, "
          f"{len(bad)} upward calls, {len(long_bad)} long functions ({len(long_ok)} allowed)"
          f"{extra}")
    return 1 if problems or doc_problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:         # ... --dot | head
        sys.stderr.close()
        sys.exit(0)
