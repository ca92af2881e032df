#!/usr/bin/env python3
"""The checker checked: builds a tiny fake tree with known problems in a temporary directory
and asserts that tests/docs/structure.py --root DIR reports exactly those, and nothing once
they are gone. This is what proves that docs.structure can fail.

The fake tree holds
  a circle              ps/core/a.c <-> ps/core/b.c (same layer: a circle, not an upward call)
  an upward call        ps/state/table.c takes the address of ps_replica_on_commit (ps/repl/)
                        in an initializer, never calling it
  across calls          worker/train/t.c -> ps/rpc/rpc.c, common/extra.c -> kernels/ops.c
  a sideways call       worker/data/d.c -> worker/model/m.c (peers of the same rank)
  a long function       ps/main/long.c: long_one, 151 lines; long_ok, 150 lines, is fine
and things that are no problem: a static `clamp` in two files; a static ps_note in
ps/state/table.c while ps/main/server.c defines a non-static ps_note (which worker/train/t.c
uses: the static one must not hide it); names in comments,
strings and after -> / .; a prototype of another file's function; a multi-line parameter
list with attributes; extern "C" { } in a .cu file; ps/ckpt/checkpoint.c (rank override 10)
using ps/state/ and used by ps/rpc/ and tools/.

  tests/docs/structure_selftest.py     exit 0 when every check holds"""
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "structure.py")


def body(lines):
    return "".join("  x += 1;\n" for _ in range(lines))


FILES = {
    "common/util.c": """
/* util: the bottom layer. */
int util_log(const char *s) { return s != 0; }
""",
    "common/extra.c": """
int extra(void) { return ops_run(); }   /* common -> kernels: across */
""",
    "kernels/ops.c": """
#include "ops.h"
#define LOG(s) util_log(s)
int ops_run(void) { return LOG("ops_run()"); }
""",
    "kernels/cuda/k.cu": """
extern "C" {
#include "../../common/util.h"
}
template <typename T> static __global__ void __launch_bounds__(256)
scale(T *x, int n) { x[0] *= n; }
extern "C" int k_launch(int n) {
  return n;
}
extern "C" {
int k_sync(void) { return util_log("sync"); }
}
""",
    "ps/state/table.c": """
/* The state. Mentions that are no uses: ps_rpc_handle(1); ps_replica_on_commit(2); */
// ps_rpc_handle(3);
typedef int (*hook_fn)(int);
struct hooks { hook_fn ps_rpc_handle; };
static const char *why = "ps_rpc_handle(4) /* not a comment */";
static const hook_fn hooks[] = { ps_replica_on_commit, 0 };  /* address taken: upward */
static int
clamp(int v)
{
  return v < 0 ? 0 : v;
}
static int ps_note(int x) { return x; }   /* its own, not ps/main/server.c's */
int table_get(struct hooks *h, int k) {
  (void)why;
  (void)h->ps_rpc_handle;
  return clamp(ps_note(k)) + hooks[0](k) + util_log("t");
}
""",
    "ps/core/a.c": """
int core_a(int n) { return n ? core_b(n - 1, 0) : table_get(0, n); }
""",
    "ps/core/b.c": """
__attribute__((noinline)) int
core_b(int n,
       int m __attribute__((unused)))
    __attribute__((hot))
{
  return core_a(n);
}
""",
    "ps/repl/replica.c": """
int ps_replica_on_commit(int x) { return x + util_log(0); }   /* a leaf: no circle */
""",
    "ps/ckpt/checkpoint.c": """
int ps_ckpt_write(int x) { return table_get(0, x); }   /* rank 10 by override */
""",
    "ps/rpc/rpc.c": """
struct op { const char *name; int (*fn)(int); };
static const struct op ops[] = { { "commit", ps_replica_on_commit } };
int ps_rpc_handle(int x) { return ops[0].fn(x) + ps_ckpt_write(x) + core_a(x); }
""",
    "ps/main/server.c": """
static int clamp(int v) { return v > 9 ? 9 : v; }
int ps_note(int x) { return clamp(x); }
int main(void) { return ps_rpc_handle(ps_note(1)); }
""",
    "ps/main/long.c": "int long_one(int x) {\n" + body(149) + "}\n"
                      + "\nint\nlong_ok(int x)\n{\n" + body(147) + "}\n",
    "worker/model/m.c": """
int model_run(void) { return ops_run() + k_launch(1) + k_sync(); }
""",
    "worker/data/d.c": """
int data_next(void) { return model_run(); }   /* worker/data -> worker/model: sideways */
""",
    "worker/train/t.c": """
int ps_rpc_handle(int x);                      /* a prototype is no definition */
int train(void) { return ps_rpc_handle(1) + ps_note(2) + data_next(); }   /* worker -> ps */
""",
    "tools/x.c": """
int tool(void) { return ps_rpc_handle(1) + train() + ps_ckpt_write(2) + util_log("x"); }
""",
}

EXPECTED = {
    "circle 1: 2 files: ps/core/a.c, ps/core/b.c",
    "  ps/core/a.c -> ps/core/b.c: core_b",
    "  ps/core/b.c -> ps/core/a.c: core_a",
    "upward call: ps/state/table.c (10) -> ps/repl/replica.c (12): ps_replica_on_commit",
    "across call: common/extra.c (0) -> kernels/ops.c (1): ops_run",
    "across call: worker/train/t.c (21) -> ps/main/server.c (15): ps_note",
    "across call: worker/train/t.c (21) -> ps/rpc/rpc.c (14): ps_rpc_handle",
    "sideways call: worker/data/d.c (20) -> worker/model/m.c (20): model_run",
    "long function: ps/main/long.c:1: long_one: 151 lines (> 150)",
}
SUMMARY = ("structure: 16 files, 24 uses; 1 circles, 5 upward calls, "
           "1 long functions (0 allowed)")

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}")


