#!/usr/bin/env python3
"""A convergence study: a grid of training runs from one spec, resumable,
with a report of what each configuration costs to reach a target accuracy.

    deploy/study.py SPEC.json [--out runs/study/NAME] [--bin build] [--report-only]
                    [--retry-failed] [--dry-run]

The spec (JSON):

    {"name": "staleness-cnn",
     "runner": "stale",                        # "stale" (ps-stale) or "cluster" (local-cluster.sh)
     "models": {"cnn": "deploy/jobs/fashion_mnist_cnn.json"},
     "target": 0.85,                           # test accuracy
     "seeds": [1, 2, 3],                       # the job's seed (model, data order) and the draws'
     "time_limit_s": 900,                      # per run; a run over it is stopped and reported so
     "grid": {"optimizer": ["sgd:0.05", "momentum:0.01:0.9", "adam:0.001"],
              "staleness": ["fixed:0", "fixed:4"],         # stale runner
              "staleness_aware_lr": [false, true],
              "virtual_workers": [8]},
     "fixed": {"epochs": 2, "eval_per_epoch": 4}}

Grid axes of the stale runner: model, optimizer (NAME:LR[:MOMENTUM]),
staleness (ps-stale --staleness), staleness_aware_lr, virtual_workers.
Of the cluster runner: model, optimizer, mode (async, ssp:K, sync,
sync+backup), workers, servers, straggler_ms (the last worker sleeps that
long in every step), straggle_all ("none", or a `ps-worker --straggle` SPEC
every worker draws its steps' delays from, e.g. "exp:20", in place of
straggler_ms's one straggler),
staleness_aware_lr. "fixed" holds the rest: epochs, eval_per_epoch,
threads, data_dir, and for the stale runner max_staleness and drain
(ps-stale --drain F: the last fraction F of the updates drained, as
asynchronous workers finishing one by one). Every
combination runs once per seed, into OUT/runs/<its name>/: the job file,
the command, its log, its evaluations (metrics.jsonl) and result.json,
written last. A run that has result.json is not run again (an interrupted
study goes on where it stopped). The report (OUT/report.md, the same as
one self-contained page in OUT/report.html, OUT/*.png with
gnuplot) has one table per model with the mean and standard deviation over
seeds of the updates, examples and seconds to the target, the final
accuracy and the staleness, and plots with one band (mean +- sd) per
configuration: test accuracy against updates applied and against time.

A run that stops on a loss that is not finite is reported as diverged (a
result, not a failure). Exit status: 0 every run done (reached the target
or not, or diverged), 1 some run failed or timed out (the report says
which), 2 a bad spec or command line.
"""
import argparse
import base64
import hashlib
import html
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

AXES = {
    "stale": ["model", "optimizer", "staleness", "staleness_aware_lr", "virtual_workers"],
    "cluster": ["model", "optimizer", "mode", "workers", "servers", "straggler_ms",
                "straggle_all", "staleness_aware_lr"],
}
DEFAULTS = {
    "stale": {"staleness": "fixed:0", "staleness_aware_lr": False, "virtual_workers": 1},
    "cluster": {"mode": "async", "workers": 4, "servers": 2, "straggler_ms": 0,
                "straggle_all": "none", "staleness_aware_lr": False},
}


class SpecError(Exception):
    pass


def load_spec(path):
    try:
        spec = json.load(open(path))
    except (OSError, ValueError) as e:
        raise SpecError(f"{path}: {e}")
    if not isinstance(spec, dict):
        raise SpecError(f"{path}: not a JSON object")
    runner = spec.get("runner", "stale")
    if runner not in AXES:
        raise SpecError(f"{path}: runner '{runner}' (want one of {sorted(AXES)})")
    models = spec.get("models")
    if not isinstance(models, dict) or not models:
        raise SpecError(f"{path}: \"models\" must map names to job files")
    for name, job in models.items():
        p = job if os.path.isabs(job) else os.path.join(ROOT, job)
        if not os.path.isfile(p):
            raise SpecError(f"{path}: model '{name}': no job file {p}")
        models[name] = p
    grid = spec.get("grid", {})
    if not isinstance(grid, dict):
        raise SpecError(f"{path}: \"grid\" must be an object of axis: [values]")
    for axis, values in grid.items():
        if axis not in AXES[runner] or axis == "model":
            raise SpecError(f"{path}: grid axis '{axis}' is not one of the {runner} runner's: "
                            f"{[a for a in AXES[runner] if a != 'model']}")
        if not isinstance(values, list) or not values:
            raise SpecError(f"{path}: grid axis '{axis}' must be a non-empty list")
    for o in grid.get("optimizer", []):
        parse_optimizer(o, path)
    seeds = spec.get("seeds", [1, 2, 3])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise SpecError(f"{path}: \"seeds\" must be a list of non-negative integers")
    target = spec.get("target")
    if not isinstance(target, (int, float)) or not 0 < target <= 1:
        raise SpecError(f"{path}: \"target\" must be a test accuracy in (0, 1]")
    spec.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    spec["runner"], spec["grid"], spec["seeds"] = runner, grid, seeds
    spec.setdefault("time_limit_s", 900)
    spec.setdefault("fixed", {})
    return spec


