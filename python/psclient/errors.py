"""The exceptions of psclient: one class per error code of the C client
(common/util.h's PS_E*), each carrying the message, in which a server's
refusal is quoted after its gRPC status name."""
from __future__ import annotations

import re
from typing import Dict, Optional, Type

__all__ = ["PSError", "InvalidArgument", "NoMemory", "IOFailure", "OutOfRange", "NotFound",
           "ProtocolError", "StateError", "Timeout", "Unavailable", "error_for"]


class PSError(Exception):
    """An error of the parameter-server client.

    Attributes:
        code: the C client's error code (negative, ``PS_E*``).
        message: the whole message, as the C client wrote it.
        grpc_status: the gRPC status a server answered (``"INVALID_ARGUMENT"``,
            ``"UNAUTHENTICATED"``, ...), or None when no server answered.
        server_message: what the server said with it, or None.
    """

    code: int = 0

    def __init__(self, message: str, code: Optional[int] = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        m = re.search(r": ([A-Z][A-Z_]{4,}): (.*)$", message)
        self.grpc_status: Optional[str] = m.group(1) if m else None
        self.server_message: Optional[str] = m.group(2) if m else None


class InvalidArgument(PSError, ValueError):
    """A bad argument or malformed input (PS_EINVAL)."""
    code = -1


class NoMemory(PSError, MemoryError):
    """An allocation failed (PS_ENOMEM)."""
    code = -2


class IOFailure(PSError, OSError):
    """A file or system call failed, e.g. an unreadable token or TLS file (PS_EIO)."""
    code = -3


class OutOfRange(PSError, IndexError):
    """An offset, count, id or shape out of range (PS_ERANGE)."""
    code = -4


class NotFound(PSError, LookupError):
    """An unknown worker, table or key (PS_ENOTFOUND)."""
    code = -5


class ProtocolError(PSError):
    """A server refused the request (a wrong token, a NaN gradient, another job)
    or answered something unexpected (PS_EPROTO)."""
    code = -6


class StateError(PSError):
    """The call is not valid now, e.g. a push still in flight (PS_ESTATE)."""
    code = -7


class Timeout(PSError, TimeoutError):
    """A shard gave up holding a pull back (ssp, sync) (PS_ETIMEDOUT): try again."""
    code = -8


class Unavailable(PSError, ConnectionError):
    """No server answered in time (PS_EUNAVAIL): try again."""
    code = -9


_BY_CODE: Dict[int, Type[PSError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NoMemory, IOFailure, OutOfRange, NotFound, ProtocolError,
                StateError, Timeout, Unavailable)
}


def error_for(code: int, message: str) -> PSError:
    """The exception for a C error code and its message."""
    return _BY_CODE.get(code, PSError)(message, code)
