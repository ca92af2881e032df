"""Reads the runs tests/bench/peers.sh left in OUT (OUT/MODEL/SYSTEM/), prints
the markdown table and writes OUT/results.json."""
import argparse
import datetime
import json
import os
import socket

NAMES = {"tf1": "TensorFlow, 1 process", "local": "ps-worker --local",
         "tfps": "TensorFlow ParameterServerStrategy, 2 ps + 2 workers",
         "cluster": "ps, 2 servers + 2 workers"}


def records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def speed_after_warmup(path, warmup, batch):
    """examples/s of one worker after its first `warmup` steps, from its
    progress records: each gives the steps and the rate of its interval."""
    prog = [r for r in records(path) if "examples_per_sec" in r]
    start = next((i for i, r in enumerate(prog) if r["step"] >= warmup), None)
    if start is None or start + 1 >= len(prog):
        start = 0  # too short a run for a warm-up: from the first record
    ex = secs = 0.0
    for prev, r in zip(prog[start:], prog[start + 1:]):
        n = (r["step"] - prev["step"]) * batch
        if n > 0 and r["examples_per_sec"] > 0:
            ex += n
            secs += n / r["examples_per_sec"]
    return ex / secs if secs > 0 else None


def accuracy_run(path, target):
    """(final test accuracy, training seconds, seconds to target, evals) from
    the chief's evaluation records (elapsed_s: since its first step)."""
    ev = [r for r in records(path) if "test_accuracy" in r]
    if not ev:
        return None, None, None, []
    pairs = [[r["elapsed_s"], r["test_accuracy"]] for r in ev]
    hit = next((t for t, a in pairs if a >= target), None)
    return pairs[-1][1], pairs[-1][0], hit, pairs


def wall(path):
    try:
        a, b = open(path).read().split()
        return float(b) - float(a)
    except (OSError, ValueError):
        return None


def collect(d, part, a, batch):
    r = {"system": part, "status": open(f"{d}/status").read().strip() if os.path.exists(f"{d}/status") else "not run",
         "part_wall_s": wall(f"{d}/wall")}
    if part in ("tf1", "tfps"):
        if os.path.exists(f"{d}/result.json"):
            r.update(json.load(open(f"{d}/result.json")))
            r["system"] = part
    elif part == "local":
        r["examples_per_sec"] = speed_after_warmup(f"{d}/speed.jsonl", a.warmup, batch)
        acc, secs, hit, ev = accuracy_run(f"{d}/acc.jsonl", a.target)
        r.update(test_accuracy=acc, train_s=secs, time_to_target_s=hit, evals=ev)
    elif part == "cluster":
        per = [speed_after_warmup(f"{d}/speed/worker-{k}.jsonl", a.warmup, batch) for k in (0, 1)]
        r["examples_per_sec_per_worker"] = per
        r["examples_per_sec"] = sum(per) if all(per) else None
        acc, secs, hit, ev = accuracy_run(f"{d}/acc/worker-0.jsonl", a.target)
        r.update(test_accuracy=acc, train_s=secs, time_to_target_s=hit, evals=ev,
                 run_wall_s=wall(f"{d}/acc.wall"))
    return r


def fmt(v, spec, unit=""):
    return "–" if v is None else format(v, spec) + unit


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    for k in ("models", "parts", "load-before", "pins", "quickstart-job"):
        p.add_argument("--" + k, required=True)
    for k in ("steps", "warmup", "epochs", "max-steps"):
        p.add_argument("--" + k, type=int, required=True)
    p.add_argument("--eval-s", type=float, required=True)
    p.add_argument("--target", type=float, required=True)
    a = p.parse_args()
    jobs = {"quickstart": a.quickstart_job, "large": "deploy/jobs/cnn_large.json"}
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "cores": os.cpu_count(), "loadavg_before": a.load_before,
           "loadavg_after": " ".join(open("/proc/loadavg").read().split()[:3]), "tensorflow": a.pins,
           "settings": {"steps": a.steps, "warmup": a.warmup, "epochs": a.epochs, "max_steps": a.max_steps,
                        "eval_s": a.eval_s, "target": a.target},
           "models": {}}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for m in a.models.split(","):
        job = json.load(open(os.path.join(root, jobs[m])))
        batch = job.get("batch_size", 64)
        parts = {part: collect(f"{a.out}/{m}/{part}", part, a, batch) for part in a.parts.split(",")}
        base = parts.get("tf1", {}).get("examples_per_sec")
        for r in parts.values():
            e = r.get("examples_per_sec")
            r["ratio_to_tf1"] = e / base if e and base else None
        res["models"][m] = {"job": jobs[m], "batch": batch, "systems": parts}

    print(f"\n{res['date']}, {res['cores']} cores, load average before {a.load_before}, after "
          f"{res['loadavg_after']}; {a.pins}; examples/s over {a.steps} steps after {a.warmup} "
          f"(per worker); accuracy runs of {a.epochs} epoch(s)"
          + (f" capped at {a.max_steps} steps" if a.max_steps else "")
          + f", evaluated every {a.eval_s:g} s; times in seconds of training, evaluations included\n")
    for m, mres in res["models"].items():
        print(f"{m} ({mres['job']}, batch {mres['batch']}):\n")
        print(f"| system | examples/s | ratio to TF single process | test accuracy | time to ≥{a.target:g} | training time |")
        print("|---|---|---|---|---|---|")
        for part, r in mres["systems"].items():
            name = NAMES[part] + ("" if r["status"] == "ok" else f" ({r['status']})")
            tt = r.get("time_to_target_s")
            tt = fmt(tt, ".0f", " s") if tt is not None else ("not reached" if r.get("test_accuracy") else "–")
            print(f"| {name} | {fmt(r.get('examples_per_sec'), '.0f')} | {fmt(r.get('ratio_to_tf1'), '.2f')} | "
                  f"{fmt(r.get('test_accuracy'), '.4f')} | {tt} | {fmt(r.get('train_s'), '.0f', ' s')} |")
        print()
    with open(f"{a.out}/results.json", "w") as f:
        json.dump(res, f, indent=1)
    print(f"raw numbers: {a.out}/results.json")


if __name__ == "__main__":
    main()