def parse_optimizer(text, where="optimizer"):
    parts = str(text).split(":")
    if parts[0] not in ("sgd", "momentum", "adam") or len(parts) < 2:
        raise SpecError(f"{where}: optimizer '{text}': want sgd:LR, momentum:LR[:M] or adam:LR")
    try:
        lr = float(parts[1])
        m = float(parts[2]) if len(parts) > 2 else None
    except ValueError:
        raise SpecError(f"{where}: optimizer '{text}': LR and M must be numbers")
    opt = {"name": parts[0], "lr": lr}
    if m is not None:
        opt["momentum"] = m
    return opt


def configs(spec):
    """Every (config, seed) of the grid, in a stable order: every
    configuration with the first seed, then with the second, ... (a study
    stopped early has the whole grid at fewer seeds)."""
    runner = spec["runner"]
    axes = [a for a in AXES[runner] if a in spec["grid"]]
    for seed in spec["seeds"]:
        for model in spec["models"]:
            for combo in itertools.product(*(spec["grid"][a] for a in axes)):
                cfg = dict(DEFAULTS[runner])
                cfg["model"] = model
                cfg.update(dict(zip(axes, combo)))
                yield cfg, seed


def config_key(cfg):
    return ",".join(f"{k}={cfg[k]}" for k in sorted(cfg))


def run_name(cfg, seed):
    short = "_".join(str(cfg[k]).replace(":", "-").replace("/", "-").replace("+", "p")
                     for k in sorted(cfg))
    h = hashlib.sha1(config_key(cfg).encode()).hexdigest()[:8]
    return f"{short[:80]}_s{seed}_{h}"


def write_job(spec, cfg, seed, dest):
    job = json.load(open(spec["models"][cfg["model"]]))
    job["seed"] = seed
    if "optimizer" in cfg:
        opt = dict(job.get("optimizer", {}))
        o = parse_optimizer(cfg["optimizer"])
        opt = {k: v for k, v in opt.items() if k not in ("name", "lr", "momentum")}
        opt.update(o)
        job["optimizer"] = opt
    job["staleness_aware_lr"] = bool(cfg.get("staleness_aware_lr", False))
    fixed = spec["fixed"]
    if "epochs" in fixed:
        job["epochs"] = int(fixed["epochs"])
    if spec["runner"] == "cluster":
        mode = cfg.get("mode", "async")
        for k in ("backup_workers", "min_workers"):
            job.pop(k, None)
        if mode.startswith("sync"):
            job["mode"] = "sync"
            job["min_workers"] = int(cfg["workers"])
            if mode == "sync+backup":
                job["backup_workers"] = 1
        else:
            job["mode"] = mode
        job["eval_interval_s"] = fixed.get("eval_interval_s", 2)
        job["job_id"] = f"study-{hashlib.sha1(dest.encode()).hexdigest()[:10]}"
    json.dump(job, open(dest, "w"), indent=1)
    return job


