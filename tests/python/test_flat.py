"""python.flat: a job that declares only its parameter count, named tensors
and the optimizer (no layers), served as any other: the shards initialize
each tensor as the job says, checkpoint it, restore it on another number of
shards, replicate it (a replica takes over when its primary is killed, no
acknowledged push lost); ps-export writes it as one flat .npy and refuses
ONNX; ps-worker refuses it (it has no layers to compute)."""
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np

from common import LocalCluster, check, find_program, psclient, say

TENSORS = [{"name": "u", "shape": [30, 100], "init": {"uniform": 0.5}},
           {"name": "c", "shape": [1000], "init": {"constant": 1.5}},
           {"name": "z", "shape": [10, 10, 10]}]
JOB = {"job_id": "py-flat", "model": {"params": 5000, "tensors": TENSORS},
       "optimizer": {"name": "sgd", "lr": 1.0}, "seed": 3, "heartbeat_timeout_ms": 5000}


def wait_for(what, fn, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def served_and_checkpointed(out):
    ckpt = os.path.join(out, "ckpt")
    os.makedirs(ckpt)
    g = np.linspace(-1, 1, 5000, dtype=np.float32)
    with LocalCluster(JOB, servers=2, out=os.path.join(out, "a"), checkpoint_dir=ckpt,
                      server_args=["--checkpoint-secs", "1"]) as c:
        with psclient.connect(c.servers, insecure=True) as w:
            check(w.start_version == 0, f"a fresh run begins at version 0, not {w.start_version}")
            check(list(w.tensors) == ["u", "c", "z"] and w.tensors["z"].shape == (10, 10, 10),
                  w.tensors)
            p0 = w.pull().copy()
            u = w.view("u", p0)
            check(np.all(np.abs(u) <= 0.5) and np.abs(u).max() > 0.45 and abs(u.mean()) < 0.05,
                  "u: uniform(-0.5, 0.5)")
            check(np.all(w.view("c", p0) == 1.5) and np.all(w.view("z", p0) == 0), "c and z")
            w.push(g)
            p1 = w.pull().copy()
            check(np.array_equal(p1, p0 - g), "the push, once")
            wait_for("a checkpoint set with the push",
                     lambda: all(s["checkpoint_set_version"] >= 1 for s in c.status()))
    say("served: each tensor's init; a push; a checkpoint set")
    # Restored on 3 shards: the same values.
    with LocalCluster(JOB, servers=3, out=os.path.join(out, "b"), checkpoint_dir=ckpt) as c:
        with psclient.connect(c.servers, insecure=True) as w:
            check(w.num_shards == 3 and np.array_equal(w.pull(), p1), "restored on 3 shards")
            # The restored run begins at the checkpoint's version (one push).
            check(w.start_version == w.versions[0] == 1,
                  f"start_version {w.start_version}, versions {w.versions}")
    say("restored from 2 shards' checkpoints on 3")
    export = find_program("ps-export")
    job_path = os.path.join(out, "a", "job.json")
    r = subprocess.run([export, "--job", job_path, "--checkpoints", ckpt, "--out",
                        os.path.join(out, "npy")], capture_output=True, text=True, timeout=60)
    check(r.returncode == 0, r.stderr)
    files = os.listdir(os.path.join(out, "npy"))
    flat = np.load(os.path.join(out, "npy", "params.npy"))
    check(files == ["params.npy"] and flat.dtype == np.float32 and flat.shape == (5000,), files)
    check(np.array_equal(flat, p1), "ps-export: the checkpoint's vector")
    r = subprocess.run([export, "--job", job_path, "--checkpoints", ckpt, "--format", "onnx",
                        "--out", os.path.join(out, "m.onnx")], capture_output=True, text=True,
                       timeout=60)
    check(r.returncode == 1 and "no layers" in r.stderr and "--format npy" in r.stderr, r.stderr)
    say(f"ps-export: params.npy; ONNX refused: {r.stderr.strip()[:90]}...")


def replicated(out):
    job = dict(JOB, job_id="py-flat-repl", replicas_per_shard=2)
    ckpt = os.path.join(out, "repl")
    os.makedirs(ckpt)
    g = np.full(5000, 0.125, np.float32)
    # 2 shards x 2 replicas: a term needs a majority of the job's 4 servers.
    with LocalCluster(job, servers=4, out=ckpt, checkpoint_dir=ckpt) as c:
        wait_for("a primary per shard",
                 lambda: [s.get("replica_role") for s in c.status()].count("primary") == 2)
        with psclient.connect(c.servers, insecure=True, retry_s=30) as w:
            p0 = w.pull().copy()
            w.push(g)
            wait_for("the backups at their primaries' state",
                     lambda: len({s["state_crc"] for s in c.status()[:2]}) == 1)
            st = c.status()
            primary = [s["replica_role"] for s in st[:2]].index("primary")  # shard 0's
            say(f"replicas: roles {[s['replica_role'] for s in st]}, shard 0's crc "
                f"{st[0]['state_crc']}")
            c.procs[primary].send_signal(signal.SIGKILL)
            c.procs[primary].wait()
            w.push(g)  # to the new primary, after the fail-over
            check(np.array_equal(w.pull(), p0 - 2 * g), "both pushes, each once, after fail-over")
    say("replicated: the backup took over, no push lost or doubled")


def refused_by_ps_worker(out):
    with LocalCluster(JOB, servers=1, out=os.path.join(out, "w")) as c:
        r = subprocess.run([find_program("ps-worker"), "--insecure", "--ps", c.servers,
                            "--retry-s", "5"], capture_output=True, text=True, timeout=60)
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    say(f"ps-worker: exit {r.returncode}: {last}")
    check(r.returncode == 2, f"ps-worker refused the flat job with exit 2 (got {r.returncode})")
    check("flat model" in r.stderr and "no layers" in r.stderr, r.stderr)
    job_path = os.path.join(out, "flat-job.json")
    with open(job_path, "w") as f:
        json.dump(JOB, f)
    r = subprocess.run([find_program("ps-worker"), "--local", "--job", job_path, "--max-steps", "1"],
                       capture_output=True, text=True, timeout=60)
    say(f"ps-worker --local: exit {r.returncode}")
    check(r.returncode == 2 and "no layers" in r.stderr,
          f"ps-worker --local refused the flat job: exit {r.returncode}: {r.stderr}")

def main():
    out = os.environ.get("PS_TEST_OUT") or os.path.join("/tmp", f"ps-pyflat.{os.getpid()}")
    os.makedirs(out, exist_ok=True)
    try:
        served_and_checkpointed(out)
        replicated(out)
        refused_by_ps_worker(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    say("python.flat: every check passed")


if __name__ == "__main__":
    main()
