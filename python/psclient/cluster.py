"""A cluster on this machine for examples and tests: S ps-server processes on
loopback ports with a job token (as deploy/local-cluster.sh starts them),
and optionally W worker commands, each with a TF_CONFIG naming the servers
and its task index.

    python3 -m psclient.cluster --job deploy/jobs/fashion_mnist_cnn.json \\
        --servers 2 --workers 2 -- python3 python/examples/fashion_mnist_cnn.py

    with psclient.cluster.LocalCluster("job.json", servers=2) as c:
        w = psclient.connect(c.servers, insecure=True)

ps-server is looked for in --bin (or $PS_BIN), then the build directories of
the source checkout this file lies in, then the PATH.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from .worker import status

__all__ = ["LocalCluster", "find_program", "free_ports"]


def find_program(name: str, bin_dir: Optional[str] = None) -> str:
    """The path of ps-server (or another of the project's programs)."""
    dirs = [bin_dir or os.environ.get("PS_BIN")]
    root = Path(__file__).resolve().parent.parent.parent
    dirs += [str(root / b) for b in ("build-py", "build")]
    for d in dirs:
        if d and os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found in {[d for d in dirs if d]} nor the PATH: "
                                "build it (cmake --build build) or give --bin / $PS_BIN")
    return found


def free_ports(n: int) -> List[str]:
    """n free loopback addresses, chosen by the kernel."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    out = ["127.0.0.1:%d" % s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return out


class LocalCluster:
    """S ps-server processes for a job, with a token (PS_TOKEN_FILE is set to
    it in this process, for the workers), stopped by stop() or at the end of
    a `with` block. Logs in out/server-S.log. Plaintext, or with tls=(ca,
    cert, key) mutual TLS: each server presents cert and asks clients for a
    certificate signed by ca (the status calls here present cert)."""

    def __init__(self, job: Union[str, Dict[str, Any]], servers: int = 2, *,
                 bin_dir: Optional[str] = None, out: Optional[str] = None,
                 checkpoint_dir: Optional[str] = None, server_args: Sequence[str] = (),
                 tls: Optional[Sequence[str]] = None, wait_s: float = 30.0) -> None:
        self._own_out = out is None  # removed by a clean exit of a `with` block
        self.out = out or tempfile.mkdtemp(prefix="ps-pycluster.")
        os.makedirs(self.out, exist_ok=True)
        if isinstance(job, dict):
            path = os.path.join(self.out, "job.json")
            with open(path, "w") as f:
                json.dump(job, f, indent=1)
            job = path
        self.job = str(job)
        self.server_bin = find_program("ps-server", bin_dir)
        # The caller's token (PS_TOKEN_FILE), else one of this cluster's own.
        given = os.environ.get("PS_TOKEN_FILE")
        self.token_file = given if given and given not in _TOKENS_MADE else \
            os.path.join(self.out, "token")
        if not os.path.exists(self.token_file):
            _TOKENS_MADE.add(self.token_file)
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(base64.b64encode(os.urandom(32)).decode() + "\n")
        os.environ["PS_TOKEN_FILE"] = self.token_file
        self.addresses = free_ports(servers)
        self.servers = ",".join(self.addresses)
        self.checkpoint_dir = checkpoint_dir
        self.tls = tuple(tls) if tls else None
        self.procs: List[Optional[subprocess.Popen]] = []
        self._server_args = list(server_args)
        for s in range(servers):
            self.procs.append(self.start_server(s))
        self.wait_ready(wait_s)

    def start_server(self, s: int) -> subprocess.Popen:
        """Starts (or starts again) shard s's server."""
        if self.tls:
            sec = ["--tls-ca", self.tls[0], "--tls-cert", self.tls[1], "--tls-key", self.tls[2],
                   "--tls-require-client-cert"]
        else:
            sec = ["--insecure"]
        args = [self.server_bin, *sec, "--job", self.job, "--ps", self.servers,
                "--index", str(s), *self._server_args]
        if self.checkpoint_dir:
            args += ["--checkpoint-dir", self.checkpoint_dir]
        log = open(os.path.join(self.out, f"server-{s}.log"), "ab")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if s < len(self.procs):
            self.procs[s] = p
        return p

    def wait_ready(self, wait_s: float = 30.0) -> None:
        """Until every server answers Status (or raises RuntimeError)."""
        deadline = time.monotonic() + wait_s
        while True:
            for s, p in enumerate(self.procs):
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"ps-server {s} exited {p.returncode}: "
                                       f"{self.log_tail(s)}")
            st = self.status(timeout_s=1.0)
            if all("error" not in x for x in st):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the servers did not answer within {wait_s} s: {st}")
            time.sleep(0.1)

    def log_tail(self, s: int, lines: int = 10) -> str:
        try:
            with open(os.path.join(self.out, f"server-{s}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def status(self, timeout_s: float = 5.0) -> List[Dict[str, Any]]:
        """Every server's Status (see psclient.status)."""
        if self.tls:
            return status(self.servers, tls_ca=self.tls[0], tls_cert=self.tls[1],
                          tls_key=self.tls[2], timeout_s=timeout_s)
        return status(self.servers, insecure=True, timeout_s=timeout_s)

    def tf_config(self, index: int, workers: int, task_type: str = "worker") -> str:
        """A TF_CONFIG for worker index of workers (their addresses unused)."""
        return json.dumps({"cluster": {"ps": self.addresses,
                                       "worker": [f"localhost:{i + 1}" for i in range(workers)]},
                           "task": {"type": task_type, "index": index}})

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s, to every server."""
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.stop()
        if exc_type is None and self._own_out and not os.environ.get("PS_KEEP_LOGS"):
            shutil.rmtree(self.out, ignore_errors=True)
        elif exc_type is not None:
            print(f"psclient.cluster: the servers' logs are in {self.out}", file=sys.stderr)


#: Token files LocalCluster made (PS_TOKEN_FILE names one of them after it):
#: each cluster makes its own rather than reuse another's.
_TOKENS_MADE: set = set()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m psclient.cluster",
        description="S ps-server processes on loopback and W copies of a worker command (each "
                    "with TF_CONFIG and PS_TOKEN_FILE); exits with the first failure's status")
    p.add_argument("--job", required=True)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--bin", help="the directory of ps-server")
    p.add_argument("--out", help="logs: OUT/server-S.log, OUT/worker-W.log (worker 0 on the "
                   "terminal too)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the worker command")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the worker command after --")
    with LocalCluster(a.job, a.servers, bin_dir=a.bin, out=a.out) as c:
        print(f"psclient.cluster: {a.servers} servers on {c.servers}; {a.workers} workers; "
              f"logs in {c.out}", flush=True)
        procs = []
        for k in range(a.workers):
            env = dict(os.environ, TF_CONFIG=c.tf_config(k, a.workers))
            out = None if k == 0 else open(os.path.join(c.out, f"worker-{k}.log"), "wb")
            procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                          stderr=subprocess.STDOUT if out else None))
        deadline, rc = time.monotonic() + a.timeout, 0
        for k, pr in enumerate(procs):
            try:
                code = pr.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                print(f"psclient.cluster: the time limit ({a.timeout} s) passed", file=sys.stderr)
                for q in procs:
                    q.kill()
                return 124
            if code and not rc:
                print(f"psclient.cluster: worker {k} exited {code}", file=sys.stderr)
                rc = code
        return rc


if __name__ == "__main__":
    sys.exit(main())