def command(spec, cfg, seed, rundir, binary):
    job = os.path.join(rundir, "job.json")
    fixed = spec["fixed"]
    if spec["runner"] == "stale":
        cmd = [os.path.join(binary, "ps-stale"), "--job", job, "--seed", str(seed),
               "--virtual-workers", str(cfg["virtual_workers"]), "--staleness", cfg["staleness"],
               "--metrics", os.path.join(rundir, "metrics.jsonl"),
               "--eval-per-epoch", str(fixed.get("eval_per_epoch", 4)),
               "--threads", str(fixed.get("threads", 1))]
        if "max_staleness" in fixed:
            cmd += ["--max-staleness", str(fixed["max_staleness"])]
        if "drain" in fixed:
            cmd += ["--drain", str(fixed["drain"])]
        if "data_dir" in fixed:
            cmd += ["--data-dir", fixed["data_dir"]]
        return cmd
    # Delays drawn for every worker take the place of the one straggler: a
    # worker is given one or the other (ps-worker refuses both).
    drawn = cfg.get("straggle_all", "none") != "none"
    cmd = [os.path.join(HERE, "local-cluster.sh"), "--job", job, "--bin", binary,
           "--servers", str(cfg["servers"]), "--workers", str(cfg["workers"]),
           "--straggler-ms", "0" if drawn else str(cfg["straggler_ms"]), "--threads", "1",
           "--out", os.path.join(rundir, "cluster"),
           "--timeout", str(int(spec["time_limit_s"])), "--", "--log-interval", "5"]
    if cfg.get("straggle_all", "none") != "none":
        cmd += ["--straggle", str(cfg["straggle_all"])]
    return cmd


def first_reach(evals, target):
    for e in evals:
        if e["test_accuracy"] >= target:
            return e
    return None


def read_evals(spec, rundir):
    """The run's evaluations as dicts with updates, examples, wall_s, test_accuracy."""
    out = []
    if spec["runner"] == "stale":
        path = os.path.join(rundir, "metrics.jsonl")
        for line in open(path) if os.path.exists(path) else []:
            e = json.loads(line)
            out.append({"updates": e["updates"], "examples": e["examples"], "wall_s": e["wall_s"],
                        "test_accuracy": e["test_accuracy"]})
        return out
    # The chief's evaluations (updates: shard 0's version). Examples: an
    # update is one batch (async, ssp) or the quorum's batches (sync).
    job = json.load(open(os.path.join(rundir, "job.json")))
    per = job.get("batch_size", 1)
    if job.get("mode") == "sync":
        per *= max(1, int(job.get("min_workers", 1)) - int(job.get("backup_workers", 0)))
    path = os.path.join(rundir, "cluster", "worker-0.jsonl")
    for line in open(path) if os.path.exists(path) else []:
        if "test_accuracy" not in line:
            continue
        e = json.loads(line)
        u = e.get("updates", 0)
        out.append({"updates": u, "examples": u * per, "wall_s": e.get("elapsed_s", 0),
                    "test_accuracy": e["test_accuracy"]})
    return out


def staleness_of(spec, rundir, log):
    if spec["runner"] == "stale":
        for line in open(log):
            if line.startswith("staleness: mean "):
                w = line.split()
                return float(w[2]), int(w[4].rstrip(";")), 0
        return None, None, None
    path = os.path.join(rundir, "cluster", "status-0.json")
    if not os.path.exists(path):
        return None, None, None
    st = json.load(open(path))
    return st.get("staleness_mean"), st.get("staleness_max"), st.get("dropped", 0)


def diverged(log):
    """The update at which the run stopped on a loss that is not finite (or
    a gradient that would make the parameters so), or None."""
    try:
        lines = open(log, errors="replace").read().splitlines()[-5:]
    except OSError:
        return None
    for line in lines:
        if ("the loss is" in line and ("nan" in line or "inf" in line)) or \
                ("refused the gradient" in line and ("NaN" in line or "Inf" in line)):
            words = line.replace(":", " ").split()
            for i, w in enumerate(words[:-1]):
                if w in ("update", "step") and words[i + 1].isdigit():
                    return int(words[i + 1])
            return -1
    return None


