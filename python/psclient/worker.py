"""A worker's connection to the parameter servers, over libpsclient.so.

One :class:`Worker` is one registered worker, as one ps-worker process is:
it pulls the flat float32 parameter vector (or the named ranges of it)
into NumPy arrays, pushes gradients from NumPy arrays, leases data chunks,
pulls and pushes embedding rows, and heartbeats in the background. Every
byte goes through the C client (``worker/client/ps_client.c``): the job's
wire encoding, the shards in parallel, request ids, fail-over between
replicas, and pushes that a retry never applies twice.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import signal
import threading
import time
import weakref
from ctypes import byref, c_int, c_int64, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from typing import (Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import numpy as np

from . import _lib
from .errors import PSError, error_for

__all__ = ["Worker", "Tensor", "Lease", "Rows", "PushResult", "status", "MODES"]

log = logging.getLogger("psclient")

#: ps_capi_mode's values.
MODES = ("async", "ssp", "sync")

_EUNAVAIL, _ETIMEDOUT = -9, -8
_LIB: Any = None  # the library, once a Worker loaded it (the hot path skips the lookup)

Servers = Union[str, Sequence[str], None]


def _servers_arg(servers: Servers) -> Optional[bytes]:
    if servers is None:
        return None
    if not isinstance(servers, str):
        servers = ",".join(servers)
    return servers.encode()


def _opt(s: Optional[Union[str, os.PathLike]]) -> Optional[bytes]:
    return None if s is None else os.fsencode(s)


def _last_error(code: int) -> PSError:
    msg = _lib.lib().ps_capi_last_error().decode("utf-8", "replace")
    return error_for(code, msg or _lib.lib().ps_capi_strerror(code).decode())


def _address(buf: Any, count: int, writable: bool, what: str) -> Tuple[int, Any]:
    """The address of count contiguous float32 values in buf (a NumPy array,
    any object with the buffer protocol, or a CPU torch tensor) and the
    object that keeps them alive. No copy is made: a buffer that does not fit
    is refused (ValueError)."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):  # a torch tensor
        if str(buf.dtype) != "torch.float32" or buf.device.type != "cpu" or \
                not buf.is_contiguous() or buf.numel() != count:
            raise ValueError(f"{what}: a contiguous CPU float32 tensor of {count} values is needed "
                             f"(got {buf.dtype}, {buf.device}, {tuple(buf.shape)})")
        return buf.data_ptr(), buf
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        mv = memoryview(buf)
        if mv.format not in ("f", "<f", "=f") or not mv.c_contiguous:
            raise ValueError(f"{what}: a C-contiguous buffer of float32 ('f') is needed, "
                             f"got format {mv.format!r}")
        arr = np.frombuffer(mv, dtype=np.float32)
    if arr.dtype != np.float32 or not arr.flags.c_contiguous or arr.size != count:
        raise ValueError(f"{what}: a C-contiguous float32 array of {count} values is needed "
                         f"(got {arr.dtype}, shape {arr.shape}, "
                         f"{'contiguous' if arr.flags.c_contiguous else 'not contiguous'})")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: the array is read-only")
    return arr.ctypes.data, buf


@dataclass(frozen=True)
class Tensor:
    """A named range of the flat vector: ``[offset, offset + count)`` with its
    shape (a layered job's layer tensors, named as ps-export names its .npy
    files, or a flat job's ``tensors``)."""
    name: str
    offset: int
    count: int
    shape: Tuple[int, ...]

    def of(self, flat: np.ndarray) -> np.ndarray:
        """Its view (no copy) in a flat vector of the model's size."""
        return flat[self.offset:self.offset + self.count].reshape(self.shape)


class PushResult(NamedTuple):
    """What the shards answered a push: staleness summed and the largest over
    the shards (versions applied since the pull), and how many shards
    dropped the gradient (sync: it came late)."""
    staleness_sum: int
    staleness_max: int
    dropped: int


@dataclass
class Lease:
    """A chunk of the data set leased from shard 0: examples
    ``[begin, begin + count)`` of epoch ``epoch``. Report it done (every example
    in a pushed gradient) with :meth:`Worker.complete`, or let
    :meth:`Worker.leases` do it."""
    id: int
    epoch: int
    begin: int
    count: int

    def indices(self) -> range:
        return range(self.begin, self.begin + self.count)


