"""Loading libpsclient.so (worker/client/ps_capi.h) and declaring its functions.

The library is looked for, in order: $PS_CLIENT_LIB (a path), next to this
file (where ``pip install ./python`` puts it), and in the build directories
of a source checkout (``build-py``, ``build``) two levels up.
"""
from __future__ import annotations

import ctypes
import os
from ctypes import (POINTER, c_char, c_char_p, c_int, c_int64, c_size_t, c_uint32, c_uint64,
                    c_void_p)
from pathlib import Path
from typing import Optional

#: The C API's version this binding speaks (PS_CAPI_VERSION).
CAPI_VERSION = 1
#: Most dimensions a tensor's shape has (PS_CAPI_MAX_DIMS).
MAX_DIMS = 6

_LIB: Optional[ctypes.CDLL] = None


def _candidates() -> list:
    env = os.environ.get("PS_CLIENT_LIB")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    found = [here / "libpsclient.so"]
    root = here.parent.parent
    for build in ("build-py", "build"):
        found.append(root / build / "libpsclient.so")
    return found


def _declare(lib: ctypes.CDLL) -> None:
    W = c_void_p  # ps_capi_worker *
    P_u64, P_int, P_i64 = POINTER(c_uint64), POINTER(c_int), POINTER(c_int64)
    P_float = c_void_p  # buffers are passed as addresses (the buffer protocol's)
    sigs = {
        "ps_capi_version": (c_int, []),
        "ps_capi_last_error": (c_char_p, []),
        "ps_capi_strerror": (c_char_p, [c_int]),
        "ps_capi_set_log_level": (None, [c_int]),
        "ps_capi_connect": (c_int, [c_char_p, c_char_p, c_char_p, c_char_p, c_char_p, c_int,
                                    c_char_p, c_char_p, c_int, c_int, c_int, c_int,
                                    POINTER(c_void_p)]),
        "ps_capi_close": (None, [W, c_int]),
        "ps_capi_job_json": (c_char_p, [W]),
        "ps_capi_param_count": (c_uint64, [W]),
        "ps_capi_num_shards": (c_int, [W]),
        "ps_capi_worker_id": (c_uint64, [W]),
        "ps_capi_rank": (c_int, [W]),
        "ps_capi_start_version": (c_uint64, [W]),
        "ps_capi_mode": (c_int, [W]),
        "ps_capi_describe": (None, [W, POINTER(c_char), c_size_t]),
        "ps_capi_shard_range": (c_int, [W, c_int, P_u64, P_u64]),
        "ps_capi_num_tensors": (c_int, [W]),
        "ps_capi_tensor": (c_int, [W, c_int, POINTER(c_char), c_size_t, P_u64, P_u64, P_int,
                                   P_i64]),
        "ps_capi_pull": (c_int, [W, P_float, c_uint64, c_int]),
        "ps_capi_versions": (c_int, [W, P_u64, c_int]),
        "ps_capi_push": (c_int, [W, P_float, c_uint64, c_int, P_u64, P_u64, P_int]),
        "ps_capi_push_retry": (c_int, [W, P_float, c_uint64, P_u64, P_u64, P_int]),
        "ps_capi_push_pending": (c_int, [W]),
        "ps_capi_step": (c_uint64, [W]),
        "ps_capi_num_tables": (c_int, [W]),
        "ps_capi_table": (c_int, [W, c_int, POINTER(c_char), c_size_t, P_u64, P_int]),
        "ps_capi_set_rows": (c_int, [W, c_int, P_int, POINTER(c_void_p), P_u64,
                                     POINTER(c_void_p), POINTER(c_void_p)]),
        "ps_capi_lease": (c_int, [W, c_uint64, c_int, c_uint64, P_int, P_u64, P_int, P_u64,
                                  POINTER(c_uint32), P_int]),
        "ps_capi_set_idle": (None, [W, c_int]),
        "ps_capi_heartbeat": (c_int, [W]),
        "ps_capi_worker_status": (c_int, [W, c_int, POINTER(c_void_p)]),
        "ps_capi_status": (c_int, [c_char_p, c_char_p, c_char_p, c_char_p, c_char_p, c_int, c_int,
                                   POINTER(c_void_p)]),
        "ps_capi_free": (None, [c_void_p]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def lib() -> ctypes.CDLL:
    """The loaded library (loaded at the first call)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    tried = []
    for path in _candidates():
        if not path.is_file():
            tried.append(f"{path} (absent)")
            continue
        try:
            handle = ctypes.CDLL(str(path))
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        _declare(handle)
        got = handle.ps_capi_version()
        if got != CAPI_VERSION:
            raise ImportError(f"{path}: C API version {got}, this binding speaks {CAPI_VERSION}: "
                              "rebuild the package (pip install ./python)")
        _LIB = handle
        return handle
    raise ImportError("psclient: libpsclient.so not found; tried: " + "; ".join(tried) +
                      ". Install the package (pip install ./python) or set PS_CLIENT_LIB")