def run_one(spec, cfg, seed, rundir, binary):
    """Runs one configuration; writes result.json last. Returns the result."""
    if os.path.isdir(rundir):
        shutil.rmtree(rundir)
    os.makedirs(rundir)
    write_job(spec, cfg, seed, os.path.join(rundir, "job.json"))
    cmd = command(spec, cfg, seed, rundir, binary)
    json.dump({"config": cfg, "seed": seed, "command": cmd}, open(os.path.join(rundir, "run.json"), "w"),
              indent=1)
    log = os.path.join(rundir, "log.txt")
    t0 = time.time()
    status = "done"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=spec["time_limit_s"] + 60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc, status = -9, "timed out"
    wall = time.time() - t0
    if rc != 0 and status == "done":
        d = diverged(log)
        status = f"diverged (update {d})" if d is not None else f"failed (exit {rc})"
    evals = read_evals(spec, rundir)
    reach = first_reach(evals, spec["target"])
    smean, smax, dropped = staleness_of(spec, rundir, log)
    res = {"config": cfg, "seed": seed, "status": status, "wall_s": round(wall, 2),
           "final_accuracy": evals[-1]["test_accuracy"] if evals else None,
           "updates": evals[-1]["updates"] if evals else None,
           "examples": evals[-1]["examples"] if evals else None,
           "to_target": reach, "staleness_mean": smean, "staleness_max": smax, "dropped": dropped,
           "evals": evals}
    tmp = os.path.join(rundir, "result.json.tmp")
    json.dump(res, open(tmp, "w"), indent=1)
    os.replace(tmp, os.path.join(rundir, "result.json"))
    return res