@dataclass
class Rows:
    """The embedding rows of one table that the next pulls and pushes carry:
    ``ids`` (distinct, uint64), ``values`` (n, dim) written by each pull,
    ``grads`` (n, dim) read by each push; ``inverse`` maps the ids as given to
    their rows (``values[inverse]``: one row per id given)."""
    table: str
    ids: np.ndarray
    values: np.ndarray
    grads: np.ndarray
    inverse: np.ndarray


def _retry_delay(backoff: float, left: float) -> float:
    return min(backoff / 2 + random.uniform(0, backoff / 2), max(left, 0.0) + 0.001)


class Worker:
    """One worker registered with the cluster (see :func:`psclient.connect`).

    Attributes:
        job: the job as shard 0 handed it (the job file's JSON, parsed).
        param_count: P, the length of the flat vector.
        num_shards, worker_id, rank: the cluster's, as registration said.
        start_version: the version the shards' run began at (0, or a restored
            checkpoint's). A sync job of N steps is done when every shard's
            version reaches ``start_version + N``: a worker behind the
            others (its late gradients dropped under backup workers) stops
            there, as ps-worker does, rather than making the steps it missed
            alone.
        mode: ``"async"``, ``"ssp"`` or ``"sync"`` (the job's consistency mode).
        params: the worker's parameter vector (P float32), which :meth:`pull`
            fills unless given another buffer.
        grads: the worker's gradient vector (P float32), which :meth:`push`
            sends unless given another.
        tensors: the named ranges, by name, in layout order.
        tables: the job's embedding tables: name -> (rows, dim).
    """

    def __init__(self, servers: Servers = None, *, token_file: Optional[str] = None,
                 tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, insecure: bool = False,
                 role: Optional[str] = None, task_index: int = -1, host: Optional[str] = None,
                 timeout_ms: int = 30000, retry_s: float = 60.0, heartbeat: bool = True,
                 handle_signals: bool = True, log_level: Optional[str] = None) -> None:
        global _LIB
        lib = _LIB = _lib.lib()
        if log_level is not None:
            levels = {"debug": 0, "info": 1, "warn": 2, "error": 3}
            if log_level not in levels:
                raise ValueError(f"log_level must be one of {sorted(levels)}")
            lib.ps_capi_set_log_level(levels[log_level])
        self.retry_s = float(retry_s)
        self._sec = (_opt(token_file), _opt(tls_ca), _opt(tls_cert), _opt(tls_key),
                     1 if insecure else 0)
        self._servers = servers
        self._handle: Optional[int] = None
        self._pushed: Any = None  # the last gradient pushed: the client may send it again
        self._rows: Dict[str, Rows] = {}
        connect_ms = int(retry_s * 1000) if retry_s > 0 else timeout_ms
        h = c_void_p()
        rc = lib.ps_capi_connect(_servers_arg(servers), *self._sec[:4], self._sec[4],
                                 _opt(host), _opt(role), int(task_index), int(timeout_ms),
                                 max(connect_ms, 1), 1 if heartbeat else 0, byref(h))
        if rc != 0:
            raise _last_error(rc)
        self._handle = h.value
        # Closed (leaving the shards) by close(), when garbage-collected, or
        # at interpreter exit, whichever comes first.
        self._box = {"handle": h.value, "leave": True}
        self._finalizer = weakref.finalize(self, _close_box, self._box)
        self.job_json: str = lib.ps_capi_job_json(self._handle).decode()
        self.job: Dict[str, Any] = json.loads(self.job_json)
        self.param_count: int = int(lib.ps_capi_param_count(self._handle))
        self.num_shards: int = lib.ps_capi_num_shards(self._handle)
        self.worker_id: int = int(lib.ps_capi_worker_id(self._handle))
        self.rank: int = lib.ps_capi_rank(self._handle)
        self.start_version: int = int(lib.ps_capi_start_version(self._handle))
        self.mode: str = MODES[lib.ps_capi_mode(self._handle)]
        tf = _tf_config() if servers is None else {}
        task, cluster = tf.get("task", {}), tf.get("cluster", {})
        #: The role and task index given, else TF_CONFIG's; num_workers:
        #: TF_CONFIG's worker and chief entries (None without TF_CONFIG).
        self.role: str = role or task.get("type") or "worker"
        self.task_index: int = task_index if task_index >= 0 else \
            (0 if self.role == "chief" else task.get("index", -1) + len(cluster.get("chief", [])))
        self.num_workers: Optional[int] = \
            (len(cluster.get("worker", [])) + len(cluster.get("chief", []))) or None
        buf = ctypes.create_string_buffer(512)
        lib.ps_capi_describe(self._handle, buf, len(buf))
        self.description: str = buf.value.decode()
        self.tensors: Dict[str, Tensor] = self._read_tensors()
        self.tables: Dict[str, Tuple[int, int]] = self._read_tables()
        self.params: np.ndarray = np.zeros(self.param_count, dtype=np.float32)
        self.grads: np.ndarray = np.zeros(self.param_count, dtype=np.float32)
        self._versions = (c_uint64 * self.num_shards)()
        # The hot path's constants: the buffers' addresses, the outputs.
        self._params_addr = self.params.ctypes.data
        self._grads_addr = self.grads.ctypes.data
        self._out = (c_uint64(), c_uint64(), c_int())
        self._out_refs = tuple(byref(x) for x in self._out)
        self._batch_size = int(self.job.get("batch_size", 64))
        if handle_signals:
            _handle_sigterm()

    # ---- what the job says ----

    def _read_tensors(self) -> Dict[str, Tensor]:
        lib, out = _lib.lib(), {}
        name = ctypes.create_string_buffer(64)
        off, cnt, nd = c_uint64(), c_uint64(), c_int()
        shape = (c_int64 * _lib.MAX_DIMS)()
        for i in range(lib.ps_capi_num_tensors(self._handle)):
            if lib.ps_capi_tensor(self._handle, i, name, len(name), byref(off), byref(cnt),
                                  byref(nd), shape) != 0:
                raise _last_error(-4)
            t = Tensor(name.value.decode(), off.value, cnt.value, tuple(shape[:nd.value]))
            out[t.name] = t
        return out

    def _read_tables(self) -> Dict[str, Tuple[int, int]]:
        lib, out = _lib.lib(), {}
        name = ctypes.create_string_buffer(64)
        rows, dim = c_uint64(), c_int()
        for t in range(lib.ps_capi_num_tables(self._handle)):
            if lib.ps_capi_table(self._handle, t, name, len(name), byref(rows), byref(dim)) != 0:
                raise _last_error(-4)
            out[name.value.decode()] = (rows.value, dim.value)
        return out

    def shard_range(self, s: int) -> Tuple[int, int]:
        """Shard s's range of the flat vector as (offset, count)."""
        off, cnt = c_uint64(), c_uint64()
        rc = _lib.lib().ps_capi_shard_range(self._h(), s, byref(off), byref(cnt))
        if rc != 0:
            raise _last_error(rc)
        return off.value, cnt.value

    @property
    def versions(self) -> Tuple[int, ...]:
        """Each shard's version at the last pull."""
        _lib.lib().ps_capi_versions(self._h(), self._versions, self.num_shards)
        return tuple(self._versions)

    @property
    def step(self) -> int:
        """Rounds pushed so far."""
        return int(_lib.lib().ps_capi_step(self._h()))

    def _h(self) -> int:
        if self._handle is None:
            raise PSError("the worker is closed")
        return self._handle

    # ---- retries (as ps-worker's --retry-s) ----

    def _retry(self, what: str, first: Callable[[], int],
               again: Optional[Callable[[], int]] = None, rc: Optional[int] = None) -> None:
        """Runs first() (unless rc is what it returned already), then again()
        (or first()) while it fails with Unavailable or Timeout, with
        exponential back-off and jitter (0.1 s doubling to 5 s) for at most
        retry_s seconds; raises the error then, or at once for any other."""
        start = time.monotonic()
        backoff, op = 0.1, first
        while True:
            rc = op() if rc is None else rc
            if rc == 0:
                return
            err = _last_error(rc)
            left = start + self.retry_s - time.monotonic()
            if rc not in (_EUNAVAIL, _ETIMEDOUT) or left <= 0:
                raise err
            delay = _retry_delay(backoff, left)
            log.warning("%s failed (%s); retrying in %.0f ms", what, err, delay * 1000)
            time.sleep(delay)
            backoff = min(backoff * 2, 5.0)
            op, rc = again or first, None

    # ---- pull and push ----

    def pull(self, out: Any = None, *, wait: bool = True) -> Any:
        """Pulls every shard's range into out (default: :attr:`params`) and
        returns it. out: any C-contiguous float32 buffer of P values (NumPy
        array, buffer-protocol object, CPU torch tensor), written in place
        straight from the received bytes. Under sync, wait makes the pull
        wait until the shards applied the step of this worker's last push
        (the shards hold ssp pulls by themselves). Retried as :attr:`retry_s`
        says."""
        if out is None:
            buf, addr = self.params, self._params_addr
        else:
            buf = out
            addr, _keep = _address(buf, self.param_count, True, "pull")
        lib, h, P, wt = _LIB, self._h(), self.param_count, 1 if wait else 0
        rc = lib.ps_capi_pull(h, addr, P, wt)
        if rc != 0:
            self._retry("Pull", lambda: lib.ps_capi_pull(h, addr, P, wt), rc=rc)
        return buf

    def push(self, grads: Any = None, *, batch_size: Optional[int] = None) -> PushResult:
        """Pushes grads (default: :attr:`grads`) to every shard, with the
        versions of the last pull. The buffer is sent without a copy, and may
        be sent again until the next push (a retry, or a sync pull that finds
        a shard lacking it): do not change it before the next push. A retry
        after an error pushes only the shards that did not apply it, under the
        same request id: no shard applies a gradient twice."""
        if grads is None:
            addr, self._pushed = self._grads_addr, self.grads
        else:
            addr, self._pushed = _address(grads, self.param_count, False, "push")
        lib, h, P = _LIB, self._h(), self.param_count
        bs = self._batch_size if batch_size is None else int(batch_size)
        ssum, smax, dropped = self._out_refs
        rc = lib.ps_capi_push(h, addr, P, bs, ssum, smax, dropped)
        if rc != 0:
            self._retry("Push", lambda: lib.ps_capi_push(h, addr, P, bs, ssum, smax, dropped),
                        lambda: lib.ps_capi_push_retry(h, addr, P, ssum, smax, dropped), rc=rc)
        out = self._out
        return PushResult(out[0].value, out[1].value, out[2].value)

    def push_pending(self) -> int:
        """Shards of the last push round that have not applied it (after an
        error); :meth:`push_retry` sends it to them."""
        return _lib.lib().ps_capi_push_pending(self._h())

    def push_retry(self) -> PushResult:
        """Sends the last round (same request id, same bytes) to the shards
        that did not apply it."""
        if self._pushed is None:
            raise PSError("nothing was pushed yet")
        addr, _ = _address(self._pushed, self.param_count, False, "push")
        lib, h, P = _lib.lib(), self._h(), self.param_count
        ssum, smax, dropped = c_uint64(), c_uint64(), c_int()
        self._retry("Push", lambda: lib.ps_capi_push_retry(h, addr, P, byref(ssum), byref(smax),
                                                           byref(dropped)))
        return PushResult(ssum.value, smax.value, dropped.value)

    def view(self, name: str, flat: Optional[np.ndarray] = None) -> np.ndarray:
        """The named range's view (no copy) in flat (default :attr:`params`)."""
        return self.tensors[name].of(self.params if flat is None else flat)

    def pull_tensors(self, names: Optional[Sequence[str]] = None, *,
                     wait: bool = True) -> Dict[str, np.ndarray]:
        """Pulls, and returns the named ranges (default: all) as views of
        :attr:`params` in their shapes: no copy. (The shards send their whole
        ranges: a pull is of the whole vector.)"""
        self.pull(wait=wait)
        return {n: self.view(n) for n in (names or self.tensors)}

    def push_tensors(self, grads: Mapping[str, Any], *,
                     batch_size: Optional[int] = None) -> PushResult:
        """Pushes the named ranges' gradients: each goes into its range of
        :attr:`grads` (a copy, unless it is that view already), the ranges not
        named are zero. Note that a zero gradient still moves parameters under
        momentum or Adam: name every range that was trained."""
        named = set(grads)
        for name, t in self.tensors.items():
            dst = t.of(self.grads)
            if name not in named:
                dst.fill(0)
                continue
            src = np.asarray(grads[name], dtype=np.float32)
            if src.ctypes.data != dst.ctypes.data:
                dst[...] = src.reshape(t.shape)
        unknown = named - set(self.tensors)
        if unknown:
            raise KeyError(f"not tensors of the job: {sorted(unknown)}")
        return self.push(batch_size=batch_size)

    # ---- data leases ----

    def lease(self, dataset_size: int, *, complete: Optional[Lease] = None,
              poll_s: float = 1.0) -> Optional[Lease]:
        """The next chunk of the data set from shard 0 (reporting complete
        done first, when given), or None when the job's epochs are done. While
        every chunk left is leased to other workers it waits, telling the
        shards this worker is idle (sync steps and ssp clocks do not wait for
        it)."""
        lib, h = _lib.lib(), self._h()
        st, lid, ep, beg, cnt, counted = (c_int(), c_uint64(), c_int(), c_uint64(), c_uint32(),
                                          c_int())
        done_id = complete.id if complete is not None else 0
        wait, idle = 0.05, False
        try:
            while True:
                self._retry("Lease", lambda: lib.ps_capi_lease(
                    h, done_id, 1, int(dataset_size), byref(st), byref(lid), byref(ep),
                    byref(beg), byref(cnt), byref(counted)))
                done_id = 0  # reported
                if st.value == 0:
                    return Lease(lid.value, ep.value, beg.value, cnt.value)
                if st.value == 2:
                    return None
                if not idle:
                    lib.ps_capi_set_idle(h, 1)
                    idle = True
                time.sleep(wait)
                wait = min(wait * 2, poll_s)
        finally:
            if idle:
                lib.ps_capi_set_idle(h, 0)

    def complete(self, lease: Lease) -> bool:
        """Reports lease done (every example of it went into a pushed
        gradient); whether shard 0 counted it."""
        lib, h = _lib.lib(), self._h()
        st, lid, ep, beg, cnt, counted = (c_int(), c_uint64(), c_int(), c_uint64(), c_uint32(),
                                          c_int())
        self._retry("Lease", lambda: lib.ps_capi_lease(h, lease.id, 0, 0, byref(st), byref(lid),
                                                       byref(ep), byref(beg), byref(cnt),
                                                       byref(counted)))
        return bool(counted.value)

    def leases(self, dataset_size: int) -> Iterator[Lease]:
        """The chunks of every epoch, one after another: each is reported
        done when the next is asked for (after the loop's body trained it),
        the last when the data is done."""
        held: Optional[Lease] = None
        while True:
            nxt = self.lease(dataset_size, complete=held)
            if nxt is None:
                return
            held = nxt
            yield nxt

    # ---- embedding rows ----

    def set_rows(self, rows: Mapping[Union[str, int], Any]) -> Dict[str, Rows]:
        """The embedding rows the next pulls and pushes carry: for each table
        (by name or index) the batch's ids (any integers; repeated ones are
        pulled and pushed once). Returns, by table, the :class:`Rows` whose
        ``values`` each pull fills and whose ``grads`` each push sends (with
        the dense gradient, as one update). An empty mapping: no rows."""
        names = list(self.tables)
        secs = []
        for key, ids in rows.items():
            name = names[key] if isinstance(key, int) else key
            if name not in self.tables:
                raise KeyError(f"no embedding table {key!r} (the job's: {names})")
            dim = self.tables[name][1]
            uniq, inverse = np.unique(np.asarray(ids).astype(np.uint64, copy=False).ravel(),
                                      return_inverse=True)
            uniq = np.ascontiguousarray(uniq, dtype=np.uint64)
            r = Rows(name, uniq, np.zeros((uniq.size, dim), np.float32),
                     np.zeros((uniq.size, dim), np.float32), inverse)
            secs.append((names.index(name), r))
        n = len(secs)
        tables = (c_int * max(n, 1))(*[t for t, _ in secs])
        idp = (c_void_p * max(n, 1))(*[r.ids.ctypes.data for _, r in secs])
        cnt = (c_uint64 * max(n, 1))(*[r.ids.size for _, r in secs])
        vals = (c_void_p * max(n, 1))(*[r.values.ctypes.data for _, r in secs])
        grds = (c_void_p * max(n, 1))(*[r.grads.ctypes.data for _, r in secs])
        rc = _lib.lib().ps_capi_set_rows(self._h(), n, tables, idp, cnt, vals, grds)
        if rc != 0:
            raise _last_error(rc)
        self._rows = {r.table: r for _, r in secs}  # alive while the client may use them
        return dict(self._rows)

    # ---- heartbeats, status, leaving ----

    def heartbeat(self) -> None:
        """One heartbeat to every shard now (a background thread sends them
        anyway unless connect was told heartbeat=False)."""
        rc = _lib.lib().ps_capi_heartbeat(self._h())
        if rc != 0:
            raise _last_error(rc)

    def status(self, timeout_s: float = 5.0) -> List[Dict[str, Any]]:
        """Every server's Status (the servers this worker was given), one dict
        per address with the StatusResponse's fields (ps.proto's names), or
        ``{"address", "error", "message"}`` for one that did not answer."""
        out = c_void_p()
        rc = _lib.lib().ps_capi_worker_status(self._h(), int(timeout_s * 1000), byref(out))
        if rc != 0:
            raise _last_error(rc)
        return _take_json(out)

    def close(self, leave: bool = True) -> None:
        """Stops the heartbeats, leaves every shard (unless leave is False:
        the shards then drop this worker after the job's heartbeat timeout
        and hand its leases out again) and frees the client. Idempotent."""
        if self._handle is None:
            return
        self._handle = None
        self._box["leave"] = leave
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"worker {self.worker_id:016x} rank {self.rank}"
        return (f"<psclient.Worker {state}: job {self.job.get('job_id')!r}, "
                f"{self.description}, {self.num_shards} shard(s), {self.mode}>")


