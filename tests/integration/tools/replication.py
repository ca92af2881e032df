#!/usr/bin/env python3
"""Replicated shards under SIGKILL: no acknowledged update lost.

  replication.py BUILD_DIR OUT_DIR JOB --shards S --replicas R --kills K
                 [--workers W] [--steps N] [--epochs E] [--straggle-ms MS] [--what primary|any]

Starts S x R ps-server processes (the job file gets replicas_per_shard R),
W ps-worker processes of N steps each, then K times: picks a shard at
random, kills (SIGKILL) its primary (or, with --what any, a random replica)
at a random moment, restarts it after a random pause. Then checks:
  - every worker finished (no hang) and says how many steps it trained;
  - the chief's final test accuracy is at least --min-accuracy;
  - on every shard the primary's version (updates applied: one per push in
    async) equals the steps all workers trained: every acknowledged push
    is in the state, none twice;
  - every replica of a shard ends at the primary's position with the same
    state (the CRC of parameters, slots and version) bit for bit;
  - the fail-over times (kill to the first push acknowledged by the new
    primary, from the servers' logs) are printed, the largest checked
    against --max-failover-s;
  - the checkpoint sets on disk, sampled every 50 ms: once K - 1 sets are
    whole (every shard's file; --keep-checkpoints K, 3 by default), at
    least K - 1 stay whole, so the newest complete set is never deleted
    before a newer one is whole (shard 0's new primary, which did not cut
    the earlier sets, once pruned them all for the set it was writing).
Every wait is bounded; every process started here is killed on exit.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "pylib"))
from ports import free_ports  # noqa: E402


def log_lines(path, t):
    """(time, line) of each timestamped line of a log (HH:MM:SS.mmm on the
    day of time t), as Unix times."""
    lt = time.localtime(t)
    day = time.mktime(time.struct_time((lt.tm_year, lt.tm_mon, lt.tm_mday,
                                        0, 0, 0, 0, 0, lt.tm_isdst)))
    for line in open(path):
        m = re.match(r"(\d\d):(\d\d):(\d\d\.\d+) ", line)
        if m:
            yield day + int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3)), line


CKPT_RE = re.compile(r"^shard-(\d+)-of-(\d+)-v\d+-s(\d+)\.ckpt$")


class SetWatch(threading.Thread):
    """Samples the checkpoint directory every 50 ms: the sets whole on disk
    (a file of every one of the S shards). Once `floor` sets were whole,
    fewer than `floor` in two samples in a row (not a listing taken during
    a rename) is a violation, kept with what was on disk."""

    def __init__(self, ckpt, shards, floor):
        super().__init__(daemon=True)
        self.ckpt, self.S, self.floor = ckpt, shards, floor
        self.stop_ev = threading.Event()
        self.reached = False
        self.short = 0
        self.violation = None
        self.samples = 0
        self.most = 0

    def whole(self):
        files = {}
        try:
            names = os.listdir(self.ckpt)
        except OSError:
            return None, {}
        for f in names:
            m = CKPT_RE.match(f)
            if m and int(m.group(2)) == self.S:
                files.setdefault(int(m.group(3)), set()).add(int(m.group(1)))
        return sorted(x for x, y in files.items() if len(y) == self.S), files

    def run(self):
        while not self.stop_ev.wait(0.05):
            w, files = self.whole()
            if w is None:
                continue
            self.samples += 1
            self.most = max(self.most, len(w))
            if len(w) >= self.floor:
                self.reached, self.short = True, 0
            elif self.reached:
                self.short += 1
                if self.short == 2 and self.violation is None:
                    self.violation = (f"at {time.strftime('%H:%M:%S')}: {len(w)} whole checkpoint set(s) on disk, after {self.floor} "
                                      f"were: a set was deleted before a newer one was whole; on disk "
                                      f"(set: shards): {dict((k, sorted(v)) for k, v in sorted(files.items()))}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("out")
    ap.add_argument("job")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--straggle-ms", type=int, default=20)
    ap.add_argument("--what", default="primary")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--max-failover-s", type=float, default=0)
    ap.add_argument("--time-limit", type=float, default=300)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--min-in-sync", type=int, default=0)
    ap.add_argument("--checkpoint-secs", type=float, default=1)
    ap.add_argument("--lease-chunk", type=int, default=0)
    ap.add_argument("--kill-shard", type=int, default=-1)
    ap.add_argument("--mode", default="")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    print(f"replication: seed {a.seed}: {a.shards} shard(s) x {a.replicas} replicas, "
          f"{a.workers} workers x {a.steps} steps, {a.kills} kills of {a.what}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    job = json.load(open(a.job))
    job["replicas_per_shard"] = a.replicas
    job["epochs"] = a.epochs
    if a.lease_chunk:
        job["lease_chunk"] = a.lease_chunk
    if a.mode:
        job["mode"] = a.mode
    if job.get("mode") == "sync":
        # Every step holds every worker's push (the checks below count on
        # it): steps begin once all have registered, not with the first
        # (min_workers 1 let a step go with one worker's gradient when the
        # other registered a moment later, and the run made 251 steps).
        job["min_workers"] = a.workers
    job_path = os.path.join(a.out, "job.json")
    json.dump(job, open(job_path, "w"))
    ckpt = os.path.join(a.out, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    n = a.shards * a.replicas
    addrs = ["127.0.0.1:%d" % p for p in free_ports(n)]
    ps = ",".join(addrs)
    server = os.path.join(a.build, "ps-server")
    worker = os.path.join(a.build, "ps-worker")
    procs = {}
    lives = [0] * n
    all_procs = []

    def start(i):
        log = open(os.path.join(a.out, f"server-{i}.{lives[i]}.log"), "w")
        lives[i] += 1
        p = subprocess.Popen([server, "--insecure", "--job", job_path, "--ps", ps, "--index",
                              str(i), "--checkpoint-dir", ckpt, "--log-interval", "1",
                              "--checkpoint-secs", str(a.checkpoint_secs)],
                             stdout=log, stderr=subprocess.STDOUT)
        procs[i] = p
        all_procs.append(p)

    def status():
        r = subprocess.run([server, "--insecure", "--status", ps],
                           capture_output=True, text=True, timeout=30)
        try:
            return json.loads(r.stdout)
        except ValueError:
            return []

    def healthy(st, shard):
        """At least --min-in-sync replicas of the shard (all by default) are
        members of its primary's configuration streaming from it, none of them
        restarted without taking its state since: a kill then leaves one that
        holds every acknowledged update."""
        idx = [shard * a.replicas + r for r in range(a.replicas)]
        es = [st[i] for i in idx if i < len(st)]
        if len(es) != a.replicas or not all(isinstance(e, dict) and e.get("replica") for e in es):
            return False
        p = [e for e in es if e["replica"]["role"] == "primary"]
        if len(p) != 1:
            return False
        sync = [r for r in p[0]["replica"]["in_sync"] if not es[r]["replica"]["fresh"]]
        return len(sync) >= (a.min_in_sync or a.replicas)

    def primaries(st):
        out = {}
        for i, e in enumerate(st):
            rep = e.get("replica") if isinstance(e, dict) else None
            if rep and rep["role"] == "primary":
                out.setdefault(i // a.replicas, []).append(i)
        return out

    watch = SetWatch(ckpt, a.shards, 2)  # --keep-checkpoints 3: 2 kept beside the one written
    watch.start()
    try:
        for i in range(n):
            start(i)
        # Every shard has a primary before the workers start (bounded).
        t0 = time.time()
        while time.time() - t0 < 30:
            if len(primaries(status())) == a.shards:
                break
            time.sleep(0.2)
        else:
            sys.exit("FAIL: not every shard elected a primary within 30 s")
        workers = []
        for k in range(a.workers):
            log = open(os.path.join(a.out, f"worker-{k}.log"), "w")
            p = subprocess.Popen([worker, "--insecure", "--ps", ps, "--index", str(k),
                                  "--num-workers", str(a.workers), "--threads", "1",
                                  "--max-steps", str(a.steps), "--straggle-ms",
                                  str(a.straggle_ms), "--log-interval", "1",
                                  "--log-level", a.log_level],
                                 stdout=log, stderr=subprocess.STDOUT)
            workers.append(p)
            all_procs.append(p)
        kills = []
        deadline = time.time() + a.time_limit
        for kno in range(a.kills):
            time.sleep(rnd.uniform(0.8, 2.0))
            if all(w.poll() is not None for w in workers):
                print(f"replication: the workers finished after {kno} kill(s)")
                break
            s = rnd.randrange(a.shards) if a.kill_shard < 0 else a.kill_shard
            # Fewer than R failures at once: the replicas the last kills
            # restarted must have caught up and joined first (all of them, or
            # --min-in-sync; bounded: a shard that does not get there within
            # 15 s fails the test).
            t_h = time.time()
            while not healthy(status(), s):
                if time.time() - t_h > 15:
                    sys.exit(f"FAIL: shard {s}'s replicas did not all rejoin within 15 s")
                time.sleep(0.1)
            rejoin = time.time() - t_h
            st = status()
            prim = primaries(st)
            if a.what == "primary":
                if s not in prim:
                    continue
                victim = prim[s][0]
            else:
                victim = s * a.replicas + rnd.randrange(a.replicas)
            role = st[victim]["replica"]["role"] if isinstance(st[victim], dict) and \
                st[victim].get("replica") else "?"
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait()
            kills.append((time.time(), victim, role))
            print(f"replication: kill {kno + 1}: server {victim} (shard {s}, {role}; waited "
                  f"{rejoin:.1f} s for the replicas to catch up)", flush=True)
            time.sleep(rnd.uniform(0.2, 1.5))
            start(victim)
        for k, w in enumerate(workers):
            left = max(1.0, deadline - time.time())
            try:
                rc = w.wait(timeout=left)
            except subprocess.TimeoutExpired:
                sys.exit(f"FAIL: worker {k} hung (still running after the time limit)")
            if rc != 0:
                tail = open(os.path.join(a.out, f"worker-{k}.log")).read()[-2000:]
                sys.exit(f"FAIL: worker {k} exited {rc}:\n{tail}")
        trained = examples = 0
        for k in range(a.workers):
            text = open(os.path.join(a.out, f"worker-{k}.log")).read()
            m = re.findall(r"^trained (\d+) steps, (\d+) examples", text, re.M)
            if not m:
                sys.exit(f"FAIL: worker {k} does not say how many steps it trained")
            trained += int(m[-1][0])
            examples += int(m[-1][1])
        # The chief's final evaluation: as an undisturbed run of the job
        # scores (the synthetic job is learned to about 1.0).
        text = open(os.path.join(a.out, "worker-0.log")).read()
        m = re.findall(r"^final test accuracy ([0-9.]+)", text, re.M)
        if not m:
            sys.exit("FAIL: the chief printed no final test accuracy")
        if float(m[-1]) < a.min_accuracy:
            sys.exit(f"FAIL: final test accuracy {m[-1]} < {a.min_accuracy}")
        print(f"replication: final test accuracy {m[-1]}")
        # Every replica settles at its primary's position (bounded wait).
        t0 = time.time()
        ok = False
        while time.time() - t0 < 30:
            st = status()
            prim = primaries(st)
            if len(st) == n and all(isinstance(e, dict) and "replica" in e for e in st) and \
                    len(prim) == a.shards and all(len(v) == 1 for v in prim.values()):
                same = True
                for s in range(a.shards):
                    p = st[prim[s][0]]
                    for r in range(a.replicas):
                        e = st[s * a.replicas + r]
                        if e["replica"]["seq"] != p["replica"]["seq"] or \
                                e["state_crc"] != p["state_crc"] or e["version"] != p["version"]:
                            same = False
                if same:
                    ok = True
                    break
            time.sleep(0.3)
        json.dump(st, open(os.path.join(a.out, "status.json"), "w"), indent=1)
        if not ok:
            sys.exit("FAIL: the replicas of a shard do not hold the same state after 30 s "
                     f"(see {a.out}/status.json)")
        for s in range(a.shards):
            p = st[prim[s][0]]
            print(f"replication: shard {s}: primary replica {p['replica']['index']} term "
                  f"{p['replica']['term']}, version {p['version']}; the workers trained "
                  f"{trained} steps; {a.replicas} replicas with state CRC {p['state_crc']:08x}"
                  f"{'; ' + str(p.get('dropped', 0)) + ' late gradients dropped' if job.get('mode') == 'sync' else ''}")
            # async, ssp: one update per push; sync: one per step, which
            # every worker's push of that step is in (no backup workers).
            want = trained // a.workers if job.get("mode") == "sync" else trained
            if p["version"] != want:
                sys.exit(f"FAIL: shard {s} applied {p['version']} updates, the workers saw "
                         f"{trained} pushes acknowledged (expected {want} updates)")
            if a.lease_chunk and s == 0:
                # Shard 0's lease records: every chunk of every epoch
                # completed once, across the fail-overs.
                for e in p.get("lease_epochs", []):
                    if not e.get("finished") and a.steps:
                        continue  # the last epoch, cut short by --steps
                    if e["chunks_once"] != e["chunks"]:
                        sys.exit(f"FAIL: lease epoch {e['epoch']}: {e['chunks_once']} of "
                                 f"{e['chunks']} chunks completed once")
                done = [e for e in p.get("lease_epochs", []) if e.get("finished")]
                if not done:
                    sys.exit("FAIL: no lease epoch finished")
                print(f"replication: shard 0's lease records: {len(done)} finished epoch(s), "
                      f"every chunk completed once; "
                      f"{sum(e['examples_rehanded'] for e in done)} examples handed out again")
                # Killing primaries repeats no example: what the workers
                # trained is what the epochs completed, none redone (a
                # completion lost) or wasted (trained under a lease whose
                # completion was refused).
                # (Status keeps the last 8 epochs' records: every epoch
                # completes the whole set, so the run's are epochs x that.)
                eps = p.get("lease_epochs", [])
                per_epoch = done[0]["examples_completed"]
                redone = sum(e.get("examples_redone", 0) for e in eps)
                wasted = sum(e.get("examples_wasted", 0) for e in eps)
                again = sum(e["examples_rehanded"] for e in eps)
                print(f"replication: the workers trained {examples} examples: {a.epochs} epochs "
                      f"of {per_epoch}; the kept records: {redone} redone, {wasted} wasted, "
                      f"{again} handed out again")
                if not a.steps and (examples != a.epochs * per_epoch or redone or wasted or again):
                    sys.exit(f"FAIL: with replicated shards {examples} examples were trained for "
                             f"{a.epochs} epochs of {per_epoch} ({redone} redone, {wasted} "
                             f"wasted, {again} handed out again): killing primaries repeated "
                             f"examples")
        watch.stop_ev.set()
        watch.join(timeout=5)
        if watch.violation:
            sys.exit(f"FAIL: checkpoint retention: {watch.violation}")
        if a.checkpoint_secs and not watch.reached:
            sys.exit(f"FAIL: checkpoint retention: never 2 whole sets on disk in {watch.samples} samples")
        print(f"replication: checkpoint sets: at least 2 whole on disk from the second on "
              f"({watch.samples} samples, at most {watch.most} whole at once)")
        # Fail-over times: from each kill of a primary to the first update a
        # replica of that shard acknowledged as the new primary (its log's
        # "first acknowledged update as the primary").
        worst, measured, primary_kills, worst_kill = 0.0, 0, 0, None
        for (t, victim, role) in kills:
            if role != "primary":
                continue
            primary_kills += 1
            s = victim // a.replicas
            best = None
            for r in range(a.replicas):
                i = s * a.replicas + r
                for life in range(lives[i]):
                    for ts, line in log_lines(os.path.join(a.out, f"server-{i}.{life}.log"), t):
                        if "first acknowledged update as the primary" not in line:
                            continue
                        if ts >= t and (best is None or ts < best):
                            best = ts
            if best is not None:
                measured += 1
                if best - t > worst:
                    worst, worst_kill = best - t, (t, victim, best)
                print(f"replication: server {victim} killed: the first push acknowledged by a new "
                      f"primary {best - t:.2f} s later")
        if primary_kills and not measured:
            sys.exit("FAIL: primaries were killed, but no new primary acknowledged a push after")
        if a.max_failover_s and worst > a.max_failover_s:
            # What the shard's replicas said between the kill and the first
            # acknowledgement (elections lost and why), for the record.
            t, victim, best = worst_kill
            s = victim // a.replicas
            logs = [(f"server {s * a.replicas + r}.{life}",
                     f"server-{s * a.replicas + r}.{life}.log")
                    for r in range(a.replicas) for life in range(lives[s * a.replicas + r])]
            logs += [(f"worker {k}", f"worker-{k}.log") for k in range(a.workers)]
            for who, name in logs:
                for ts, line in log_lines(os.path.join(a.out, name), t):
                    if t - 0.2 <= ts <= best + 0.2:
                        print(f"  {who}: {line.rstrip()}")
            sys.exit(f"FAIL: a fail-over took {worst:.2f} s (limit {a.max_failover_s} s)")
        # The servers stop cleanly (SIGTERM: exit 0, and under the sanitizers
        # no report in any log of any life).
        for i, p in procs.items():
            p.send_signal(signal.SIGTERM)
        for i, p in procs.items():
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                sys.exit(f"FAIL: server {i} did not stop within 60 s of SIGTERM")
            if rc != 0:
                sys.exit(f"FAIL: server {i} exited {rc} on SIGTERM")
        for f in os.listdir(a.out):
            if f.endswith(".log"):
                text = open(os.path.join(a.out, f), errors="replace").read()
                if "Sanitizer" in text or "runtime error:" in text:
                    sys.exit(f"FAIL: a sanitizer report in {a.out}/{f}")
        print(f"replication: PASS ({len(kills)} kills; slowest fail-over {worst:.2f} s)")
    finally:
        for p in all_procs:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