def mean_sd(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def fmt(m, sd, digits=0, n=None, of=None):
    if m is None:
        return "not reached"
    s = f"{m:.{digits}f} ± {sd:.{digits}f}"
    if n is not None and of is not None and n < of:
        s += f" ({n} of {of} seeds)"
    return s


def band(results, x, grid_n=40):
    """Mean and sd of test accuracy over seeds on a common grid of x."""
    curves = [[(e[x], e["test_accuracy"]) for e in r["evals"]] for r in results if r["evals"]]
    if not curves:
        return []
    # From the first evaluation all seeds have to the last: no value is
    # drawn where a seed had none (before its first evaluation).
    lo = max(c[0][0] for c in curves)
    hi = min(c[-1][0] for c in curves)
    if hi <= 0 or hi < lo:
        return []
    pts = []
    for i in range(0 if hi > lo else grid_n, grid_n + 1):
        xv = lo + (hi - lo) * i / grid_n
        ys = []
        for c in curves:
            prev = c[0]
            for xp, yp in c:
                if xp >= xv:
                    x0, y0 = prev
                    ys.append(y0 + (yp - y0) * ((xv - x0) / (xp - x0) if xp > x0 else 1.0))
                    break
                prev = (xp, yp)
        if ys:
            m, sd = mean_sd(ys)
            pts.append((xv, m, m - sd, m + sd))
    return pts


def plot(out, name, series, x, xlabel, title):
    """series: [(label, points)]; a PNG with one band per label."""
    if not shutil.which("gnuplot") or not series:
        return None
    files = []
    for i, (label, pts) in enumerate(series):
        f = os.path.join(out, "plots", f"{name}.{i}.dat")
        with open(f, "w") as fh:
            for p in pts:
                fh.write(" ".join(f"{v:.6g}" for v in p) + "\n")
        files.append((label, f))
    png = os.path.join(out, f"{name}.png")
    parts = []
    for i, (label, f) in enumerate(files):
        c = i % 8 + 1
        parts.append(f"'{f}' using 1:3:4 with filledcurves fs transparent solid 0.2 lc {c} notitle")
        parts.append(f"'{f}' using 1:2 with lines lw 2 lc {c} title '{label}'")
    script = (f"set terminal pngcairo size 900,560; set output '{png}'; set key bottom right; "
              f"set grid; set title '{title}' noenhanced; set xlabel '{xlabel}'; "
              f"set ylabel 'test accuracy (mean ± sd over seeds)'; set key noenhanced; plot " + ", ".join(parts))
    subprocess.run(["gnuplot", "-e", script], check=False, stderr=subprocess.DEVNULL)
    return os.path.basename(png) if os.path.exists(png) else None


def report(spec, out, results, name="report"):
    """OUT/NAME.md and the plots, from every result.json."""
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    runner = spec["runner"]
    for r in results:  # from the evaluations: the target may be another than the runs'
        r["to_target"] = first_reach(r["evals"], spec["target"])
        if r["status"].startswith("failed"):  # a study of an older version: classify again
            d = diverged(os.path.join(out, "runs", run_name(r["config"], r["seed"]), "log.txt"))
            if d is not None:
                r["status"] = f"diverged (update {d})"
    varying = [a for a in AXES[runner] if a in spec["grid"] and len(spec["grid"][a]) > 1]
    groups = {}
    for r in results:
        groups.setdefault(config_key(r["config"]), []).append(r)
    lines = [f"# Study {spec['name']}", "",
             f"Runner `{runner}`, target test accuracy {spec['target']}, seeds {spec['seeds']}; "
             f"{len(results)} runs. Mean ± standard deviation over seeds; a configuration that "
             f"some seeds did not take to the target says how many did.", ""]
    bad = [r for r in results if r["status"] != "done" and not r["status"].startswith("diverged")]
    if bad:
        lines += ["Runs that did not finish: " +
                  "; ".join(f"{config_key(r['config'])} seed {r['seed']}: {r['status']}" for r in bad), ""]
    for model in spec["models"]:
        keys = [k for k in groups if groups[k][0]["config"]["model"] == model]
        if not keys:
            continue
        lines += [f"## {model}", ""]
        base = {}  # examples to the target at staleness 0, per the other axes
        if "staleness" in varying:
            for k in keys:
                c = groups[k][0]["config"]
                if str(c["staleness"]) in ("fixed:0",):
                    other = config_key({a: v for a, v in c.items() if a != "staleness"})
                    base[other] = mean_sd([r["to_target"]["examples"] for r in groups[k] if r["to_target"]])[0]
        cols = varying + ["updates to target", "examples to target"] + \
            (["vs s = 0"] if base else []) + ["seconds to target", "final accuracy", "staleness mean / max"] + \
            (["dropped"] if runner == "cluster" else [])
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for k in keys:
            rs = groups[k]
            c = rs[0]["config"]
            reached = [r for r in rs if r["to_target"]]
            um, us = mean_sd([r["to_target"]["updates"] for r in reached])
            em, es = mean_sd([r["to_target"]["examples"] for r in reached])
            tm, ts = mean_sd([r["to_target"]["wall_s"] for r in reached])
            ok = [r for r in rs if not r["status"].startswith("diverged")]
            fm, fs = mean_sd([r["final_accuracy"] for r in ok])
            sm, _ = mean_sd([r["staleness_mean"] for r in rs])
            smax = max((r["staleness_max"] or 0) for r in rs)
            row = [str(c[a]) for a in varying]
            row += [fmt(um, us, 0, len(reached), len(rs)), fmt(em, es, 0, len(reached), len(rs))]
            if base:
                other = config_key({a: v for a, v in c.items() if a != "staleness"})
                b = base.get(other)
                row.append(f"{em / b:.2f}" if em is not None and b else "")
            final = fmt(fm, fs, 4) if ok else "diverged"
            if ok and len(ok) < len(rs):
                final += f" ({len(rs) - len(ok)} of {len(rs)} diverged)"
            row += [fmt(tm, ts, 1, len(reached), len(rs)), final,
                    f"{sm:.2f} / {smax}" if sm is not None else ""]
            if runner == "cluster":
                dm, _ = mean_sd([r["dropped"] for r in rs])
                row.append(f"{dm:.0f}" if dm is not None else "")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        # Plots: one per model and value of the axes other than the
        # plotted one (staleness, or mode), a band per value of it.
        band_axis = "staleness" if "staleness" in varying else ("mode" if "mode" in varying else None)
        others = [a for a in varying if a != band_axis]
        panels = {}
        for k in keys:
            c = groups[k][0]["config"]
            panels.setdefault(tuple(c[a] for a in others), []).append(k)
        for pi, (pk, ks) in enumerate(sorted(panels.items(), key=lambda kv: str(kv[0]))):
            label = ", ".join(f"{a} {v}" for a, v in zip(others, pk)) or "all"
            for x, xl in (("updates", "updates applied"), ("wall_s", "seconds")):
                series = [(str(groups[k][0]["config"].get(band_axis, "")) if band_axis else "runs",
                           band(groups[k], x)) for k in ks]
                png = plot(out, f"{model}-{pi}-{x}", series, x, xl, f"{model}: {label}")
                if png:
                    lines.append(f"![{model}, {label}: test accuracy against {xl}]({png})")
            lines.append("")
    open(os.path.join(out, f"{name}.md"), "w").write("\n".join(lines) + "\n")
    write_html(out, name, lines)
    return os.path.join(out, f"{name}.md")


def write_html(out, name, lines):
    """OUT/NAME.html: the report as one self-contained page (the plots
    inline as data: URLs), from the Markdown lines report() writes:
    headings, paragraphs, tables and images."""
    body, table = [], []

    def flush():
        if table:
            head, rows = table[0], table[2:]
            body.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>")
            body.extend("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
            body.append("</table>")
            table.clear()

    for line in lines:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        flush()
        m = re.match(r"!\[(.*)\]\((.*)\)$", line)
        if m:
            with open(os.path.join(out, m.group(2)), "rb") as f:
                data = base64.b64encode(f.read()).decode()
            body.append(f'<img alt="{html.escape(m.group(1))}" src="data:image/png;base64,{data}">')
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    flush()
    title = html.escape(lines[0][2:] if lines and lines[0].startswith("# ") else name)
    page = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + title + "</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
            "th,td{border:1px solid #bbb;padding:3px 8px;text-align:right}th{background:#eee}"
            "img{max-width:100%;display:block;margin:1em 0}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")
    open(os.path.join(out, f"{name}.html"), "w").write(page)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--out", help="the study's directory (default runs/study/NAME)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build"), help="where the programs are")
    ap.add_argument("--report-only", action="store_true", help="write the report of the runs done")
    ap.add_argument("--retry-failed", action="store_true", help="run failed and timed-out runs again")
    ap.add_argument("--dry-run", action="store_true", help="list the runs, run nothing")
    ap.add_argument("--max-runs", type=int, default=0, help="stop after N runs (0: all)")
    ap.add_argument("--target", type=float, help="the report's target accuracy (default the spec's)")
    ap.add_argument("--report-name", default="report", help="the report's file name, without .md")
    a = ap.parse_args()
    try:
        spec = load_spec(a.spec)
    except SpecError as e:
        print(f"study: {e}", file=sys.stderr)
        return 2
    out = os.path.abspath(a.out or os.path.join(ROOT, "runs", "study", spec["name"]))
    if a.target is not None:
        if not 0 < a.target <= 1:
            print("study: --target must be a test accuracy in (0, 1]", file=sys.stderr)
            return 2
        spec["target"] = a.target
    binary = os.path.abspath(a.bin)
    need = "ps-stale" if spec["runner"] == "stale" else "ps-worker"
    if not a.report_only and not a.dry_run and not os.access(os.path.join(binary, need), os.X_OK):
        print(f"study: no {need} in {binary} (build first, or --bin DIR)", file=sys.stderr)
        return 2
    if not a.dry_run:
        os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    if not a.dry_run:
        json.dump(spec, open(os.path.join(out, "spec.json"), "w"), indent=1)
    todo = list(configs(spec))
    results, pending = [], []
    for cfg, seed in todo:
        rd = os.path.join(out, "runs", run_name(cfg, seed))
        rp = os.path.join(rd, "result.json")
        if os.path.exists(rp):
            r = json.load(open(rp))
            if r["status"] == "done" or not a.retry_failed:
                results.append(r)
                continue
        pending.append((cfg, seed, rd))
    print(f"study {spec['name']}: {len(todo)} runs, {len(results)} done before, {len(pending)} to run; "
          f"out {out}", flush=True)
    if a.dry_run:
        for cfg, seed, rd in pending:
            print(f"  {config_key(cfg)} seed {seed}")
        return 0
    took, ran = [], 0
    stopped = False
    for cfg, seed, rd in pending if not a.report_only else []:
        if a.max_runs and ran >= a.max_runs:
            stopped = True
            break
        t_run = time.time()
        r = run_one(spec, cfg, seed, rd, binary)
        took.append(time.time() - t_run)
        results.append(r)
        ran += 1
        left = len(pending) - ran
        # The median run: a run slowed by other work on the machine (or a
        # study paused with SIGSTOP) does not inflate the estimate.
        per = statistics.median(took)
        reach = r["to_target"]
        print(f"[{len(results)}/{len(todo)}] {config_key(cfg)} seed {seed}: {r['status']}, "
              f"final accuracy {r['final_accuracy']}, "
              + (f"target at {reach['updates']} updates ({reach['wall_s']:.1f} s)" if reach else "target not reached")
              + f"; {left} left, about {left * per / 60:.1f} min", flush=True)
    path = report(spec, out, results, a.report_name)
    print(f"study: report {path}" + (" (partial: --max-runs)" if stopped else ""))
    return 1 if any(r["status"] not in ("done",) and not r["status"].startswith("diverged")
                    for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
