"""Python workers against C ones, measured in one run (docs/python.md).

  python3 tests/python/bench.py transport BUILD [ROUNDS] [REPEATS]
      2 shards of the quickstart's job (P = 421,642); REPEATS times in turn,
      the C client (BUILD/bench_transport, ps-worker's client) and a Python
      worker (psclient) each connect, warm up with one round, then time
      ROUNDS rounds of a whole pull and a whole push (the median of each).
      Prints every run and the ratio Python / C of pull + push.
  python3 tests/python/bench.py training BUILD [STEPS] [REPEATS]
      python/examples/fashion_mnist_cnn.py's PyTorch loop (1 torch thread per
      worker), REPEATS times in turn: 1 worker alone (--local: torch's Adam,
      no servers), 1 worker + 1 server, 2 workers alone side by side, 2
      workers + 2 servers; examples/s per worker and the servers' share of
      the cores (their CPU time over the run), from which the examples/s
      the servers leave the workers: local x (1 - the servers' share).

  python3 tests/python/bench.py step BUILD [STEPS] [REPEATS]
      One process, 1 torch thread, 1 server: blocks of STEPS steps of the
      example's model on batches of 64, in turn with torch's Adam in the
      process (no servers) and with the parameter server (pull, push; Adam
      on the server), REPEATS times; the median time of each part of a step.

The last line of each is a JSON summary. Needs NumPy (and PyTorch for
training); PS_CLIENT_LIB and PS_BIN default to BUILD's.
"""
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
BUILD = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else os.path.join(ROOT, "build")
os.environ.setdefault("PS_CLIENT_LIB", os.path.join(BUILD, "libpsclient.so"))
os.environ.setdefault("PS_BIN", BUILD)
os.environ["PYTHONPATH"] = os.path.join(ROOT, "python")
sys.path.insert(0, os.path.join(ROOT, "python"))

from psclient.cluster import LocalCluster  # noqa: E402

JOB = os.path.join(ROOT, "deploy", "jobs", "fashion_mnist_cnn.json")
EXAMPLE = os.path.join(ROOT, "python", "examples", "fashion_mnist_cnn.py")

PY_ROUNDS = r"""
import json, sys, time
import numpy as np
import psclient
w = psclient.connect(sys.argv[1], insecure=True, log_level="warn")
rounds = int(sys.argv[2])
w.grads[:] = 1e-6 * (np.arange(w.param_count) % 7)  # as bench_transport
w.pull(); w.push(batch_size=1)  # warm-up: connections, first snapshot
pull, push = [], []
for r in range(rounds):
    t0 = time.perf_counter(); w.pull(); t1 = time.perf_counter()
    w.push(batch_size=1); t2 = time.perf_counter()
    pull.append(t1 - t0); push.append(t2 - t1)
w.close()
print(json.dumps({"pull_ms": 1e3 * float(np.median(pull)), "push_ms": 1e3 * float(np.median(push))}))
"""


def transport(rounds, repeats):
    c_runs, py_runs = [], []
    with LocalCluster(JOB, servers=2) as c:
        first = c.addresses[0]
        for rep in range(repeats):
            out = subprocess.run([os.path.join(BUILD, "bench_transport"), first, str(rounds)],
                                 capture_output=True, text=True, check=True).stdout
            cj = json.loads(out.strip().splitlines()[-1])
            out = subprocess.run([sys.executable, "-c", PY_ROUNDS, c.servers, str(rounds)],
                                 capture_output=True, text=True, check=True).stdout
            pj = json.loads(out.strip().splitlines()[-1])
            c_runs.append(cj["pull_ms"] + cj["push_ms"])
            py_runs.append(pj["pull_ms"] + pj["push_ms"])
            print(f"run {rep}: C pull {cj['pull_ms']:.2f} + push {cj['push_ms']:.2f} = "
                  f"{c_runs[-1]:.2f} ms; Python pull {pj['pull_ms']:.2f} + push "
                  f"{pj['push_ms']:.2f} = {py_runs[-1]:.2f} ms; ratio "
                  f"{py_runs[-1] / c_runs[-1]:.3f}", flush=True)
    ratios = [p / q for p, q in zip(py_runs, c_runs)]
    summary = {"rounds": rounds, "repeats": repeats, "c_ms": statistics.median(c_runs),
               "python_ms": statistics.median(py_runs), "ratio_median": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(json.dumps(summary))


def cpu_s(pid):
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_workers(n, steps, cluster=None):
    """n copies of the example (worker k of n): their examples/s each."""
    procs, files = [], []
    for k in range(n):
        metrics = f"/tmp/ps-pybench-{os.getpid()}-{k}.jsonl"
        if os.path.exists(metrics):
            os.unlink(metrics)
        files.append(metrics)
        args = [sys.executable, EXAMPLE, "--index", str(k), "--num-workers", str(n), "--threads",
                "1", "--max-steps", str(steps), "--metrics", metrics, "--no-eval"]
        args += ["--ps", cluster.servers, "--insecure"] if cluster else ["--local"]
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"a worker exited {p.returncode}")
    out = []
    for f in files:
        with open(f) as fh:
            out.append(json.loads(fh.readline()))
        os.unlink(f)
    return out


