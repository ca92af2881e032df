"""psclient: Python workers for the ps parameter servers.

A thin binding (ctypes) over the C client that ps-worker uses
(libpsclient.so, worker/client/ps_capi.h): the same registration, wire
format, request ids, retries and fail-over, with NumPy arrays (or CPU torch
tensors) as the buffers, written and read in place.

    import psclient
    w = psclient.connect("127.0.0.1:5000", insecure=True)   # or TF_CONFIG
    params = w.pull()                 # the flat float32 vector, P values
    w.grads[:] = my_gradient(params)  # fill the gradient buffer
    w.push(batch_size=64)

PyTorch modules: :mod:`psclient.torch`. The guide: docs/python.md.
"""
from __future__ import annotations

from typing import Optional

from .errors import (InvalidArgument, IOFailure, NoMemory, NotFound, OutOfRange, ProtocolError,
                     PSError, StateError, Timeout, Unavailable)
from .worker import MODES, Lease, PushResult, Rows, Servers, Tensor, Worker, status

__version__ = "0.1.0"

__all__ = ["connect", "status", "Worker", "Tensor", "Lease", "Rows", "PushResult", "MODES",
           "PSError", "InvalidArgument", "NoMemory", "IOFailure", "OutOfRange", "NotFound",
           "ProtocolError", "StateError", "Timeout", "Unavailable", "__version__"]


def connect(servers: Servers = None, *, token_file: Optional[str] = None,
            tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
            tls_key: Optional[str] = None, insecure: bool = False, role: Optional[str] = None,
            task_index: int = -1, host: Optional[str] = None, timeout_ms: int = 30000,
            retry_s: float = 60.0, heartbeat: bool = True, handle_signals: bool = True,
            log_level: Optional[str] = None) -> Worker:
    """Registers a worker with the cluster and returns it (see :class:`Worker`).

    Args:
        servers: ps-worker's ``--ps``: ``"host:port[,host:port...]"`` or a list
            (the first is contacted; shard 0 hands out the job and the other
            shards; the whole list is asked for :meth:`Worker.status`), or None
            for ``TF_CONFIG``'s ps addresses (its task type becomes the role,
            its index the task index).
        token_file: the job's token (default ``$PS_TOKEN_FILE``), as the
            servers were given it.
        tls_ca, tls_cert, tls_key: TLS (and mutual TLS) as ``--tls-ca``,
            ``--tls-cert``, ``--tls-key``.
        insecure: plaintext to servers that serve plaintext (``--insecure``).
        role: ``"worker"``, ``"chief"`` or ``"evaluator"`` (default:
            TF_CONFIG's, else worker).
        task_index: for the servers' logs and Status (-1: unknown).
        host: the name the servers show (default: the host name).
        timeout_ms: each call's deadline (``--timeout-ms``).
        retry_s: how long unreachable servers are retried, at registration
            and by every call (``--retry-s``); then :class:`Unavailable`.
        heartbeat: heartbeat from a background thread (naming the leases
            held), every third of the job's ``heartbeat_timeout_ms``.
        handle_signals: turn SIGTERM (when it has its default action) into
            SystemExit, so that the worker leaves the shards as on Ctrl-C;
            the worker also leaves at interpreter exit.
        log_level: the C client's messages on stderr: ``"debug"``,
            ``"info"`` (default), ``"warn"`` or ``"error"``.

    Raises:
        Unavailable: no server answered within retry_s.
        ProtocolError: a server refused the registration (a wrong token...).
        InvalidArgument, IOFailure: the arguments or the files they name.
    """
    return Worker(servers, token_file=token_file, tls_ca=tls_ca, tls_cert=tls_cert,
                  tls_key=tls_key, insecure=insecure, role=role, task_index=task_index,
                  host=host, timeout_ms=timeout_ms, retry_s=retry_s, heartbeat=heartbeat,
                  handle_signals=handle_signals, log_level=log_level)
