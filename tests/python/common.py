"""What the Python workers' tests share: the jobs, a cluster per test, checks
that say what failed, and the time each part took."""
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))

import psclient  # noqa: E402
from psclient.cluster import LocalCluster, find_program  # noqa: E402

T0 = time.monotonic()


def say(msg):
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def raises(exc, fn, *args, **kw):
    """fn(*args, **kw) raises exc: returns the exception."""
    try:
        fn(*args, **kw)
    except exc as e:
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc.__name__}")


#: A flat job of two named tensors, SGD with lr 1 (a push of g takes exactly
#: g off), an embedding table and leases of 100 examples: the binding's and
#: the C API's checks.
BINDING_JOB = {
    "job_id": "py-binding",
    "model": {"params": 1000, "tensors": [
        {"name": "a", "shape": [10, 50], "init": {"uniform": 0.1}},
        {"name": "b", "shape": [500], "init": {"constant": 0.25}}]},
    "optimizer": {"name": "sgd", "lr": 1.0},
    "embeddings": [{"name": "emb", "rows": 1000, "dim": 4}],
    "lease_chunk": 100, "epochs": 1, "batch_size": 10, "heartbeat_timeout_ms": 3000,
}


def flat_job(job_id, **keys):
    job = dict(BINDING_JOB, job_id=job_id)
    job.update(keys)
    return job