def training(steps, repeats):
    rows = {"local1": [], "ps1": [], "local2": [], "ps2": [], "share1": [], "share2": []}
    for rep in range(repeats):
        for n in (1, 2):
            loc = run_workers(n, steps)
            rows[f"local{n}"].append(statistics.mean(m["examples_per_s"] for m in loc))
            with LocalCluster(JOB, servers=n) as c:
                before = sum(cpu_s(p.pid) for p in c.procs)
                t0 = time.monotonic()
                got = run_workers(n, steps, c)
                wall = time.monotonic() - t0
                used = sum(cpu_s(p.pid) for p in c.procs) - before
            cores = os.cpu_count() or 1
            rows[f"ps{n}"].append(statistics.mean(m["examples_per_s"] for m in got))
            rows[f"share{n}"].append(used / (wall * cores))
            print(f"run {rep}, {n} worker(s): alone {rows[f'local{n}'][-1]:.0f} examples/s each; "
                  f"with {n} server(s) {rows[f'ps{n}'][-1]:.0f} each, the servers using "
                  f"{100 * rows[f'share{n}'][-1]:.1f}% of the {cores} cores", flush=True)
    summary = {"steps": steps, "repeats": repeats}
    for n in (1, 2):
        loc, ps = statistics.median(rows[f"local{n}"]), statistics.median(rows[f"ps{n}"])
        share = statistics.median(rows[f"share{n}"])
        left = loc * (1 - share) if n * 1 >= (os.cpu_count() or 1) else loc
        summary[f"{n}_workers"] = {"alone": loc, "with_servers": ps, "ratio": ps / loc,
                                   "servers_share": share, "alone_minus_servers": left,
                                   "ratio_to_that": ps / left}
    print(json.dumps(summary))


def step_parts(steps, repeats):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import psclient
    import psclient.torch
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import fashion_mnist_cnn as example
    import fmnist
    torch.set_num_threads(1)
    x, y = fmnist.load("train")
    t = {"fwd_bwd": [], "adam": [], "pull": [], "push": []}
    local, served = example.cnn(), example.cnn()
    opt = torch.optim.Adam(local.parameters(), lr=1e-3)
    rng = np.random.default_rng(1)
    with LocalCluster(JOB, servers=1) as c:
        w = psclient.connect(c.servers, insecure=True, log_level="warn")
        ps = psclient.torch.PSModule(served, w)

        def fwd_bwd(model, zero):
            idx = rng.integers(0, len(x), 64)
            t0 = time.perf_counter()
            zero()
            F.cross_entropy(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])).backward()
            return time.perf_counter() - t0

        for rep in range(repeats):
            for _ in range(steps):
                t["fwd_bwd"].append(fwd_bwd(local, opt.zero_grad))
                t0 = time.perf_counter()
                opt.step()
                t["adam"].append(time.perf_counter() - t0)
            for _ in range(steps):
                t0 = time.perf_counter()
                ps.pull()
                t["pull"].append(time.perf_counter() - t0)
                t["fwd_bwd"].append(fwd_bwd(served, ps.zero_grad))
                t0 = time.perf_counter()
                ps.push(batch_size=64)
                t["push"].append(time.perf_counter() - t0)
        w.close()
    ms = {k: 1e3 * statistics.median(v) for k, v in t.items()}
    ms["local_step"] = ms["fwd_bwd"] + ms["adam"]
    ms["ps_step"] = ms["fwd_bwd"] + ms["pull"] + ms["push"]
    ms["ps_over_local_examples_per_s"] = ms["local_step"] / ms["ps_step"]
    print(" ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    print(json.dumps(ms))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "transport"
    if what == "transport":
        transport(int(sys.argv[3]) if len(sys.argv) > 3 else 50,
                  int(sys.argv[4]) if len(sys.argv) > 4 else 5)
    elif what == "training":
        training(int(sys.argv[3]) if len(sys.argv) > 3 else 300,
                 int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    elif what == "step":
        step_parts(int(sys.argv[3]) if len(sys.argv) > 3 else 20,
                   int(sys.argv[4]) if len(sys.argv) > 4 else 10)
    else:
        sys.exit(__doc__)