def write_tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text.lstrip("\n"))


def run(*args):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                       timeout=30)
    return p.returncode, p.stdout, p.stderr


def load_module():
    spec = importlib.util.spec_from_file_location("structure", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    with tempfile.TemporaryDirectory() as tmp:
        bad = os.path.join(tmp, "bad")
        write_tree(bad, FILES)

        # 1. Every problem, and nothing else.
        rc, out, err = run("--root", bad)
        lines = out.splitlines()
        check(rc == 1, f"exit status on the bad tree is {rc}, want 1 (stderr: {err.strip()})")
        check(lines and lines[-1] == SUMMARY, f"summary {lines[-1:]!r}, want {SUMMARY!r}")
        got = set(lines[:-1])
        for want in sorted(EXPECTED - got):
            check(False, f"missing: {want!r}")
        for extra in sorted(got - EXPECTED):
            check(False, f"unexpected: {extra!r}")

        # 2. The folder graph (Markdown and dot) shows the uses and marks the bad ones.
        rc, out, _ = run("--root", bad, "--graph")
        check(rc == 0, f"--graph exit status {rc}, want 0")
        check(re.search(r"^\| `ps/state/` \| 10 \| .*`ps/repl/` \(1 · 1\) \*\*upward\*\*", out, re.M),
              "--graph: ps/state/ -> ps/repl/ marked upward")
        check(re.search(r"^\| `tools/` \| 30 \| .*`ps/ckpt/` \(1 · 1\)(?! \*)", out, re.M),
              "--graph: tools/ -> ps/ckpt/ present and not marked")
        check("| `worker/model/` | 20 | `kernels/` (2 · 3) |" in out,
              "--graph: worker/model/ uses 3 functions of 2 kernels/ files (k_sync in extern C)")
        rc, out, _ = run("--root", bad, "--dot")
        check(rc == 0 and out.startswith("digraph"), "--dot prints a digraph")
        check('"ps/state/" -> "ps/repl/" [label="1·1", color=red' in out,
              "--dot: ps/state/ -> ps/repl/ in red")
        check('"ps/rpc/" -> "ps/ckpt/" [label="1·1"];' in out, "--dot: ps/rpc/ -> ps/ckpt/")

        # 3. The allow-list exempts a long function and says why.
        mod = load_module()
        mod.ALLOW_LONG = {"ps/main/long.c:long_one": "a test's reason",
                          "ps/main/long.c:gone": "stale"}
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = mod.main(["--root", bad])
        out = buf.getvalue()
        check("long function (allowed): ps/main/long.c:1: long_one: 151 lines: a test's reason"
              in out, "allowed long function printed with its reason")
        check("long function: ps/main/long.c" not in out, "allowed long function not refused")
        check("ALLOW_LONG entry ps/main/long.c:gone names no long function" in out,
              "stale allow-list entry noted")
        check("0 long functions (1 allowed)" in out.splitlines()[-1], "summary counts 1 allowed")
        check(rc == 1, "still exit 1 (the other problems)")

        # 4. With the problems taken out, the tree passes.
        good_files = dict(FILES)
        good_files["ps/state/table.c"] = FILES["ps/state/table.c"].replace(
            "ps_replica_on_commit, 0", "0, 0").replace("hooks[0](k)", "0")
        good_files["ps/core/b.c"] = FILES["ps/core/b.c"].replace("core_a(n)", "n")
        good_files["common/extra.c"] = "int extra(void) { return util_log(0); }\n"
        good_files["worker/train/t.c"] = "int train(void) { return model_run(); }\n"
        good_files["worker/data/d.c"] = "int data_next(void) { return util_log(0); }\n"
        good_files["ps/main/long.c"] = "int long_ok(int x) {\n" + "  x += 1;\n" * 148 + "}\n"
        good = os.path.join(tmp, "good")
        write_tree(good, good_files)
        rc, out, _ = run("--root", good)
        check(rc == 0, f"exit status on the good tree is {rc}, want 0:\n{out}")
        check(out.splitlines()[-1:] and
              out.splitlines()[-1].endswith("0 circles, 0 upward calls, 0 long functions (0 allowed)"),
              f"good tree summary: {out.splitlines()[-1:]!r}")
        check(len(out.splitlines()) == 1, f"good tree prints only the summary:\n{out}")

        # 5. A file in a folder of no layer is refused.
        write_tree(good, {"ps/nowhere/n.c": "int n(void) { return 0; }\n"})
        rc, out, _ = run("--root", good)
        check(rc == 1 and out.startswith("no layer: ps/nowhere/n.c"), "a file in no layer refused")

        # 6. A root with no sources is an error, not a pass.
        rc, out, err = run("--root", os.path.join(tmp, "empty"))
        check(rc == 2 and "no .c or .cu files" in err, f"empty root: rc {rc}, {err.strip()!r}")

    if failures:
        print(f"structure_selftest: {len(failures)} check(s) failed")
        return 1
    print("structure_selftest: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
