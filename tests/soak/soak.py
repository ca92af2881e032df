#!/usr/bin/env python3
"""A soak run: a cluster under a random schedule of faults for a stated
time, with the project's promises checked every second and at the end.

  soak.py --build DIR [--duration 180] [--seed N] [--shards 2] [--replicas 2]
          [--workers 3] [--mode async|sync] [--netns auto|on|off] [--report] ...

(`soak.py --help` lists every option; tests/soak/run.sh SECONDS [ARGS] runs it
against ../../build; docs/fault-tolerance.md "Soak runs" says what it checks.)

What runs: S shards x R replicas (ps-server), W ps-worker processes on a
small synthetic job with data leases, checkpoint sets every
--checkpoint-secs into one directory (a small tmpfs when root, so that the
disk can be filled), the job's token in a file (PS_TOKEN_FILE), plaintext
(--insecure). On loopback, or with --netns every server and worker on a
host of its own (network namespaces joined by a bridge, addresses in
198.18.0.0/15), so that hosts can be cut off and their links slowed.

First a fault-free baseline of the same job and seed (one epoch): its
examples/s sizes the soak's job (epochs enough for about --duration
seconds) and its final test accuracy is the reference. Then the soak: the
nemesis draws faults from --seed (a fault every --fault-every seconds on
average, kinds by weight, faults overlapping), logs each with the seconds
since the start, and undoes each after its time (restarts the server or
worker with the same command, SIGCONT, link up, ...). Server faults keep a
majority of all servers up and at least one in-sync replica of each shard
(all R of a shard only with --allow-total-loss). At --duration the nemesis
stops, everything is healed, and the workers finish the job (bounded).

Checkers (every second, and at the end): progress, acknowledged updates
kept (and checkpoint floors without replicas), lease records, resources
and checkpoint sets, the final accuracy; each violation is a line with
"VIOLATION", and the exit is 1 with the seed in the last line.
Every wait is bounded; everything started or made here (processes,
namespaces, the tmpfs) is removed at the end, also on an error.
"""
import argparse
import bisect
import collections
import concurrent.futures
import errno
import heapq
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "pylib"))
from ports import free_ports  # noqa: E402

FAULT_KINDS = {
    # kind: (default weight, needs)
    "worker_kill": (2.0, None),
    "worker_stop": (2.0, None),
    "worker_join": (1.0, None),
    "worker_leave": (1.0, None),
    "server_kill": (2.0, None),
    "shard0_kill": (1.0, None),
    "server_stall": (2.0, None),
    "partition": (1.5, "netns"),
    "delay": (1.0, "netns"),
    "disk_full": (1.0, "root"),
}

CKPT_RE = re.compile(r"^shard-(\d+)-of-(\d+)-v(\d+)-s(\d+)\.ckpt$")
SET_DONE_RE = re.compile(r"checkpoint set (\d+) complete: (\d+) shard\(s\).*versions \[([0-9 ]*)\], (\d+) ms")
RESTORED_RE = re.compile(r"data leases restored: epoch (\d+)")
EPOCH_DONE_RE = re.compile(r"leases: epoch (\d+) done")
TRAINED_RE = re.compile(r"^trained (\d+) steps, (\d+) examples", re.M)
ACC_RE = re.compile(r"^final test accuracy ([0-9.]+)", re.M)


# ---------------------------------------------------------------- helpers

class Timeline:
    """One line per event, with seconds since the start, on stdout and in
    OUT/timeline.txt; violations are kept for the summary."""

    def __init__(self, path, seed):
        self.t0 = time.time()
        self.f = open(path, "w")
        self.seed = seed
        self.lock = threading.Lock()
        self.violations = []
        self.events = []  # (t, kind, text)

    def now(self):
        return time.time() - self.t0

    def log(self, kind, text, t=None):
        t = self.now() if t is None else t
        line = f"[{t:8.1f}s] {kind}: {text}"
        with self.lock:
            self.events.append((t, kind, text))
            print(line, flush=True)
            self.f.write(line + "\n")
            self.f.flush()

    def violation(self, checker, text):
        self.violations.append((self.now(), checker, text))
        self.log("VIOLATION", f"{checker}: {text} (seed {self.seed})")


def log_time(hms, ref):
    """A log's HH:MM:SS.mmm as a Unix time on the day of ref (the closest)."""
    h, m, s = hms.split(":")
    lt = time.localtime(ref)
    day = time.mktime(time.struct_time((lt.tm_year, lt.tm_mon, lt.tm_mday, 0, 0, 0, 0, 0, lt.tm_isdst)))
    t = day + int(h) * 3600 + int(m) * 60 + float(s)
    if t - ref > 43200:
        t -= 86400
    elif ref - t > 43200:
        t += 86400
    return t


def run(cmd, timeout=20, check=False):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


# ---------------------------------------------------------------- network

class Net:
    """Loopback, or one network namespace per host joined by a bridge."""

    def __init__(self, tl, netns, tag, n_servers):
        self.tl = tl
        self.netns = netns
        self.tag = tag
        self.created = []  # namespaces made here
        self.worker_hosts = []  # namespace per worker host (netns)
        self.delay_kind = None
        self.port = 5000
        if netns:
            self._ns_add(f"{tag}-sw")
            run(["ip", "-n", f"{tag}-sw", "link", "add", "br0", "type", "bridge"], check=True)
            run(["ip", "-n", f"{tag}-sw", "link", "set", "br0", "up"], check=True)
            for i in range(n_servers):
                self._host(f"s{i}", f"198.18.0.{1 + i}")
            self.addrs = [f"198.18.0.{1 + i}:{self.port}" for i in range(n_servers)]
        else:
            self.addrs = [f"127.0.0.1:{p}" for p in free_ports(n_servers)]

    def _ns_add(self, ns):
        run(["ip", "netns", "add", ns], check=True)
        self.created.append(ns)

    def _host(self, name, addr):
        ns, a, b = f"{self.tag}-{name}", f"{self.tag}-{name}-a", f"{self.tag}-{name}-b"
        self._ns_add(ns)
        run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], check=True)
        run(["ip", "link", "set", a, "netns", ns], check=True)
        run(["ip", "link", "set", b, "netns", f"{self.tag}-sw"], check=True)
        run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", a], check=True)
        run(["ip", "-n", ns, "link", "set", a, "up"], check=True)
        run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        run(["ip", "-n", f"{self.tag}-sw", "link", "set", b, "master", "br0"], check=True)
        run(["ip", "-n", f"{self.tag}-sw", "link", "set", b, "up"], check=True)

    def worker_host(self, k):
        """The host of worker slot k (made on first use)."""
        if not self.netns:
            return None
        while len(self.worker_hosts) <= k:
            j = len(self.worker_hosts)
            if j > 120:
                raise RuntimeError("too many worker hosts")
            self._host(f"w{j}", f"198.18.0.{100 + j}")
            self.worker_hosts.append(f"w{j}")
        return f"w{k}"

    def prefix(self, host):
        return ["ip", "netns", "exec", f"{self.tag}-{host}"] if self.netns and host else []

    def status_addr(self, i):
        return f"127.0.0.1:{self.port}" if self.netns else self.addrs[i]

    def listen(self, i):
        return ["--listen", f"0.0.0.0:{self.port}"] if self.netns else []

    def link(self, host, up):
        run(["ip", "-n", f"{self.tag}-{host}", "link", "set", f"{self.tag}-{host}-a",
             "up" if up else "down"], check=True)

    def delay(self, host, on, ms=50):
        ns, dev = f"{self.tag}-{host}", f"{self.tag}-{host}-a"
        if not on:
            run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"])
            return ""
        r = run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                 "delay", f"{ms}ms", f"{max(1, ms // 5)}ms"])
        if r.returncode == 0:
            self.delay_kind = "netem"
            return f"netem delay {ms} ms +- {max(1, ms // 5)} ms"
        # No netem in this kernel: a slow link (token bucket) instead, whose
        # queue delays what exceeds its rate by up to `latency`.
        r = run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                 "rate", "8mbit", "burst", "16kb", "latency", f"{ms * 4}ms"], check=True)
        self.delay_kind = "tbf"
        return f"slow link (no netem here): tbf 8 mbit/s, queue delay up to {ms * 4} ms"

    def cleanup(self):
        for ns in reversed(self.created):
            run(["ip", "netns", "del", ns])
        self.created = []


def remove_stale_mounts():
    """The tmpfs an earlier soak run mounted at OUT/ckptfs and left when it
    was killed before its cleanup (OUT/harness.pid names a dead process)."""
    try:
        mounts = [line.split()[1] for line in open("/proc/mounts") if line.split()[0] == "tmpfs"]
    except OSError:
        return
    for m in mounts:
        if not m.endswith("/ckptfs"):
            continue
        pidf = os.path.join(os.path.dirname(m), "harness.pid")
        try:
            pid = int(open(pidf).read().strip())
        except (OSError, ValueError):
            continue
        if not os.path.exists(f"/proc/{pid}"):
            run(["umount", "-l", m])


