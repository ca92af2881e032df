"""python.binding: psclient against live ps-server processes.

The binding's calls (pull and push into and out of NumPy arrays, other
buffers and torch tensors where torch is present, named ranges, rows,
leases, Status), its errors (a server's refusal quoted in the exception, a
wrong token, nothing listening, bad buffers), its retries (a push whose
shard stopped answering, retried, applied once on every shard), leaving on
SIGTERM, and the waits of the consistency modes (a sync pull waits for the
other worker's gradient, an ssp pull for the slowest worker). The job: SGD
with lr 1, so that a push of g takes exactly g off."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from common import BINDING_JOB, ROOT, LocalCluster, check, flat_job, psclient, raises, say


def pushes(cluster):
    return [s["pushes"] for s in cluster.status()]


def check_calls(c, w):
    check(w.param_count == 1000 and w.num_shards == 2 and w.mode == "async", repr(w))
    check(list(w.tensors) == ["a", "b"] and w.tensors["a"].shape == (10, 50), w.tensors)
    check(w.tensors["b"].offset == 500 and w.tables == {"emb": (1000, 4)}, w.tables)
    check(w.job["job_id"] == "py-binding" and "flat" in w.description, w.description)
    p0 = w.pull().copy()
    check(np.all(np.abs(p0[:500]) <= 0.1) and np.any(p0[:500] != 0), "a: uniform(-0.1, 0.1)")
    check(np.all(p0[500:] == 0.25), "b: the constant 0.25")
    # Other buffers, written in place: a fresh array, a bytearray's memory.
    out = np.empty(1000, np.float32)
    check(w.pull(out) is out and np.array_equal(out, p0), "pull into an array")
    raw = bytearray(4000)
    w.pull(memoryview(raw).cast("f"))
    check(np.array_equal(np.frombuffer(raw, np.float32), p0), "pull into a bytearray")
    try:
        import torch
        t = torch.zeros(1000)
        w.pull(t)
        check(np.array_equal(t.numpy(), p0), "pull into a torch tensor")
    except ImportError:
        say("no torch: torch tensors not tried")
    raises(ValueError, w.pull, np.zeros(999, np.float32))
    raises(ValueError, w.pull, np.zeros(1000, np.float64))
    raises(ValueError, w.pull, np.zeros((2, 1000), np.float32)[:, 0])
    ro = np.zeros(1000, np.float32)
    ro.flags.writeable = False
    raises(ValueError, w.pull, ro)
    # A push of g takes g off, exactly, once; versions move by one per shard.
    v0 = w.versions
    g = (np.arange(1000) % 7).astype(np.float32) / 8
    res = w.push(g, batch_size=10)
    check(res == psclient.PushResult(0, 0, 0), res)
    p1 = w.pull().copy()
    check(np.array_equal(p1, p0 - g), "push applied exactly once")
    check(w.versions == (v0[0] + 1, v0[1] + 1) and w.step == 1, w.versions)
    # Named ranges: views of w.params, no copies; a push of some ranges.
    views = w.pull_tensors()
    check(views["a"].shape == (10, 50) and np.shares_memory(views["a"], w.params), "views")
    ga = np.full((10, 50), 0.5, np.float32)
    w.push_tensors({"a": ga})
    p2 = w.pull().copy()
    check(np.array_equal(p2[:500], p1[:500] - 0.5) and np.array_equal(p2[500:], p1[500:]),
          "push_tensors: a moved, b untouched")
    raises(KeyError, w.push_tensors, {"nope": ga})
    say("calls: pull into 4 kinds of buffers, push exact, named ranges")


def check_errors(c, w):
    p = w.pull().copy()
    g = np.zeros(1000, np.float32)
    g[999] = np.nan  # on shard 1
    e = raises(psclient.ProtocolError, w.push, g)
    check(e.grpc_status == "INVALID_ARGUMENT" and "NaN" in e.message and e.server_message,
          f"the server's refusal quoted: {e.message}")
    check(w.push_pending() == 1, "shard 0 applied the round, shard 1 refused it")
    check(np.array_equal(w.pull()[500:], p[500:]), "the refused shard changed nothing")
    with open(os.open(os.path.join(c.out, "wrong-token"), os.O_WRONLY | os.O_CREAT, 0o600),
              "w") as f:
        f.write("not-the-job-token-at-all\n")
    e = raises(psclient.ProtocolError, psclient.connect, c.servers,
               token_file=os.path.join(c.out, "wrong-token"), insecure=True, retry_s=2)
    check(e.grpc_status == "UNAUTHENTICATED", e.message)
    e = raises(psclient.InvalidArgument, psclient.connect, c.servers, token_file="/nonexistent",
               insecure=True)
    check("/nonexistent" in str(e), str(e))
    t = time.monotonic()
    e = raises(psclient.Unavailable, psclient.connect, "127.0.0.1:1", insecure=True, retry_s=0.5)
    check(time.monotonic() - t < 5, "unreachable: given up after retry_s")
    raises(psclient.PSError, psclient.connect, "127.0.0.1:1", retry_s=0.5)  # neither TLS nor --insecure
    say(f"errors: {e.message[:80]}...")


def check_retries(c, w):
    """Shard 1 stops (SIGSTOP) during a push: the push fails after its
    deadline on shard 1 only, is retried to shard 1 alone when it is back,
    and each shard applies it once."""
    quick = psclient.connect(c.servers, insecure=True, timeout_ms=700, retry_s=0)
    p0 = quick.pull().copy()
    before = pushes(c)
    g = np.full(1000, 0.25, np.float32)
    os.kill(c.procs[1].pid, signal.SIGSTOP)
    try:
        raises(psclient.Unavailable, quick.push, g)
        check(quick.push_pending() == 1, "shard 0 done, shard 1 pending")
    finally:
        os.kill(c.procs[1].pid, signal.SIGCONT)
    quick.retry_s = 20
    quick.push_retry()
    check(quick.push_pending() == 0, "the retry reached shard 1")
    after = pushes(c)
    check(after == [before[0] + 1, before[1] + 1], f"each shard applied it once: {before} {after}")
    check(np.array_equal(quick.pull(), p0 - g), "the values: one push")
    # The automatic retries: shard 1 stops for 1.5 s while push() retries.
    before = pushes(c)
    os.kill(c.procs[1].pid, signal.SIGSTOP)
    threading.Timer(1.5, os.kill, (c.procs[1].pid, signal.SIGCONT)).start()
    t = time.monotonic()
    quick.push(g)
    check(time.monotonic() - t >= 1.2, "push() waited for shard 1")
    after = pushes(c)
    check(after == [before[0] + 1, before[1] + 1], f"retried, applied once: {before} {after}")
    check(np.array_equal(quick.pull(), p0 - 2 * g), "the values: two pushes")
    quick.close()
    say("retries: a push retried to the shard that missed it, applied once on each")


def check_rows_leases_status(c, w):
    rows = w.set_rows({"emb": [5, 999, 5, 17]})["emb"]
    check(list(rows.ids) == [5, 17, 999] and list(rows.inverse) == [0, 2, 0, 1], rows.inverse)
    w.pull()
    v0 = rows.values.copy()
    check(np.any(v0 != 0) and np.all(np.abs(v0) <= 0.05), "rows pulled")
    rows.grads[:] = 0.5
    w.grads[:] = 0
    w.push()
    w.pull()
    check(np.array_equal(rows.values, v0 - 0.5), "rows pushed with the dense gradient")
    raises(psclient.OutOfRange, w.set_rows, {"emb": [1000]})
    raises(KeyError, w.set_rows, {"nope": [1]})
    w.set_rows({})
    seen = np.zeros(1000, int)
    for lease in w.leases(1000):
        seen[lease.begin:lease.begin + lease.count] += 1
    check(np.all(seen == 1), "one epoch of leases: every example once")
    check(w.lease(1000) is None, "no more data")
    st = w.status()
    check([s["shard_index"] for s in st] == [0, 1] and all(s["job_id"] == "py-binding" for s in st),
          st)
    check(st[0]["lease_epochs"][0]["chunks_completed"] == 10, st[0]["lease_epochs"])
    check(any(x["role"] == "worker" for x in st[0]["workers"]), st[0]["workers"])
    st2 = psclient.status(c.servers + ",127.0.0.1:1", insecure=True, timeout_s=1)
    check(st2[2]["error"] == "DEADLINE_EXCEEDED" or "error" in st2[2], st2[2])
    w.heartbeat()
    # Silent past the 3 s heartbeat timeout: the background heartbeats keep
    # the worker registered.
    time.sleep(3.5)
    st = w.status()
    check(st[0]["workers_dropped"] == 0 and st[1]["workers_dropped"] == 0,
          "the heartbeat thread kept the worker")
    say("rows, leases, status, background heartbeats")


def check_leave_on_sigterm(c):
    """A worker that gets SIGTERM leaves the shards (they drop it at once,
    not after the heartbeat timeout) and exits 143."""
    code = ("import sys, time; sys.path.insert(0, %r); import psclient; "
            "w = psclient.connect(%r, insecure=True); print('up', flush=True); time.sleep(60)"
            % (os.path.dirname(psclient.__path__[0]), c.servers))
    live = c.status()[0]["live_workers"]
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    check(p.stdout.readline().strip() == b"up", "the worker started")
    check(c.status()[0]["live_workers"] == live + 1, "registered")
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    check(p.wait(timeout=10) == 143, f"exit {p.returncode}")
    check(c.status()[0]["live_workers"] == live, "it left")
    check(time.monotonic() - t < 2.5, "at once, not after the 3 s heartbeat timeout")
    say("SIGTERM: left the shards, exit 143")


def check_tls_and_tf_config(out):
    """Mutual TLS (deploy/certs.sh's certificates), and the servers and task
    from TF_CONFIG."""
    certs = os.path.join(out, "certs")
    r = subprocess.run(["bash", os.path.join(ROOT, "deploy", "certs.sh"), certs, "127.0.0.1",
                        "localhost"], capture_output=True, text=True)
    if r.returncode != 0:
        say(f"TLS not tried: deploy/certs.sh failed ({r.stderr.strip()[:100]})")
        return
    ca, cert, key = (os.path.join(certs, f) for f in ("ca.pem", "127.0.0.1.pem", "127.0.0.1.key"))
    wcert, wkey = os.path.join(certs, "localhost.pem"), os.path.join(certs, "localhost.key")
    with LocalCluster(flat_job("py-tls"), servers=2, tls=(ca, cert, key),
                      out=os.path.join(out, "tls")) as c:
        os.environ["TF_CONFIG"] = c.tf_config(1, 3)
        try:
            with psclient.connect(tls_ca=ca, tls_cert=wcert, tls_key=wkey) as w:
                check(w.task_index == 1 and w.num_workers == 3 and w.role == "worker",
                      (w.task_index, w.num_workers, w.role))
                p0 = w.pull().copy()
                w.push(np.ones(1000, np.float32))
                check(np.array_equal(w.pull(), p0 - 1), "a push over mutual TLS")
                st = w.status()
                check(len(st) == 2 and all("error" not in x for x in st), "Status over TLS")
                check(st[0]["workers"][0]["task_index"] == 1, st[0]["workers"])
        finally:
            del os.environ["TF_CONFIG"]
        # No client certificate: refused by the server.
        e = raises(psclient.PSError, psclient.connect, c.servers, tls_ca=ca, retry_s=2)
        say(f"TLS: mutual TLS and TF_CONFIG; without a client certificate: {e.message[:70]}...")


def check_modes():
    """sync: a pull after a push waits until the other worker's gradient is
    in; ssp:1: a worker 2 steps ahead waits for the slowest."""
    for mode in ("sync", "ssp:1"):
        keys = {"min_workers": 2} if mode == "sync" else {}
        with LocalCluster(flat_job("py-" + mode.replace(":", ""), mode=mode,
                                   wait_timeout_ms=20000, **keys), servers=2) as c:
            a = psclient.connect(c.servers, insecure=True)
            b = psclient.connect(c.servers, insecure=True)
            check(a.mode == mode.split(":")[0], a.mode)
            a.pull()
            b.pull()
            a.push()
            if mode.startswith("ssp"):
                a.pull()
                a.push()  # a at clock 2, b at 0
            got = []
            th = threading.Thread(target=lambda: got.append(a.pull()))
            th.start()
            th.join(0.8)
            check(th.is_alive(), f"{mode}: the pull waits")
            b.push()
            th.join(10)
            check(not th.is_alive() and got, f"{mode}: the pull came back after b's push")
            check(min(a.versions) >= 1, a.versions)
            a.close()
            b.close()
    say("modes: a sync pull waited for the step, an ssp pull for the slowest worker")


def main():
    with LocalCluster(BINDING_JOB, servers=2) as c:
        say(f"servers {c.servers}")
        with psclient.connect(c.servers, insecure=True, retry_s=10) as w:
            check_calls(c, w)
            check_errors(c, w)
            check_retries(c, w)
            check_rows_leases_status(c, w)
        raises(psclient.PSError, w.pull)  # closed
        check_leave_on_sigterm(c)
        check_tls_and_tf_config(c.out)
    check_modes()
    say("python.binding: every check passed")


if __name__ == "__main__":
    main()
