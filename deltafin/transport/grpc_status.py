"""Deltafin errors as gRPC status codes (the table is deltafin/errors.py's GRPC_STATUS), and back on the client
side."""

from __future__ import annotations

import grpc

from deltafin.errors import GRPC_STATUS, HolderError, PrefixNotFound, RemoteError, lookup


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status a worker answers with (deltafin/errors.py, GRPC_STATUS): an expert holder's failure passes on
    the holder's own status; anything else is INTERNAL."""
    name = exc.status if isinstance(exc, HolderError) else lookup(GRPC_STATUS, exc)
    return getattr(grpc.StatusCode, name) if name else grpc.StatusCode.INTERNAL


def is_prefix_missing(exc: BaseException) -> bool:
    """A stage (in this process or a worker's) no longer holds the prefix a sequence asked to resume from."""
    return isinstance(exc, PrefixNotFound) or (isinstance(exc, RemoteError) and exc.code == grpc.StatusCode.ABORTED)