def _take_json(ptr: c_void_p) -> Any:
    try:
        return json.loads(ctypes.string_at(ptr.value).decode("utf-8", "replace"))
    finally:
        _lib.lib().ps_capi_free(ptr)


def status(servers: Servers, *, token_file: Optional[str] = None, tls_ca: Optional[str] = None,
           tls_cert: Optional[str] = None, tls_key: Optional[str] = None, insecure: bool = False,
           timeout_s: float = 5.0) -> List[Dict[str, Any]]:
    """Status of each server of the list (as ``ps-server --status``), without
    registering: one dict per address (see :meth:`Worker.status`)."""
    out = c_void_p()
    rc = _lib.lib().ps_capi_status(_servers_arg(servers) or b"", _opt(token_file), _opt(tls_ca),
                                   _opt(tls_cert), _opt(tls_key), 1 if insecure else 0,
                                   int(timeout_s * 1000), byref(out))
    if rc != 0:
        raise _last_error(rc)
    return _take_json(out)


# ---- leaving on exit and on SIGTERM ----


def _close_box(box: Dict[str, Any]) -> None:
    """Closes a worker's handle once (its finalizer: close(), garbage
    collection or interpreter exit): the heartbeat thread stops, the worker
    leaves the shards."""
    h, box["handle"] = box["handle"], None
    if h is not None:
        _lib.lib().ps_capi_close(h, 1 if box["leave"] else 0)


def _tf_config() -> Dict[str, Any]:
    try:
        return json.loads(os.environ.get("TF_CONFIG") or "{}")
    except ValueError:
        return {}  # the C client says what is wrong with it


def _on_sigterm(signum: int, frame: Any) -> None:
    # As SIGINT's KeyboardInterrupt: the training loop unwinds, `with` blocks
    # and the finalizers close the workers (they leave the shards), exit 143.
    raise SystemExit(128 + signum)


def _handle_sigterm() -> None:
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)
