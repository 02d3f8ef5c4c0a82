"""Deltafin errors as gRPC status codes (the table is deltafin/errors.py's GRPC_STATUS), and back on the client
side."""

from __future__ import annotations

import grpc

from deltafin.errors import GRPC_STATUS, PrefixNotFound, RemoteError, lookup


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status a worker answers with (deltafin/errors.py, GRPC_STATUS); anything else is INTERNAL."""
    name = lookup(GRPC_STATUS, exc)
    return getattr(grpc.StatusCode, name) if name else grpc.StatusCode.INTERNAL


def is_prefix_missing(exc: BaseException) -> bool:
    """A stage (in this process or a worker's) no longer holds the prefix a sequence asked to resume from."""
    return isinstance(exc, PrefixNotFound) or (isinstance(exc, RemoteError) and exc.code == grpc.StatusCode.ABORTED)