def remove_stale_namespaces():
    """Namespaces an earlier soak run (sk<pid>-*) left when it was killed
    before its cleanup (its process is gone)."""
    r = run(["ip", "netns", "list"])
    for line in r.stdout.splitlines():
        m = re.match(r"(sk(\d+)-\S+)", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            run(["ip", "netns", "del", m.group(1)])


# ---------------------------------------------------------------- processes

class Proc:
    def __init__(self, kind, idx, life, cmd, log, metrics, popen, host):
        self.kind, self.idx, self.life = kind, idx, life
        self.cmd, self.log, self.metrics, self.popen, self.host = cmd, log, metrics, popen, host
        self.pid = popen.pid
        self.t_start = time.time()
        self.t_end = None
        self.state = "run"  # run, stop, dead
        self.rc = None
        self.killed = False  # SIGKILL by the nemesis (or the cleanup)
        self.left = False  # SIGTERM: leaves cleanly
        self.samples = []  # servers: (t, rss_kb, fds, threads)
        self.cpu_s = 0.0  # servers: CPU seconds, as last sampled

    @property
    def name(self):
        return f"{self.kind} {self.idx}" + (f" (life {self.life})" if self.life else "")


class Cluster:
    def __init__(self, a, tl, net, out, job_path, ckpt_dir, tag):
        self.a, self.tl, self.net, self.out = a, tl, net, out
        self.job_path, self.ckpt_dir, self.tag = job_path, ckpt_dir, tag
        self.S, self.R = a.shards, a.replicas
        self.N = self.S * self.R
        self.server_bin = os.path.join(a.build, "ps-server")
        self.worker_bin = os.path.join(a.build, "ps-worker")
        self.servers = {}  # index -> current Proc
        self.server_lives = collections.defaultdict(list)
        self.workers = {}  # slot -> current Proc
        self.worker_lives = collections.defaultdict(list)
        self.retired = set()  # worker slots that left
        self.lock = threading.RLock()
        self.all = []
        self.job_done = False  # a worker exited 0 at the end of the data

    def server_cmd(self, i):
        return self.net.prefix(f"s{i}") + [
            self.server_bin, "--insecure", "--job", self.job_path, "--ps", ",".join(self.net.addrs),
            "--index", str(i), "--checkpoint-dir", self.ckpt_dir, "--checkpoint-secs",
            str(self.a.checkpoint_secs), "--keep-checkpoints", str(self.a.keep_checkpoints),
            "--log-interval", "1"] + self.net.listen(i)

    def start_server(self, i):
        with self.lock:
            life = len(self.server_lives[i])
            log = os.path.join(self.out, f"server-{i}.{life}.log")
            metrics = os.path.join(self.out, f"server-{i}.{life}.jsonl")
            cmd = self.server_cmd(i) + ["--metrics", metrics]
            p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
            pr = Proc("server", i, life, cmd, log, metrics, p, f"s{i}")
            self.servers[i] = pr
            self.server_lives[i].append(pr)
            self.all.append(pr)
            return pr

    def ps_list(self, first=0):
        """The server list with server `first` first (workers contact the
        first entry; a live replica of shard 0 there, as a client would
        configure it)."""
        addrs = self.net.addrs
        return ",".join([addrs[first]] + [x for j, x in enumerate(addrs) if j != first])

    def start_worker(self, k, first=0):
        with self.lock:
            life = len(self.worker_lives[k])
            log = os.path.join(self.out, f"worker-{k}.{life}.log")
            metrics = os.path.join(self.out, f"worker-{k}.{life}.jsonl")
            host = self.net.worker_host(k)
            cmd = self.net.prefix(host) + [
                self.worker_bin, "--insecure", "--ps", self.ps_list(first), "--index", str(k),
                "--num-workers", str(self.a.workers), "--threads", "1",
                "--straggle-ms", str(self.a.straggle_ms), "--timeout-ms", str(self.a.timeout_ms),
                "--retry-s", str(self.a.retry_s), "--log-interval", str(self.a.worker_log_interval),
                "--metrics", metrics] + (["--chief"] if k == 0 else [])
            p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
            pr = Proc("worker", k, life, cmd, log, metrics, p, host)
            self.workers[k] = pr
            self.worker_lives[k].append(pr)
            self.all.append(pr)
            return pr

    def signal(self, pr, sig):
        try:
            os.kill(pr.pid, sig)
        except ProcessLookupError:
            return False
        if sig == signal.SIGKILL:
            pr.killed = True
            if pr.state == "stop":
                pr.state = "run"
            try:
                pr.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.reap(pr)
        elif sig == signal.SIGSTOP:
            pr.state = "stop"
        elif sig == signal.SIGCONT:
            if pr.state == "stop":
                pr.state = "run"
        elif sig == signal.SIGTERM:
            pr.left = pr.kind == "worker"
        return True

    def reap(self, pr):
        """Notes a process's exit; returns True the first time."""
        if pr.state == "dead":
            return False
        rc = pr.popen.poll()
        if rc is None:
            return False
        pr.rc, pr.state, pr.t_end = rc, "dead", time.time()
        return True

    def alive_workers(self):
        return [w for w in self.workers.values() if w.state != "dead"]

    def kill_all(self):
        for pr in self.all:
            if pr.popen.poll() is None:
                try:
                    os.kill(pr.pid, signal.SIGCONT)
                    os.kill(pr.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    pr.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


# ---------------------------------------------------------------- status

class StatusReader:
    def __init__(self, cluster):
        self.c = cluster
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, cluster.N))

    def one(self, i, timeout=3.0):
        c = self.c
        cmd = c.net.prefix(f"s{i}") + [c.server_bin, "--insecure", "--status", c.net.status_addr(i)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            st = json.loads(r.stdout) if r.returncode == 0 else None
            return st if isinstance(st, dict) else None
        except (subprocess.TimeoutExpired, ValueError):
            return None

    def all(self, timeout=1.5):
        futs = [self.pool.submit(self.one, i, timeout) for i in range(self.c.N)]
        return [f.result() for f in futs]


def shard_of(c, i):
    return i // c.R


def primaries(c, st):
    out = {}
    for i, e in enumerate(st):
        if e is None:
            continue
        if c.R == 1:
            out.setdefault(i, []).append(i)
        elif e.get("replica") and e["replica"]["role"] == "primary":
            out.setdefault(i // c.R, []).append(i)
    return out


def in_sync_replicas(c, st, s):
    """Servers of shard s that hold every acknowledged update: the primary,
    and the members streaming from it (not fresh)."""
    if c.R == 1:
        return [s] if st[s] is not None else []
    idx = [s * c.R + r for r in range(c.R)]
    ps = [i for i in idx if st[i] and st[i].get("replica") and st[i]["replica"]["role"] == "primary"]
    if len(ps) != 1:
        return []
    p = st[ps[0]]
    out = [ps[0]]
    for r in p["replica"]["in_sync"]:
        i = s * c.R + r
        if i != ps[0] and st[i] and st[i].get("replica") and not st[i]["replica"]["fresh"]:
            out.append(i)
    return out


# ---------------------------------------------------------------- monitor

class Monitor(threading.Thread):
    """Every second: Status of every server, resources of every server
    process, the checkpoint directory, the server logs; the continuous
    checkers."""

    def __init__(self, a, tl, cluster, job):
        super().__init__(daemon=True)
        self.a, self.tl, self.c, self.job = a, tl, cluster, job
        self.sr = StatusReader(cluster)
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        self.st = [None] * cluster.N
        self.st_time = [0.0] * cluster.N
        self.series = []  # (t, sum of versions, per-shard versions)
        self.epochs = {}  # epoch -> last record seen on shard 0's primary
        self.max_version = [0] * cluster.S
        self.floor = [0] * cluster.S  # newest complete checkpoint set's versions
        self.sets = []  # (t, set id, versions, ms)
        self.first_acks = []  # (t, server) "first acknowledged update as the primary"
        self.restores = []  # (t, server, life, restored epoch)
        self.epoch_ends = collections.defaultdict(list)  # (server, life) -> epochs done
        self.ckpt_counts = []  # (t, sets)
        self.ckpt_over = 0
        self.kept_miss = 0
        self.kept_short = 0
        self.kept_short_events = 0
        self.last_move_t = time.time()
        self.last_sum = None
        self.stalled = False
        self.log_pos = {}
        self.total_loss = set()  # shards that lost every replica at once
        self.rolled_back = set()  # shards (R = 1) restored from a checkpoint
        self.last_summary = time.time()
        self.chunk_violations = set()

    # -- logs
    def scan_logs(self):
        c = self.c
        for i, lives in list(c.server_lives.items()):
            for pr in lives:
                key = pr.log
                pos = self.log_pos.get(key, 0)
                try:
                    with open(key, errors="replace") as f:
                        f.seek(pos)
                        data = f.read()
                except OSError:
                    continue
                cut = data.rfind("\n")
                if cut < 0:
                    continue
                self.log_pos[key] = pos + len(data[:cut + 1].encode("utf-8", "replace"))
                for line in data[:cut + 1].splitlines():
                    self.scan_line(pr, line)

    def scan_line(self, pr, line):
        m = re.match(r"(\d\d:\d\d:\d\d\.\d+) ", line)
        t = log_time(m.group(1), time.time()) if m else time.time()
        s = shard_of(self.c, pr.idx)
        m = SET_DONE_RE.search(line)
        if m and s == 0:
            vers = [int(x) for x in m.group(3).split()]
            self.sets.append((t, int(m.group(1)), vers, int(m.group(4))))
            if len(vers) == self.c.S:
                self.floor = vers  # the newest complete set
        if "first acknowledged update as the primary" in line:
            self.first_acks.append((t, pr.idx))
        m = RESTORED_RE.search(line)
        if m:
            self.restores.append((t, pr.idx, pr.life, int(m.group(1))))
        m = EPOCH_DONE_RE.search(line)
        if m:
            self.epoch_ends[(pr.idx, pr.life)].append(int(m.group(1)))

    # -- resources
    def sample_resources(self, now):
        for pr in list(self.c.servers.values()):
            if pr.state == "dead":
                continue
            try:
                rss = 0
                with open(f"/proc/{pr.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            rss = int(line.split()[1])
                fds = len(os.listdir(f"/proc/{pr.pid}/fd"))
                thr = len(os.listdir(f"/proc/{pr.pid}/task"))
            except (OSError, ValueError):
                continue
            pr.samples.append((now, rss, fds, thr))
            try:
                with open(f"/proc/{pr.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                pr.cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                pass
            if rss > self.a.max_rss_mb * 1024 or fds > 4000 or thr > 500:
                self.tl.violation("resources", f"{pr.name}: RSS {rss // 1024} MB, {fds} descriptors, "
                                  f"{thr} threads (hard caps {self.a.max_rss_mb} MB, 4000, 500)")

    def count_sets(self):
        """Set ids on disk (any file), and {set id: shards with a file}."""
        files = collections.defaultdict(set)
        try:
            for f in os.listdir(self.c.ckpt_dir):
                m = CKPT_RE.match(f)
                if m and int(m.group(2)) == self.c.S:
                    files[int(m.group(4))].add(int(m.group(1)))
        except OSError:
            return None, {}
        return len(files), files

    def check_kept(self, now, files):
        """--keep-checkpoints K keeps K complete sets, and a write cut short
        leaves the earlier sets valid: the newest set shard 0 logged
        complete must stay whole on disk (every shard's file) until a newer
        one completes, whatever happens to the set being written. Fewer
        than the K - 1 newest whole (a set is pruned when a newer one is
        cut, naming the K - 1 newest complete to keep) is counted and said
        once, not a violation (a restarted shard 0 knows only the set it
        restored)."""
        whole = sorted(x for x, y in files.items() if len(y) == self.c.S)
        # a set whole on disk is complete, whether or not its log line was read yet
        done = sorted({x[1] for x in self.sets} | set(whole))
        if not done:
            return
        newest = done[-1]
        if len(files.get(newest, ())) < self.c.S:
            self.kept_miss += 1
            if self.kept_miss == 2:  # two samples in a row: not a rename under way
                older = [x for x in whole if x < newest]
                self.tl.violation("checkpoints", f"the newest complete set {newest} is no longer whole on "
                                  f"disk (files of shards {sorted(files.get(newest, ()))} of {self.c.S}) "
                                  f"and no newer set is whole: a restart now would restore "
                                  f"{'the older set ' + str(older[-1]) if older else 'no complete set'}; "
                                  f"sets on disk (set: shards): "
                                  f"{dict((x, sorted(y)) for x, y in sorted(files.items()))}")
        else:
            self.kept_miss = 0
        k = self.a.keep_checkpoints - 1
        short = [sid for sid in done[-k:] if len(files.get(sid, ())) < self.c.S] if k > 1 else []
        if short:
            self.kept_short += 1
            if self.kept_short == 2:
                self.kept_short_events += 1
                self.tl.log("check", f"retention: only {k - len(short)} of the {k} newest complete sets "
                            f"whole on disk (missing {short}; on disk: "
                            f"{dict((x, sorted(y)) for x, y in sorted(files.items()))})")
        else:
            self.kept_short = 0

    # -- status
    def poll(self):
        now = time.time()
        st = self.sr.all()
        c = self.c
        with self.lock:
            for i, e in enumerate(st):
                if e is not None:
                    self.st[i] = e
                    self.st_time[i] = now
            self.last_poll = st
        vers = []
        for s in range(c.S):
            vs = [self.st[s * c.R + r]["version"] for r in range(c.R) if self.st[s * c.R + r]]
            vers.append(max(vs) if vs else 0)
        total = sum(vers)
        self.series.append((now, total, vers))
        # progress
        active = [w for w in c.workers.values() if w.state == "run"]
        if self.last_sum is None or total != self.last_sum or not active or c.job_done:
            if self.stalled and active:
                self.tl.log("check", f"progress: the versions move again ({total})")
            self.last_sum, self.last_move_t, self.stalled = total, now, False
        elif now - self.last_move_t > self.a.progress_bound and not self.stalled:
            self.stalled = True
            self.tl.violation("progress", f"the sum of the shards' versions stayed at {total} for "
                              f"{now - self.last_move_t:.0f} s (bound {self.a.progress_bound} s) while "
                              f"{len(active)} worker(s) ran")
        # versions: replicated shards keep what they acknowledged (a new
        # primary may lack what the old one applied but never acknowledged:
        # at most one push per worker); R = 1: never below the newest
        # complete checkpoint set.
        for s in range(c.S):
            for r in range(c.R):
                i = s * c.R + r
                e = st[i]
                if e is None:
                    continue
                v = e["version"]
                prim = c.R == 1 or (e.get("replica") and e["replica"]["role"] == "primary")
                if c.R > 1 and prim and s not in self.total_loss:
                    slack = self.a.max_workers + 1
                    if v + slack < self.max_version[s]:
                        self.tl.violation("acknowledged", f"shard {s}'s primary (server {i}) is at version "
                                          f"{v}, {self.max_version[s] - v} below the {self.max_version[s]} "
                                          f"seen before (slack {slack}): acknowledged updates lost")
                # A replicated shard's set is its primary's state at the cut,
                # which may hold updates not yet acknowledged (at most one
                # push per worker, or one sync step) that a fail-over then
                # loses: the floor has that slack there.
                slack = 0 if (c.R == 1 or s in self.total_loss) else self.a.max_workers + 1
                if prim and v + slack < self.floor[s]:
                    self.tl.violation("checkpoint floor", f"shard {s} (server {i}) is at version {v}, below "
                                      f"its version {self.floor[s]} in the newest complete checkpoint set"
                                      + (f" by more than {slack}" if slack else ""))
                    self.floor[s] = v  # once
                if prim:
                    self.max_version[s] = max(self.max_version[s], v)
        # lease records, from shard 0's primary
        p0 = primaries(c, st).get(0, [])
        if len(p0) == 1:
            for e in st[p0[0]].get("lease_epochs", []):
                self.epochs[e["epoch"]] = e
                if e.get("finished") and e["chunks_once"] != e["chunks"] and e["epoch"] not in self.chunk_violations:
                    self.chunk_violations.add(e["epoch"])
                    self.tl.violation("data", f"lease epoch {e['epoch']} finished with {e['chunks_once']} of "
                                      f"{e['chunks']} chunks completed once: {json.dumps(e)}")
        self.sample_resources(now)
        self.scan_logs()  # before the listing: a set logged complete was on disk before it
        n, files = self.count_sets()
        if n is not None:
            self.check_kept(now, files)
            self.ckpt_counts.append((now, n))
            if n > self.a.keep_checkpoints + 1:
                self.ckpt_over += 1
                if self.ckpt_over == 3:
                    self.tl.violation("checkpoints", f"{n} checkpoint sets in {c.ckpt_dir} for 3 s "
                                      f"(--keep-checkpoints {self.a.keep_checkpoints}, plus one being written); "
                                      f"sets on disk (set: shards): "
                                      f"{dict((x, sorted(y)) for x, y in sorted(files.items()))}")
            else:
                self.ckpt_over = 0
        if now - self.last_summary >= self.a.summary_every:
            self.last_summary = now
            fin = sorted(k for k, e in self.epochs.items() if e.get("finished"))
            rss = max((pr.samples[-1][1] for pr in c.servers.values() if pr.samples and pr.state != "dead"),
                      default=0)
            self.tl.log("check", f"versions {vers} (sum {total}); {len(fin)} lease epoch(s) finished, "
                        f"chunks once: {'ok' if not self.chunk_violations else 'NO'}; "
                        f"{len(c.alive_workers())} worker(s) alive; servers' max RSS {rss // 1024} MB; "
                        f"{n} checkpoint set(s) on disk; floors {self.floor}")

    def run(self):
        while not self.stop_ev.is_set():
            t = time.time()
            try:
                self.poll()
            except Exception as ex:  # a checker's own failure must not end the run silently
                self.tl.log("monitor", f"error: {ex!r}")
            self.stop_ev.wait(max(0.05, 1.0 - (time.time() - t)))

    def stop(self):
        self.stop_ev.set()
        self.join(timeout=30)


# ---------------------------------------------------------------- nemesis

class Nemesis:
    def __init__(self, a, tl, cluster, mon, net, fill):
        self.a, self.tl, self.c, self.mon, self.net, self.fill = a, tl, cluster, mon, net, fill
        self.sched = random.Random(a.seed)  # when and what
        self.pick = random.Random(a.seed * 7919 + 1)  # which target
        self.pending = []  # heap of (t, seq, text, fn)
        self.seq = 0
        self.impaired = {}  # server -> reason (killed, stopped, cut)
        self.cut_hosts = set()
        self.slow_hosts = set()
        self.disk_full = False
        self.stopped_workers = set()
        self.faults = []  # dicts: kind, target, start, end, role, shard
        self.recovery = []  # (fault, t_ack)
        kinds = [k.strip() for k in a.faults.split(",")] if a.faults else list(FAULT_KINDS)
        self.kinds, self.weights = [], []
        for k in kinds:
            if k not in FAULT_KINDS:
                raise SystemExit(f"soak: unknown fault kind '{k}' (kinds: {', '.join(FAULT_KINDS)})")
            need = FAULT_KINDS[k][1]
            if need == "netns" and not net.netns:
                continue
            if need == "root" and not fill:
                continue
            self.kinds.append(k)
            self.weights.append(FAULT_KINDS[k][0])
        self.next_t = None
        self.cycle = []  # --one-at-a-time: the kinds left in this round

    def later(self, delay, text, fn):
        self.seq += 1
        heapq.heappush(self.pending, (time.time() + delay, self.seq, text, fn))

    # -- constraints
    def server_ok(self, i):
        """May server i be impaired now? A majority of all servers stays up,
        and shard s keeps a replica holding every acknowledged update."""
        c = self.c
        if i in self.impaired or c.servers[i].state == "dead":
            return False
        if c.R == 1:
            return len(self.impaired) + 1 <= max(1, c.S // 2)
        s = shard_of(c, i)
        if self.a.allow_total_loss:
            # every replica of one shard may go at once (they restart from
            # the checkpoint sets), also below a majority for that while
            return all(shard_of(c, j) == s for j in self.impaired) or \
                len(self.impaired) + 1 <= c.N - (c.N // 2 + 1)
        if len(self.impaired) + 1 > c.N - (c.N // 2 + 1):
            return False
        st = self.mon.last_poll if hasattr(self.mon, "last_poll") else [None] * c.N
        sync = [j for j in in_sync_replicas(c, st, s) if j not in self.impaired]
        # the replicas that stay must include one holding everything, and
        # none of the shard's may be catching up (its state is not whole yet)
        others_impaired = [j for j in self.impaired if shard_of(c, j) == s]
        if others_impaired:
            return False
        if len(sync) != c.R:
            return False
        return True

    def mark(self, i, why):
        self.impaired[i] = why

    def unmark_when_caught_up(self, i, t_limit):
        """A restarted/resumed server counts as impaired until its shard has
        every replica in sync again (bounded)."""
        c = self.c
        s = shard_of(c, i)
        st = self.mon.last_poll
        if c.R == 1:
            ok = st[i] is not None
        else:
            ok = len(in_sync_replicas(c, st, s)) == c.R
        if ok or time.time() > t_limit:
            if not ok:
                self.tl.log("nemesis", f"server {i}: its shard is not whole again "
                            f"{self.a.catchup_s:.0f} s after it came back (counted as up anyway)")
            self.impaired.pop(i, None)
        else:
            self.later(0.5, None, lambda: self.unmark_when_caught_up(i, t_limit))

    def record(self, kind, target, dur, **kw):
        f = dict(kind=kind, target=target, start=time.time(), end=time.time() + (dur or 0), **kw)
        self.faults.append(f)
        return f

    # -- faults
    def roles(self):
        st = self.mon.last_poll if hasattr(self.mon, "last_poll") else [None] * self.c.N
        out = {}
        for i, e in enumerate(st):
            if self.c.R == 1:
                out[i] = "R = 1"
            elif e and e.get("replica"):
                out[i] = e["replica"]["role"]
            else:
                out[i] = "?"
        return out

    def f_server_kill(self, shard0=False):
        c = self.c
        roles = self.roles()
        cands = [i for i in range(c.N) if self.server_ok(i)]
        if shard0:
            cands = [i for i in cands if shard_of(c, i) == 0 and (c.R == 1 or roles.get(i) == "primary")]
        if not cands:
            return "skipped: no server may go down now (majority, replicas in sync)"
        i = self.pick.choice(cands)
        s = shard_of(c, i)
        st = self.mon.last_poll
        sync = in_sync_replicas(c, st, s)
        lost_all = c.R > 1 and not [j for j in sync if j != i and j not in self.impaired]
        pause = self.sched.uniform(0.3, 4.0)
        pr = c.servers[i]
        epoch_before = max((k for k, e in self.mon.epochs.items()), default=-1)
        c.signal(pr, signal.SIGKILL)
        self.mark(i, "killed")
        if c.R == 1 or lost_all:
            if c.R > 1:
                self.mon.total_loss.add(s)
            self.mon.rolled_back.add(s)
        f = self.record("shard0_kill" if shard0 else "server_kill", f"server {i}", pause, role=roles.get(i),
                        shard=s, server=i, epoch=epoch_before)
        threading.Thread(target=self.watch_recovery, args=(f,), daemon=True).start()

        def restart():
            c.start_server(i)
            self.tl.log("nemesis", f"restarted server {i} (shard {s}) with the same command")
            self.unmark_when_caught_up(i, time.time() + self.a.catchup_s)
        self.later(pause, None, restart)
        return f"SIGKILL server {i} (shard {s}, {roles.get(i)}); restart in {pause:.1f} s" + \
            (" (every replica of the shard lost: --allow-total-loss)" if lost_all else "")

    def watch_recovery(self, f):
        """Kill to the first update acknowledged after it: the shard's
        replicas polled every 0.1 s until one's version moves (bounded)."""
        c = self.c
        s = f["shard"]
        idx = [s * c.R + r for r in range(c.R)]
        base = {}
        t_end = time.time() + 60
        while time.time() < t_end and not self.mon.stop_ev.is_set():
            for i in idx:
                if i == f["server"] and c.servers[i].state == "dead":
                    continue
                e = self.mon.sr.one(i, timeout=1.0)
                if e is None:
                    continue
                prim = c.R == 1 or (e.get("replica") and e["replica"]["role"] in ("primary", "backup"))
                if not prim:
                    continue
                if i not in base:
                    base[i] = e["version"]
                elif e["version"] > base[i]:
                    f["t_ack"] = time.time()
                    return
            time.sleep(0.1)

    def f_server_stall(self):
        c = self.c
        cands = [i for i in range(c.N) if self.server_ok(i) and c.servers[i].state == "run"]
        if not cands:
            return "skipped: no server may stall now"
        i = self.pick.choice(cands)
        roles = self.roles()
        dur = self.sched.uniform(0.2, 0.75 * self.a.timeout_ms / 1000.0)
        pr = c.servers[i]
        c.signal(pr, signal.SIGSTOP)
        self.mark(i, "stopped")
        self.record("server_stall", f"server {i}", dur, role=roles.get(i), shard=shard_of(c, i), server=i)

        def cont():
            c.signal(pr, signal.SIGCONT)
            self.tl.log("nemesis", f"SIGCONT server {i}")
            self.unmark_when_caught_up(i, time.time() + self.a.catchup_s)
        self.later(dur, None, cont)
        return f"SIGSTOP server {i} (shard {shard_of(c, i)}, {roles.get(i)}) for {dur:.1f} s: stalled replies " \
               f"(workers' time-out {self.a.timeout_ms / 1000:.1f} s)"

    def live_worker_slots(self, running_only=True):
        return sorted(k for k, w in self.c.workers.items()
                      if w.state == ("run" if running_only else w.state) and w.state != "dead"
                      and k not in self.c.retired)

    def f_worker_kill(self):
        c = self.c
        cands = self.live_worker_slots()
        if not cands or c.job_done:
            return "skipped: no running worker"
        k = self.pick.choice(cands)
        pause = self.sched.uniform(0.5, 5.0)
        pr = c.workers[k]
        c.signal(pr, signal.SIGKILL)
        self.record("worker_kill", f"worker {k}", pause, slot=k)
        threading.Thread(target=self.killed_steps, args=(pr,), daemon=True).start()

        def restart():
            if c.job_done:
                self.tl.log("nemesis", f"worker {k} not restarted: the job is done")
                return
            c.start_worker(k, first=self.first_server())
            self.tl.log("nemesis", f"restarted worker {k} (life {len(c.worker_lives[k]) - 1}): it rejoins")
        self.later(pause, None, restart)
        return f"SIGKILL worker {k}{' (the chief)' if k == 0 else ''}; restart in {pause:.1f} s"

    def killed_steps(self, pr):
        """What the shards last heard from a SIGKILLed worker life, asked at
        once (they keep a worker for the heartbeat time-out): the step of its
        last push or heartbeat. It completed at most that step + 1 (a step
        completes when every shard has applied its push)."""
        m = re.search(r"registered as worker ([0-9a-f]+)", read_log(pr))
        if not m:
            return
        wid = m.group(1)
        best = None
        for e in self.mon.sr.all(timeout=2.0):
            for w in (e or {}).get("workers", []):
                short = str(w.get("id", "")).rstrip(".")  # Status shortens ids: "ae256480..."
                if short and wid.startswith(short) and w.get("task_index") == pr.idx:
                    best = max(best or 0, int(w.get("step", 0)))
        if best is not None:
            pr.kill_step = best

    def first_server(self):
        """A live replica of shard 0, for a (re)starting worker's list."""
        c = self.c
        st = self.mon.last_poll if hasattr(self.mon, "last_poll") else [None] * c.N
        p = primaries(c, st).get(0, [])
        for i in p + list(range(c.R)):
            if i not in self.impaired and c.servers[i].state == "run":
                return i
        return 0

    def f_worker_stop(self):
        c = self.c
        cands = self.live_worker_slots()
        if not cands:
            return "skipped: no running worker"
        k = self.pick.choice(cands)
        dur = self.sched.uniform(0.5, 6.0)
        pr = c.workers[k]
        c.signal(pr, signal.SIGSTOP)
        self.record("worker_stop", f"worker {k}", dur, slot=k)

        def cont():
            c.signal(pr, signal.SIGCONT)
            self.tl.log("nemesis", f"SIGCONT worker {k}")
        self.later(dur, None, cont)
        return f"SIGSTOP worker {k} for {dur:.1f} s (heartbeat time-out {self.a.heartbeat_ms / 1000:.1f} s)"

    def f_worker_join(self):
        c = self.c
        alive = [w for k, w in c.workers.items() if w.state != "dead" and k not in c.retired]
        if len(alive) >= self.a.max_workers or c.job_done:
            return f"skipped: {len(alive)} workers (at most {self.a.max_workers})"
        k = max(list(c.worker_lives) + [-1]) + 1
        c.start_worker(k, first=self.first_server())
        self.record("worker_join", f"worker {k}", 0, slot=k)
        return f"worker {k} joins"

    def f_worker_leave(self):
        c = self.c
        alive = [k for k, w in c.workers.items() if w.state == "run" and k not in c.retired]
        cands = [k for k in alive if k != 0]
        if len(alive) <= self.a.min_workers or not cands:
            return f"skipped: {len(alive)} running workers (at least {self.a.min_workers})"
        k = self.pick.choice(cands)
        c.retired.add(k)
        c.signal(c.workers[k], signal.SIGTERM)
        self.record("worker_leave", f"worker {k}", 0, slot=k)
        return f"SIGTERM worker {k}: it leaves"

    def f_partition(self):
        c = self.c
        hosts = [f"s{i}" for i in range(c.N) if self.server_ok(i)]
        hosts += [c.workers[k].host for k in self.live_worker_slots()]
        hosts = [h for h in hosts if h and h not in self.cut_hosts]
        if not hosts:
            return "skipped: no host may be cut off now"
        h = self.pick.choice(hosts)
        dur = self.sched.uniform(2.0, 6.0)
        self.net.link(h, False)
        self.cut_hosts.add(h)
        srv = int(h[1:]) if h.startswith("s") else None
        if srv is not None:
            self.mark(srv, "cut off")
        self.record("partition", f"host {h}", dur, server=srv, shard=shard_of(c, srv) if srv is not None else None,
                    role=self.roles().get(srv) if srv is not None else "worker")

        def heal():
            self.net.link(h, True)
            self.cut_hosts.discard(h)
            self.tl.log("nemesis", f"host {h}'s link is up again")
            if srv is not None:
                self.unmark_when_caught_up(srv, time.time() + self.a.catchup_s)
        self.later(dur, None, heal)
        what = f"server {srv} ({self.roles().get(srv)})" if srv is not None else "a worker"
        return f"host {h} ({what}) cut off (link down) for {dur:.1f} s"

    def f_delay(self):
        c = self.c
        hosts = [f"s{i}" for i in range(c.N)] + [c.workers[k].host for k in self.live_worker_slots()]
        hosts = [h for h in hosts if h and h not in self.slow_hosts and h not in self.cut_hosts]
        if not hosts:
            return "skipped: no host"
        h = self.pick.choice(hosts)
        dur = self.sched.uniform(4.0, 12.0)
        ms = self.pick.choice([20, 50, 100, 150])
        what = self.net.delay(h, True, ms)
        self.slow_hosts.add(h)
        self.record("delay", f"host {h}", dur)

        def heal():
            self.net.delay(h, False)
            self.slow_hosts.discard(h)
            self.tl.log("nemesis", f"host {h}'s link is at full speed again")
        self.later(dur, None, heal)
        return f"host {h}: {what} for {dur:.1f} s"

    def f_disk_full(self):
        if self.disk_full:
            return "skipped: the disk is full already"
        dur = self.sched.uniform(2.0, 6.0)
        n = self.fill.fill()
        self.disk_full = True
        self.record("disk_full", "checkpoint directory", dur)

        def free():
            self.fill.free()
            self.disk_full = False
            self.tl.log("nemesis", "the checkpoint file system has room again")
        self.later(dur, None, free)
        return f"the checkpoint file system filled ({n // 1024} KiB written, 0 left) for {dur:.1f} s"

    def step(self, t_stop):
        """Runs what is due; returns the time of the next thing to do."""
        now = time.time()
        while self.pending and self.pending[0][0] <= now:
            _, _, text, fn = heapq.heappop(self.pending)
            try:
                fn()
            except Exception as ex:
                self.tl.log("nemesis", f"error undoing a fault: {ex!r}")
        if self.next_t is None:
            self.next_t = now + self.a.warmup_s
        if self.a.one_at_a_time and now >= self.next_t and (
                self.pending or self.impaired or
                any(f["end"] + self.a.gap_s > now for f in self.faults)):
            self.next_t = now + 0.25  # the last fault is not undone, or too recent
        if now >= self.next_t and now < t_stop and self.kinds:
            if self.a.one_at_a_time:  # every kind in turn, in a seeded order per round
                if not self.cycle:
                    self.cycle = list(self.kinds)
                    self.sched.shuffle(self.cycle)
                kind = self.cycle.pop()
            else:
                kind = self.sched.choices(self.kinds, self.weights)[0]
            try:
                text = {"worker_kill": self.f_worker_kill, "worker_stop": self.f_worker_stop,
                        "worker_join": self.f_worker_join, "worker_leave": self.f_worker_leave,
                        "server_kill": self.f_server_kill, "shard0_kill": lambda: self.f_server_kill(True),
                        "server_stall": self.f_server_stall, "partition": self.f_partition,
                        "delay": self.f_delay, "disk_full": self.f_disk_full}[kind]()
            except Exception as ex:
                text = f"failed: {ex!r}"
            self.tl.log("fault", f"{kind}: {text}")
            self.next_t = now + self.sched.expovariate(1.0 / self.a.fault_every)
        nxt = [self.next_t] if now < t_stop else []
        if self.pending:
            nxt.append(self.pending[0][0])
        return min(nxt) if nxt else now + 0.5

    def heal_all(self):
        """The end of the schedule: every pending undo now."""
        while self.pending:
            _, _, text, fn = heapq.heappop(self.pending)
            try:
                fn()
            except Exception as ex:
                self.tl.log("nemesis", f"error undoing a fault: {ex!r}")


class Filler:
    """Fills the tmpfs that holds the checkpoint directory."""

    def __init__(self, mount):
        self.path = os.path.join(mount, "soak-fill.bin")

    def fill(self):
        """Writes zeros until the file system is full (unbuffered, so that
        nothing is left to flush); returns the bytes written."""
        n = 0
        chunk = b"\0" * (1 << 20)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 20, 1 << 12, 1):
                for _ in range(8192):  # bounded: a 8 GiB file system at most at 1 MiB
                    try:
                        k = os.write(fd, chunk[:size])
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
                    n += k
                    if k < size:
                        break
        finally:
            os.close(fd)
        return n

    def free(self):
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------- the job

def make_job(a, epochs, train_size):
    job = {
        "job_id": "soak",
        "model": {"input": [1, 12, 12], "classes": 4, "layers": [
            {"type": "conv2d", "filters": 8, "kernel": 3, "padding": "same"}, {"type": "relu"},
            {"type": "maxpool", "size": 2}, {"type": "flatten"}, {"type": "dense", "units": 32},
            {"type": "relu"}, {"type": "dropout", "rate": 0.1}, {"type": "dense", "units": 4},
            {"type": "softmax_xent"}]},
        "optimizer": {"name": "adam", "lr": 0.002},
        "seed": a.seed % 1000000 + 1,
        "batch_size": a.batch,
        "epochs": epochs,
        "mode": a.mode,
        "dataset": {"name": "synthetic", "train_size": train_size, "test_size": 512},
        "eval_interval_s": 0,
        "heartbeat_timeout_ms": a.heartbeat_ms,
    }
    if a.lease_chunk > 0:
        job["lease_chunk"] = a.lease_chunk
    if a.bitwise:
        # The bitwise comparison: no dropout (nothing drawn per step that
        # another run could draw differently), every worker its static share.
        job["model"]["layers"] = [x for x in job["model"]["layers"] if x["type"] != "dropout"]
        job["min_workers"] = a.workers
    if a.replicas > 1:
        job["replicas_per_shard"] = a.replicas
    return job


# ---------------------------------------------------------------- metrics

def metrics_records(pr):
    """The records of a process life's --metrics file (JSON lines), those
    that parse; none when the file cannot be read."""
    try:
        lines = open(pr.metrics).readlines()
    except OSError:
        return
    for line in lines:
        try:
            yield json.loads(line)
        except ValueError:
            continue


def worker_curve(pr, batch):
    """(time, cumulative examples) of one worker life from its --metrics."""
    return [(pr.t_start, 0)] + [(r["time"], r["step"] * batch) for r in metrics_records(pr)
                                if "examples_per_sec" in r and "step" in r]


class Throughput:
    def __init__(self, cluster, batch):
        self.curves = [worker_curve(pr, batch) for lives in cluster.worker_lives.values() for pr in lives]
        self.ends = [pr.t_end for lives in cluster.worker_lives.values() for pr in lives]

    def examples(self, t):
        tot = 0.0
        for pts in self.curves:
            ts = [p[0] for p in pts]
            j = bisect.bisect_right(ts, t)
            if j == 0:
                continue
            if j >= len(pts):
                tot += pts[-1][1]
                continue
            (t0, e0), (t1, e1) = pts[j - 1], pts[j]
            tot += e0 + (e1 - e0) * (t - t0) / max(1e-9, t1 - t0)
        return tot

    def rate(self, a, b):
        return (self.examples(b) - self.examples(a)) / max(1e-9, b - a)


def last_logged(pr, batch):
    """(time, steps, max steps/s) of a worker life's last progress record."""
    t, steps, best = pr.t_start, 0, 0.0
    for r in metrics_records(pr):
        if "examples_per_sec" in r and "step" in r:
            t, steps = r["time"], r["step"]
            best = max(best, r["examples_per_sec"] / batch)
    return t, steps, best


def read_log(pr):
    try:
        return open(pr.log, errors="replace").read()
    except OSError:
        return ""


# ---------------------------------------------------------------- runs

class Run:
    """One cluster run: servers, workers, monitor, nemesis (or none)."""

    def __init__(self, a, tl, net, out, job, ckpt_dir, tag, name):
        self.a, self.tl, self.net, self.out, self.job, self.name = a, tl, net, out, job, name
        os.makedirs(out, exist_ok=True)
        os.makedirs(ckpt_dir, exist_ok=True)
        self.job_path = os.path.join(out, "job.json")
        json.dump(job, open(self.job_path, "w"), indent=1)
        self.c = Cluster(a, tl, net, out, self.job_path, ckpt_dir, tag)
        self.mon = Monitor(a, tl, self.c, job)

    def start(self):
        c = self.c
        for i in range(c.N):
            c.start_server(i)
        t0 = time.time()
        while time.time() - t0 < 60:
            st = self.mon.sr.all()
            self.mon.last_poll = st
            p = primaries(c, st)
            if len(p) == c.S and all(x is not None for x in st):
                break
            time.sleep(0.3)
        else:
            raise RuntimeError(f"{self.name}: not every shard answered (or elected a primary) within 60 s")
        for k in range(self.a.workers):
            c.start_worker(k)
        self.t_workers = time.time()
        self.mon.start()

    def workers_done(self):
        c = self.c
        for pr in list(c.all):
            if c.reap(pr):
                self.on_exit(pr)
        return not c.alive_workers()

    def on_exit(self, pr):
        c = self.c
        if pr.kind == "server":
            if not pr.killed and not getattr(pr, "stopping", False):
                self.tl.violation("processes", f"{pr.name} exited {pr.rc} by itself: "
                                  f"{read_log(pr)[-600:]!r}")
            return
        if pr.killed:
            return
        if pr.rc != 0:
            self.tl.violation("processes", f"{pr.name} exited {pr.rc}: {read_log(pr)[-600:]!r}")
        elif not pr.left:
            c.job_done = True
            self.tl.log("worker", f"{pr.name} finished (exit 0)")
        else:
            self.tl.log("worker", f"{pr.name} left (exit 0)")

    def stop_servers(self):
        c = self.c
        for pr in c.servers.values():
            if pr.state != "dead":
                pr.stopping = True
                c.signal(pr, signal.SIGCONT)
                c.signal(pr, signal.SIGTERM)
        bad = []
        for pr in c.servers.values():
            try:
                rc = pr.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                bad.append(f"{pr.name} did not stop within 60 s of SIGTERM")
                continue
            c.reap(pr)
            if rc != 0 and not pr.killed:
                bad.append(f"{pr.name} exited {rc} on SIGTERM")
        return bad


def baseline(a, tl, net, root_out, train_size, tag, ckpt_secs, name):
    """A fault-free run of one epoch: examples/s and accuracy."""
    job = make_job(a, a.baseline_epochs, train_size)
    sub = argparse.Namespace(**vars(a))
    sub.checkpoint_secs = ckpt_secs
    r = Run(sub, tl, net, os.path.join(root_out, name), job, os.path.join(root_out, name, "ckpt"), tag, name)
    tl.log(name, f"fault-free run: {a.baseline_epochs} epoch(s) of {train_size} examples, {a.workers} workers, "
           + (f"checkpoint sets every {ckpt_secs} s" if ckpt_secs else "no checkpoint sets"))
    r.start()
    t_end = time.time() + a.baseline_limit
    try:
        while not r.workers_done():
            if time.time() > t_end:
                raise RuntimeError(f"{name}: the fault-free run did not end within {a.baseline_limit} s")
            time.sleep(0.3)
    finally:
        r.mon.stop()
        bad = r.stop_servers()
    for b in bad:
        tl.violation("processes", f"{name}: {b}")
    ex = steps = 0
    t_last = 0
    for lives in r.c.worker_lives.values():
        for pr in lives:
            m = TRAINED_RE.findall(read_log(pr))
            if m:
                steps += int(m[-1][0])
                ex += int(m[-1][1])
            t_last = max(t_last, pr.t_end or 0)
    th = Throughput(r.c, a.batch)
    t0 = r.t_workers
    # the rate over the middle of the run (the start has the registrations,
    # the end the workers waiting for the last chunks)
    span = t_last - t0
    rate = th.rate(t0 + 0.2 * span, t0 + 0.8 * span) if span > 2 else ex / max(1e-9, span)
    acc = ACC_RE.findall(read_log(r.c.workers[0]))
    acc = float(acc[-1]) if acc else None
    sets = [x for x in r.mon.sets]
    cpu = sum(pr.cpu_s for lives in r.c.server_lives.values() for pr in lives)
    t_srv = max(pr.samples[-1][0] for pr in r.c.servers.values() if pr.samples) - \
        min(pr.t_start for pr in r.c.servers.values())
    written = 0
    for f in os.listdir(r.c.ckpt_dir):
        m = CKPT_RE.match(f)
        if m:
            written = max(written, os.path.getsize(os.path.join(r.c.ckpt_dir, f)))
    tl.log(name, f"{ex} examples in {span:.1f} s: {rate:.0f} examples/s over the middle 60%; "
           f"final test accuracy {acc}; {len(sets)} checkpoint set(s)")
    return dict(rate=rate, acc=acc, span=span, sets=sets, examples=ex, cpu=cpu, t_srv=t_srv,
                file_bytes=written)


def check_end(a, tl, r, train_size, epochs):
    """The checks at the end of the soak."""
    c, mon = r.c, r.mon
    # The replicas settle (bounded).
    t0 = time.time()
    st = None
    while time.time() - t0 < 30:
        st = mon.sr.all()
        if all(e is not None for e in st):
            p = primaries(c, st)
            if len(p) == c.S and all(len(v) == 1 for v in p.values()):
                if c.R == 1 or all(
                        st[s * c.R + k]["version"] == st[p[s][0]]["version"]
                        and st[s * c.R + k]["state_crc"] == st[p[s][0]]["state_crc"]
                        for s in range(c.S) for k in range(c.R)):
                    break
        time.sleep(0.5)
    else:
        tl.violation("replicas", f"the replicas of a shard do not hold one state 30 s after the run: "
                     f"{[(e or {}).get('version') for e in st]}")
    json.dump(st, open(os.path.join(r.out, "status-end.json"), "w"), indent=1)
    mon.last_poll = st
    p = primaries(c, st)
    # What the workers say they trained.
    printed_steps = printed_ex = 0
    killed = []
    bad_exit = []
    failed = []
    for k, lives in sorted(c.worker_lives.items()):
        for pr in lives:
            m = TRAINED_RE.findall(read_log(pr))
            if pr.killed:
                killed.append(pr)
            elif m:
                printed_steps += int(m[-1][0])
                printed_ex += int(m[-1][1])
            elif pr.rc == 0:  # a failure's exit is a violation already
                bad_exit.append(pr)
            else:
                failed.append(pr)
    for pr in bad_exit:
        tl.violation("data", f"{pr.name} (exit {pr.rc}) did not say what it trained")
    # A life that did not say what it trained: at least the step of its last
    # progress record; at most what the shards heard from it when it was
    # killed (the step of its last push or heartbeat, ks): it completed at
    # most ks + 1 steps, and a shard may apply one push more, sent before
    # the kill and still on its way (a stalled server, a slow link), so
    # ks + 2 pushes. Without ks: the straggle sleep bounds the steps since
    # the last record.
    k_lo = k_hi = k_hi_push = 0
    for pr in killed + failed:
        t_last, steps, best = last_logged(pr, a.batch)
        gap = max(0.0, (pr.t_end or t_last) - t_last)
        if a.straggle_ms > 0:  # a step sleeps --straggle-ms at least
            best = min(best, 1000.0 / a.straggle_ms) if best else 1000.0 / a.straggle_ms
        hi = steps + int(math.ceil(best * gap)) + 2
        hi_push = hi
        ks = getattr(pr, "kill_step", None)
        if ks is not None:  # what the shards heard last (see Nemesis.killed_steps)
            hi = max(steps, min(hi, ks + 1))
            hi_push = max(steps, min(hi_push, ks + 2))
        k_lo += steps
        k_hi += hi
        k_hi_push += hi_push
    tl.log("check", f"the workers: {printed_steps} steps, {printed_ex} examples in {sum(map(len, c.worker_lives.values())) - len(killed)} "
           f"life(s) that said so; {len(killed)} life(s) SIGKILLed: {k_lo} to {k_hi} steps completed "
           f"({k_hi_push} pushes at most)")
    # Versions: every acknowledged push applied once.
    for s in range(c.S):
        if s not in p:
            tl.violation("acknowledged", f"shard {s} has no primary at the end")
            continue
        v = st[p[s][0]]["version"]
        if a.mode == "sync":
            lo, hi = 0, printed_steps + k_hi
            what = "sync: at least the steps of any one worker"
            lo = max([int(m[-1][0]) for lives in c.worker_lives.values() for pr in lives
                      for m in [TRAINED_RE.findall(read_log(pr))] if m and not pr.killed] or [0])
        else:
            lo, hi = printed_steps + k_lo, printed_steps + k_hi_push
            what = "one update per push acknowledged"
        if s in mon.rolled_back and (c.R == 1 or s in mon.total_loss):
            tl.log("check", f"shard {s}: version {v}; restored from checkpoints (R = {c.R}): acknowledged "
                   f"updates since the set before each kill may be lost, so the floor is what counts: "
                   f"{mon.floor[s]} (never gone below: {'no violation' if not any(x[1] == 'checkpoint floor' for x in tl.violations) else 'VIOLATED'})")
            continue
        ok = lo <= v <= hi
        tl.log("check", f"shard {s}: version {v}, the workers saw {lo}..{hi} pushes acknowledged ({what}): "
               f"{'ok' if ok else 'VIOLATION'}")
        if not ok:
            tl.violation("acknowledged", f"shard {s} applied {v} updates; the workers saw between {lo} and {hi} "
                         f"acknowledged ({'lost' if v < lo else 'applied twice'}: {lo - v if v < lo else v - hi})")
    # sync: a round is one step on every shard, so the shards end at one
    # version (R = 1 restores aside: a restored shard may differ by the
    # rounds the workers resend, docs "What a crash costs").
    if a.mode == "sync" and len(p) == c.S:
        vs = [st[p[s][0]]["version"] for s in range(c.S)]
        restored = [s for s in range(c.S) if s in mon.rolled_back]
        if len(set(vs)) > 1 and not restored:
            tl.violation("acknowledged", f"sync: the shards end at versions {vs}: a round is one step on "
                         f"every shard, so some shard lost or merged steps")
        else:
            tl.log("check", f"sync: the shards end at versions {vs}"
                   + (f" (shards {restored} restored from checkpoints: not compared)" if restored and len(set(vs)) > 1
                      else ": one version, ok"))
    if a.lease_chunk <= 0:
        tl.log("check", f"data: no leases (each worker its static share); the workers trained "
               f"{printed_steps} steps, {printed_ex} examples")
        r.data = None
    else:
        check_leases(a, tl, r, st, p, epochs, train_size, printed_ex, killed, failed, k_lo, k_hi_push)
    check_accuracy_resources(a, tl, r)
    return st


def check_leases(a, tl, r, st, p, epochs, train_size, printed_ex, killed, failed, k_lo, k_hi_push):
    """Lease records: every epoch, every chunk once; examples trained
    against the records."""
    c, mon = r.c, r.mon
    p0 = p.get(0, [None])[0]
    if p0 is not None:
        for e in st[p0].get("lease_epochs", []):
            mon.epochs[e["epoch"]] = e
    eps = [mon.epochs.get(k) for k in range(epochs)]
    missing = [k for k, e in enumerate(eps) if e is None]
    if missing:
        # the records of epochs Status no longer keeps: shard 0's metrics files
        for i in range(c.R):
            for pr in c.server_lives[i]:
                for rec in metrics_records(pr):
                    k = rec.get("lease_epoch")
                    if k in missing:
                        eps[k] = dict(rec, epoch=k, finished=True)
    missing = [k for k, e in enumerate(eps) if e is None]
    if missing:
        tl.violation("data", f"no record of lease epoch(s) {missing} (of {epochs})")
    done = [e for e in eps if e]
    for e in done:
        if not e.get("finished") or e["chunks_once"] != e["chunks"] or e["examples_completed"] != train_size:
            tl.violation("data", f"lease epoch {e['epoch']}: {json.dumps(e)} (expected finished, every chunk "
                         f"once, {train_size} examples completed)")
    comp = sum(e.get("examples_completed", 0) for e in done)
    redone = sum(e.get("examples_redone", 0) for e in done)
    wasted = sum(e.get("examples_wasted", 0) for e in done)
    rehanded = sum(e.get("examples_rehanded", 0) for e in done)
    recovered = sum(e.get("examples_recovered", 0) for e in done)
    abandoned = sum(e.get("examples_abandoned", 0) for e in done)
    rec = comp + redone + wasted + abandoned
    across = r.restore_across_epoch
    if not killed and not failed:
        ok = printed_ex == rec
        rule = "exact: trained == completed + redone + wasted + abandoned"
    else:
        # A SIGKILLed life's pushes are in the records (shard 0 counts each
        # on its lease); what it trained is known from its log (the steps
        # logged) and the shards (the steps heard, +1 on its way).
        # A chunk's last batch may be smaller than the others.
        min_b = min(a.batch, a.lease_chunk % a.batch or a.batch)
        lo = rec - k_hi_push * a.batch
        hi = rec - k_lo * min_b
        if 0 in mon.rolled_back and c.R == 1:
            # shard 0 restored: a killed life's pushes after the set it went
            # back to are forgotten with the updates (docs, "What a crash costs")
            hi = rec
        ok = lo <= printed_ex <= hi
        rule = (f"bounds (SIGKILLed lives: their pushes are in the records, their steps between their "
                f"logs' and the shards' last): records - killed lives' pushes <= trained <= records - "
                f"killed lives' logged examples: {lo} <= {printed_ex} <= {hi}")
    if across:
        tl.log("check", f"data: shard 0 restored a set taken before the end of an epoch the workers had "
               f"finished ({len(across)} time(s): {'; '.join(across)}): the records cannot see what was "
               f"trained of the next epoch then (docs, 'What a crash costs'), so the sum is not checked: "
               f"{printed_ex - rec:+d} examples trained beyond completed + redone + wasted")
        rule = "not checked (a restore across an epoch's end)"
        ok = True
    tl.log("check", f"data: {len(done)} epoch(s), every chunk once: "
           f"{'ok' if not mon.chunk_violations else 'NO'}; the workers trained {printed_ex} examples, the records "
           f"{comp} completed ({recovered} recovered) + {redone} redone + {wasted} wasted + {abandoned} abandoned, "
           f"{rehanded} handed out "
           f"again; rule {rule}: {'ok' if ok else 'VIOLATION'}")
    if not ok:
        tl.violation("data", f"the examples trained ({printed_ex}) do not match the records ({rule})")
    r.data = dict(comp=comp, redone=redone, wasted=wasted, rehanded=rehanded, recovered=recovered,
                  abandoned=abandoned, trained=printed_ex)


def check_accuracy_resources(a, tl, r):
    """The final accuracy against the fault-free run's; the servers'
    resources (no growth after the warm-up) and the checkpoint sets."""
    c, mon = r.c, r.mon
    # Accuracy.
    acc = ACC_RE.findall(read_log(c.worker_lives[0][-1]))
    acc = float(acc[-1]) if acc else None
    ref = r.base_acc
    if acc is None:
        tl.violation("accuracy", "the chief printed no final test accuracy")
    else:
        want = max(a.min_accuracy, (ref - a.accuracy_margin) if ref is not None else 0)
        ok = acc >= want
        tl.log("check", f"accuracy: the chief's final test accuracy {acc:.4f}; the fault-free run's "
               f"{ref if ref is not None else '-'}; wanted >= {want:.4f} (max of --min-accuracy "
               f"{a.min_accuracy} and the fault-free run's - {a.accuracy_margin}): {'ok' if ok else 'VIOLATION'}")
        if not ok:
            tl.violation("accuracy", f"final test accuracy {acc:.4f} < {want:.4f}")
    r.final_acc = acc
    # Resources: no growth after the warm-up.
    t_a, t_b = r.t_workers, r.t_nemesis_end
    third = (t_b - t_a) / 3
    grown = []
    for i, lives in c.server_lives.items():
        for pr in lives:
            mid = [x for x in pr.samples if t_a + third <= x[0] < t_a + 2 * third]
            last = [x for x in pr.samples if t_a + 2 * third <= x[0] <= t_b]
            if len(mid) < 5 or len(last) < 5:
                continue
            for j, (what, slack) in enumerate((("RSS kB", a.rss_slack_mb * 1024), ("descriptors", 24),
                                              ("threads", 8)), start=1):
                m1, m2 = max(x[j] for x in mid), max(x[j] for x in last)
                if m2 > 1.5 * m1 + slack:
                    grown.append(f"{pr.name}: {what} {m1} -> {m2}")
    maxes = {}
    for lives in c.server_lives.values():
        for pr in lives:
            for x in pr.samples:
                maxes["rss"] = max(maxes.get("rss", 0), x[1])
                maxes["fds"] = max(maxes.get("fds", 0), x[2])
                maxes["thr"] = max(maxes.get("thr", 0), x[3])
    tl.log("check", f"resources: servers' max RSS {maxes.get('rss', 0) // 1024} MB, descriptors "
           f"{maxes.get('fds', 0)}, threads {maxes.get('thr', 0)}; growth (last third > 1.5 x middle third "
           f"+ slack): {'none' if not grown else '; '.join(grown)}")
    for g in grown:
        tl.violation("resources", g)
    mx = max((n for _, n in mon.ckpt_counts), default=0)
    tl.log("check", f"checkpoints: at most {mx} set(s) on disk at once (--keep-checkpoints "
           f"{a.keep_checkpoints}); {len(mon.sets)} set(s) completed")


def final_states(c, st):
    """Per shard, its primary's (version, state CRC) in a settled Status."""
    p = primaries(c, st)
    return {s: (st[p[s][0]]["version"], st[p[s][0]]["state_crc"]) for s in range(c.S) if s in p}


def reference_run(a, tl, net, root_out, job, tag):
    """--bitwise: the soak's job again, without faults, to its end; the
    shards' final (version, state CRC), once every replica holds it."""
    sub = argparse.Namespace(**vars(a))
    r = Run(sub, tl, net, os.path.join(root_out, "reference"), job,
            os.path.join(root_out, "reference", "ckpt"), tag, "reference")
    tl.log("reference", f"the same job without faults ({job['epochs']} epoch(s), {a.workers} workers)")
    r.start()
    t_end = time.time() + max(a.baseline_limit, 2 * a.duration)
    states = None
    try:
        while not r.workers_done():
            if time.time() > t_end:
                raise RuntimeError("the fault-free reference run did not end in time")
            time.sleep(0.3)
        t0 = time.time()
        while time.time() - t0 < 30 and states is None:
            st = r.mon.sr.all()
            p = primaries(r.c, st)
            if all(e is not None for e in st) and len(p) == r.c.S and all(
                    st[s * r.c.R + k]["state_crc"] == st[p[s][0]]["state_crc"]
                    for s in range(r.c.S) for k in range(r.c.R)):
                states = final_states(r.c, st)
            else:
                time.sleep(0.5)
    finally:
        r.mon.stop()
        bad = r.stop_servers()
    for b in bad:
        tl.violation("processes", f"reference: {b}")
    if states is None:
        raise RuntimeError("the reference run's replicas did not settle on one state in 30 s")
    return states


def running_workers(c, nem, t):
    """Workers alive and not SIGSTOPped at time t."""
    n = 0
    for lives in c.worker_lives.values():
        for pr in lives:
            if pr.t_start <= t and (pr.t_end is None or t < pr.t_end):
                n += 1
    for f in nem.faults:
        if f["kind"] == "worker_stop" and f["start"] <= t < f["end"]:
            n -= 1
    return max(0, n)


def report(a, tl, r, base, base_nockpt):
    """The costs, from the run's records: examples/s from the workers'
    --metrics progress records, recovery from the fast polls after each
    server kill, repeats from shard 0's lease records, checkpoint sets
    from shard 0's log."""
    c, nem = r.c, r.nem
    th = Throughput(c, a.batch)
    t_a, t_b = r.t_workers + a.warmup_s, r.t_nemesis_end
    per_worker = base["rate"] / a.workers if base else None
    busy = [(f["start"], max(f["end"], f["start"]) + 10) for f in nem.faults]

    def clean(x, y, me=None):
        return not any(s < y and x < e for (s, e), f in zip(busy, nem.faults) if f is not me)
    windows = [(x, x + 3) for x in frange(t_a, t_b - 3, 1.0)]
    steady = [th.rate(x, y) / max(1, running_workers(c, nem, x)) for x, y in windows if clean(x, y)]
    steady_pw = statistics.median(steady) if steady else per_worker
    ref = per_worker or steady_pw
    print()
    print(f"soak report (seed {a.seed}): {a.shards} shard(s) x {a.replicas}, {a.workers} workers at the start, "
          f"{'netns' if r.net.netns else 'loopback'}, mode {a.mode}, straggle {a.straggle_ms} ms/step")
    if base:
        print(f"  fault-free run ({a.baseline_epochs} epoch(s), {a.workers} workers, sets every {a.checkpoint_secs} s): "
              f"{base['rate']:.0f} examples/s, {per_worker:.0f} per worker")
    if base and base_nockpt:
        d = base_nockpt["rate"] - base["rate"]
        ms = sorted(x[3] for x in base["sets"])
        c1, c0 = base["cpu"] / base["t_srv"], base_nockpt["cpu"] / base_nockpt["t_srv"]
        print(f"  the same without checkpoint sets: {base_nockpt['rate']:.0f} examples/s: sets every "
              f"{a.checkpoint_secs} s cost {d / base_nockpt['rate'] * 100:+.1f}% of the examples/s; shard 0 "
              f"took {statistics.median(ms) if ms else 0:.0f} ms (median) per set from the cut to complete; "
              f"the servers used {c1 * 1000:.0f} ms of CPU per second with sets, {c0 * 1000:.0f} without "
              f"({(c1 - c0) * 1000:+.0f} ms/s, all {c.N} servers); each set writes {c.S} file(s) of "
              f"{base['file_bytes'] / 1024:.0f} KiB")
    print(f"  soak, no fault within 10 s: {steady_pw:.0f} examples/s per running worker "
          f"(median of {len(steady)} 3-s windows)" if steady else "  soak: no window free of faults")
    print()
    print("  ex/s: the cluster's examples/s; x: against the fault-free rate per worker times the workers "
          "running just before the fault")
    print(f"  {'fault':<13} {'n':>3} {'clean':>5} {'during ex/s':>11} {'x':>5} {'after ex/s':>10} {'x':>5} "
          f"{'kill->ack s':>11} {'->full speed s':>14}")
    by = collections.defaultdict(list)
    for f in nem.faults:
        by[f["kind"]].append(f)
    rows = []
    for kind in FAULT_KINDS:
        fs = by.get(kind, [])
        if not fs:
            continue
        cl = [f for f in fs if clean(f["start"] - 3, max(f["end"], f["start"]) + 10, f)]
        use = cl or fs
        during, after, dx, ax, acks, full = [], [], [], [], [], []
        for f in use:
            s0, e = f["start"], max(f["end"], f["start"] + 3)  # instant faults: the 3 s after
            n0 = max(1, running_workers(c, nem, s0 - 0.5))
            exp = ref * n0
            during.append(th.rate(s0, e))
            after.append(th.rate(e, e + 10))
            dx.append(during[-1] / exp)
            ax.append(after[-1] / exp)
            if "t_ack" in f:
                acks.append(f["t_ack"] - s0)
            for x in frange(s0, s0 + 60, 0.25):
                if th.rate(x, x + 3) >= 0.9 * exp:
                    full.append(x - s0)
                    break

        def med(v, fmt="{:.2f}"):
            return fmt.format(statistics.median(v)) if v else "-"
        rows.append((kind, len(fs), len(cl), med(during, "{:.0f}"), med(dx), med(after, "{:.0f}"), med(ax),
                     med(acks), med(full)))
        rng = f"  (kill->ack {min(acks):.2f}..{max(acks):.2f})" if len(acks) > 1 else ""
        print(f"  {kind:<13} {len(fs):>3} {len(cl):>5} {rows[-1][3]:>11} {rows[-1][4]:>5} {rows[-1][5]:>10} "
              f"{rows[-1][6]:>5} {rows[-1][7]:>11} {rows[-1][8]:>14}{rng}")
    print("  (medians over the faults of the kind with no other fault from 3 s before to 10 s after, the "
          "'clean' ones; over all of them when none is clean)")
    k0 = [f for f in nem.faults if f["kind"] in ("server_kill", "shard0_kill") and f.get("shard") == 0 and
          (c.R == 1 or f.get("role") == "primary")]
    d = getattr(r, "data", None)
    if d:
        n = len(k0)
        print(f"  shard 0 restarts (R = {c.R}: SIGKILLs of {'its primary' if c.R > 1 else 'shard 0'}): {n}; "
              f"examples redone {d['redone']}, wasted {d['wasted']}, handed out again {d['rehanded']}, "
              f"recovered {d['recovered']}" + (f"; per restart: {(d['redone'] + d['wasted']) / n:.0f} "
                                                f"trained twice (redone + wasted), {d['rehanded'] / n:.0f} handed "
                                                f"out again" if n else ""))
    sets = r.mon.sets
    if len(sets) > 1:
        span = max(1e-9, sets[-1][0] - sets[0][0])
        ms = sorted(x[3] for x in sets)
        print(f"  checkpoint sets in the soak: {len(sets)} ({len(sets) / span:.2f}/s), cut to complete: "
              f"median {statistics.median(ms):.0f} ms, 90th percentile {ms[int(0.9 * (len(ms) - 1))]} ms, "
              f"max {ms[-1]} ms")
    return rows


def frange(a, b, step):
    x = a
    n = 0
    while x < b and n < 100000:
        yield x
        x += step
        n += 1


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="where ps-server and ps-worker are")
    ap.add_argument("--out", default="", help="a directory for logs (default: a new one under /tmp)")
    ap.add_argument("--duration", type=float, default=180, help="seconds of faults (default 180)")
    ap.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: from the clock)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2, help="replicas per shard, 1 to 5 (default 2)")
    ap.add_argument("--workers", type=int, default=3, help="workers at the start (default 3)")
    ap.add_argument("--max-workers", type=int, default=0, help="at most this many at once (default workers + 2)")
    ap.add_argument("--min-workers", type=int, default=2, help="leaves keep at least this many (default 2)")
    ap.add_argument("--mode", default="async", choices=["async", "sync"])
    ap.add_argument("--netns", default="auto", choices=["auto", "on", "off"],
                    help="hosts in network namespaces: on, off (loopback), or auto (default: on when root)")
    ap.add_argument("--faults", default="", help=f"comma-separated kinds (default all): {', '.join(FAULT_KINDS)}")
    ap.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults (default 4)")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="no faults for this long after the workers start")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="one fault at a time, every kind in turn, each --gap-s after the last was undone and "
                    "the replicas caught up (what each kind costs, with --report)")
    ap.add_argument("--gap-s", type=float, default=14.0, help="with --one-at-a-time (default 14: no fault within 10 s after the last, nor 3 s before the next)")
    ap.add_argument("--allow-total-loss", action="store_true", help="may kill every replica of a shard at once")
    ap.add_argument("--checkpoint-secs", type=float, default=1)
    ap.add_argument("--keep-checkpoints", type=int, default=3)
    ap.add_argument("--progress-bound", type=float, default=30, help="seconds the versions may stand still")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    ap.add_argument("--accuracy-margin", type=float, default=0.05)
    ap.add_argument("--straggle-ms", type=int, default=20, help="workers sleep this long per step (default 20)")
    ap.add_argument("--timeout-ms", type=int, default=4000, help="the workers' call deadline (default 4000)")
    ap.add_argument("--retry-s", type=float, default=120)
    ap.add_argument("--heartbeat-ms", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lease-chunk", type=int, default=128)
    ap.add_argument("--train-size", type=int, default=24576)
    ap.add_argument("--fill", type=float, default=0.85, help="size the job for this share of --duration")
    ap.add_argument("--epochs", type=int, default=0, help="the soak job's epochs (default: from the baseline)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the fault-free run (then --epochs)")
    ap.add_argument("--baseline-epochs", type=int, default=1, help="epochs of the fault-free run (default 1)")
    ap.add_argument("--baseline-limit", type=float, default=300)
    ap.add_argument("--finish-limit", type=float, default=0, help="seconds the workers get to finish after "
                    "the faults (default max(120, duration); a hang shows sooner as a progress violation)")
    ap.add_argument("--catchup-s", type=float, default=20)
    ap.add_argument("--worker-log-interval", type=float, default=0.2)
    ap.add_argument("--summary-every", type=float, default=10)
    ap.add_argument("--max-rss-mb", type=int, default=1024)
    ap.add_argument("--rss-slack-mb", type=int, default=16)
    ap.add_argument("--report", action="store_true", help="print the costs (and run a baseline without sets)")
    ap.add_argument("--tmpfs-mb", type=int, default=32)
    ap.add_argument("--bitwise", action="store_true",
                    help="sync, 2 workers with static shares, server faults only: the final state must "
                    "equal a fault-free run's bit for bit (runs the job again without faults)")
    a = ap.parse_args()
    if a.bitwise:
        worker_kinds = [k for k in (a.faults.split(",") if a.faults else []) if k.startswith("worker_")]
        if worker_kinds:
            sys.exit(f"soak: --bitwise takes server faults only (not {', '.join(worker_kinds)}): a worker "
                     f"killed or joining changes which gradients a step sums")
        if a.replicas < 2 or a.allow_total_loss:
            sys.exit("soak: --bitwise needs --replicas 2 or more (a restore from a checkpoint set repeats "
                     "steps) and no --allow-total-loss")
        a.mode, a.lease_chunk = "sync", 0
        a.workers = a.min_workers = a.max_workers = 2
        # No worker is dropped for silence (a step would then go with one
        # worker's gradient, by design): a minute, beyond any fault here.
        a.heartbeat_ms = max(a.heartbeat_ms, 60000)
        if not a.faults:
            a.faults = ",".join(k for k in FAULT_KINDS if not k.startswith("worker_"))
    if a.seed is None:
        a.seed = int(time.time() * 1000) % 1000000007
    if not a.max_workers:
        a.max_workers = a.workers + 2
    a.build = os.path.abspath(a.build)
    for b in ("ps-server", "ps-worker"):
        if not os.access(os.path.join(a.build, b), os.X_OK):
            sys.exit(f"soak: no {b} in {a.build} (build first, or --build DIR)")
    out = a.out or tempfile.mkdtemp(prefix="ps-soak.")
    os.makedirs(out, exist_ok=True)
    out = os.path.abspath(out)
    tl = Timeline(os.path.join(out, "timeline.txt"), a.seed)
    root = os.geteuid() == 0
    with open(os.path.join(out, "harness.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    if root:
        remove_stale_mounts()
    netns = a.netns == "on" or (a.netns == "auto" and root)
    tag = f"sk{os.getpid()}"
    tl.log("soak", f"seed {a.seed}; {a.duration:.0f} s of faults; {a.shards} shard(s) x {a.replicas} "
           f"replica(s), {a.workers} workers ({a.min_workers}..{a.max_workers}), mode {a.mode}; logs in {out}")
    os.environ["PS_TOKEN_FILE"] = os.path.join(out, "token")
    old = os.umask(0o077)
    with open(os.environ["PS_TOKEN_FILE"], "w") as f:
        f.write(os.urandom(24).hex() + "\n")
    os.umask(old)
    net = None
    mount = None
    r = None
    rc = 1
    term = {"got": False}

    def on_term(signum, frame):
        term["got"] = True
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_term)
    try:
        if netns:
            if not root:
                raise SystemExit("soak: --netns on needs root")
            remove_stale_namespaces()
            try:
                net = Net(tl, True, tag, a.shards * a.replicas)
            except (RuntimeError, subprocess.SubprocessError) as ex:
                if a.netns == "on":
                    raise
                tl.log("soak", f"SKIPPED the network faults (partitions, delays): cannot make network "
                       f"namespaces here ({ex}); on loopback")
                if net:
                    net.cleanup()
                net = None
        elif a.netns == "auto":
            tl.log("soak", "SKIPPED the network faults (partitions, delays): they need root for network "
                   "namespaces; on loopback")
        if net is None:
            net = Net(tl, False, tag, a.shards * a.replicas)
        ckpt_root = os.path.join(out, "ckptfs")
        os.makedirs(ckpt_root, exist_ok=True)
        fill = None
        if root:
            rr = run(["mount", "-t", "tmpfs", "-o", f"size={a.tmpfs_mb}m", "tmpfs", ckpt_root])
            if rr.returncode == 0:
                mount = ckpt_root
                fill = Filler(mount)
            else:
                tl.log("soak", f"SKIPPED the full-disk fault: cannot mount a tmpfs ({rr.stderr.strip()})")
        else:
            tl.log("soak", "SKIPPED the full-disk fault: it needs root to mount a small tmpfs")
        if net.netns:
            tl.log("soak", f"hosts in network namespaces {tag}-*: servers at {','.join(net.addrs)}")
        # The fault-free runs.
        base = base_nockpt = None
        if not a.no_baseline:
            base = baseline(a, tl, net, out, a.train_size, tag, a.checkpoint_secs, "baseline")
            if a.report:
                base_nockpt = baseline(a, tl, net, out, a.train_size, tag, 0, "baseline-nosets")
        epochs = a.epochs
        if not epochs:
            rate = base["rate"] if base else 3000
            epochs = max(2, int(round(a.duration * a.fill * rate / a.train_size)))
        job = make_job(a, epochs, a.train_size)
        tl.log("soak", f"the job: {epochs} epoch(s) of {a.train_size} synthetic examples "
               + (f"in chunks of {a.lease_chunk}" if a.lease_chunk > 0 else "in static shares") +
               f", batch {a.batch}, {a.mode}; about {epochs * a.train_size / max(1, base['rate'] if base else 3000):.0f} s "
               f"undisturbed")
        ckpt_dir = os.path.join(ckpt_root, "ckpt")
        r = Run(a, tl, net, os.path.join(out, "soak"), job, ckpt_dir, tag, "soak")
        r.base_acc = base["acc"] if base else None
        r.restore_across_epoch = []
        r.nem = None
        r.start()
        nem = Nemesis(a, tl, r.c, r.mon, net, fill)
        r.nem = nem
        tl.log("soak", f"{r.c.N} servers and {a.workers} workers started; faults from "
               f"{a.warmup_s:.0f} s on, every {a.fault_every} s on average: {', '.join(nem.kinds)}")
        t_stop = time.time() + a.duration
        while time.time() < t_stop:
            if r.workers_done():
                tl.log("soak", "every worker finished before the schedule's end")
                break
            nxt = nem.step(t_stop)
            time.sleep(max(0.02, min(0.25, nxt - time.time())))
        r.t_nemesis_end = time.time()
        tl.log("soak", "the schedule is over: healing (SIGCONT, links up, disk freed, servers restarted)")
        nem.heal_all()
        # Dead servers come back; dead workers rejoin unless the job is done.
        for i, pr in r.c.servers.items():
            if pr.state == "dead":
                r.c.start_server(i)
                tl.log("nemesis", f"restarted server {i}")
        r.workers_done()
        for k, pr in list(r.c.workers.items()):
            if pr.state == "dead" and pr.killed and not r.c.job_done and k not in r.c.retired:
                r.c.start_worker(k, first=nem.first_server())
                tl.log("nemesis", f"restarted worker {k}")
        if r.c.workers[0].state == "dead" and r.c.workers[0].killed:
            r.c.start_worker(0, first=nem.first_server())
            tl.log("nemesis", "restarted the chief")
        # back to the workers of the start, so that the job ends soon
        alive = [k for k, w in r.c.workers.items() if w.state != "dead" and k not in r.c.retired]
        for _ in range(max(0, a.workers - len(alive))):
            if r.c.job_done:
                break
            k = max(list(r.c.worker_lives) + [-1]) + 1
            r.c.start_worker(k, first=nem.first_server())
            tl.log("nemesis", f"worker {k} joins (back to {a.workers} workers for the end of the job)")
        limit = a.finish_limit or max(120, a.duration)
        t_fin = time.time() + limit
        r.hung = False
        while not r.workers_done():
            if time.time() > t_fin:
                r.hung = True
                st = r.mon.sr.all()
                json.dump(st, open(os.path.join(r.out, "status-hung.json"), "w"), indent=1)
                alive = r.c.alive_workers()
                tl.violation("progress", f"the workers did not finish within {limit:.0f} s of the schedule's "
                             f"end: {len(alive)} still running (Status in {r.out}/status-hung.json); "
                             f"versions {[(e or {}).get('version') for e in st]}, gradients in for the next "
                             f"sync step {[(e or {}).get('sync_pending') for e in st]}; their last lines: "
                             + " | ".join(f"{w.name}: {read_log(w).strip().splitlines()[-1][:200]!r}"
                                          for w in alive if read_log(w).strip()))
                for w in alive:
                    r.c.signal(w, signal.SIGKILL)
                break
            time.sleep(0.3)
        tl.log("soak", "every worker has exited" if not r.hung else "the workers were SIGKILLed")
        r.mon.stop()
        # Shard 0 restored across an epoch's end (R = 1, or every replica
        # lost at once: otherwise a restarted replica takes the primary's
        # state before it may serve, and its restore from disk is not used).
        for (t, i, life, ep) in r.mon.restores:
            prev = (i, life - 1)
            if r.c.R > 1 and 0 not in r.mon.total_loss:
                continue
            if ep in r.mon.epoch_ends.get(prev, []):
                r.restore_across_epoch.append(f"server {i} life {life} restored epoch {ep}, which its "
                                              f"previous life had finished")
        if r.hung:
            tl.log("check", "the run did not finish: the counts at the end (versions against what the "
                   "workers trained, the lease records' sum, the accuracy) are not checked")
        else:
            st_end = check_end(a, tl, r, a.train_size, epochs)
        for b in r.stop_servers():
            tl.violation("processes", b)
        if a.bitwise and not r.hung:
            got = final_states(r.c, st_end)
            want = reference_run(a, tl, net, out, job, tag)
            same = got == want
            tl.log("check", f"bitwise: the soak's shards end at (version, state CRC) "
                   f"{[(v, f'{x:08x}') for v, x in got.values()]}, the fault-free run's at "
                   f"{[(v, f'{x:08x}') for v, x in want.values()]}: {'ok' if same else 'VIOLATION'}")
            if not same:
                tl.violation("acknowledged", f"sync: the final state differs from the fault-free run's "
                             f"({got} against {want}): an acknowledged step lost, doubled or reordered")
        for pr in r.c.all:
            text = read_log(pr)
            if "Sanitizer" in text or "runtime error:" in text:
                tl.violation("processes", f"a sanitizer report in {pr.log}")
        if a.report:
            report(a, tl, r, base, base_nockpt)
        kinds = collections.Counter(f["kind"] for f in nem.faults)
        tl.log("soak", f"{len(nem.faults)} faults: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        rc = 1 if tl.violations else 0
    except KeyboardInterrupt:
        tl.violation("soak", "interrupted" + (" (SIGTERM)" if term["got"] else ""))
    except SystemExit:
        raise
    except Exception as ex:
        import traceback
        traceback.print_exc()
        tl.violation("soak", f"the harness failed: {ex!r}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if r is not None:
            try:
                r.mon.stop_ev.set()
            except Exception:
                pass
        cleanup_procs()  # every process of every run
        if net is not None:
            net.cleanup()
        if mount:
            run(["umount", "-l", mount])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    n = len(tl.violations)
    if n:
        for t, checker, text in tl.violations[:20]:
            print(f"  at {t:.1f} s: {checker}: {text}")
    again = []
    skip = False
    for x in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if x in ("--seed", "--out", "--duration", "--build"):
            skip = True
            continue
        if x.startswith(("--seed=", "--out=", "--duration=", "--build=")):
            continue
        again.append(shlex.quote(x))
    print(f"soak: {'PASS' if rc == 0 else f'FAIL ({n} violation(s))'}; logs in {out}; again: "
          f"tests/soak/run.sh {a.duration:.0f} {' '.join(again + ['--seed', str(a.seed)])}; seed {a.seed}")
    sys.exit(rc)


ALL_PROCS = []
_orig_popen = subprocess.Popen
try:  # loaded here: a child between fork and exec must not import
    import ctypes
    _LIBC = ctypes.CDLL(None, use_errno=True)
except (ImportError, OSError):
    _LIBC = None


def cleanup_procs():
    for p in ALL_PROCS:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _die_with_parent():
    """In the child: SIGKILL when the harness dies (prctl PR_SET_PDEATHSIG),
    so that a harness killed without its cleanup (a CTest time-out) leaves
    no server running."""
    if _LIBC is not None:
        _LIBC.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG


class _TrackedPopen(_orig_popen):
    """Every long-lived process started here is remembered, so the cleanup
    kills exactly those (by pid), whatever failed."""

    def __init__(self, *args, **kw):
        if kw.get("start_new_session"):
            kw["preexec_fn"] = _die_with_parent
        super().__init__(*args, **kw)
        if kw.get("start_new_session"):
            ALL_PROCS.append(self)


if __name__ == "__main__":
    subprocess.Popen = _TrackedPopen
    main()
