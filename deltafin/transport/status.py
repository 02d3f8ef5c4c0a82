"""One table from Deltafin errors to gRPC status codes, and back on the client side."""

from __future__ import annotations

import grpc

from deltafin.errors import ConfigError, DeltafinError, ModelFormatError
from deltafin.stage import Cancelled, InvalidInput, OutOfMemory, PrefixNotFound, SessionNotFound, SessionOutOfSync
from deltafin.transport.codec import CodecError


class NotAssigned(DeltafinError):
    """The worker has no stage loaded (yet)."""


class FingerprintMismatch(DeltafinError):
    """Coordinator and worker hold different checkpoints."""


class RemoteError(DeltafinError):
    """An RPC to a worker failed; `code` is its gRPC status."""

    def __init__(self, worker: str, code: grpc.StatusCode, details: str):
        self.worker, self.code, self.details = worker, code, details
        super().__init__(f"worker {worker}: {code.name}: {details}")


# most specific first
STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (PrefixNotFound, grpc.StatusCode.ABORTED),  # not lost state: the coordinator starts the session afresh
    (SessionOutOfSync, grpc.StatusCode.FAILED_PRECONDITION),
    (OutOfMemory, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Cancelled, grpc.StatusCode.CANCELLED),
    (NotAssigned, grpc.StatusCode.FAILED_PRECONDITION),
    (FingerprintMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (ModelFormatError, grpc.StatusCode.DATA_LOSS),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (DeltafinError, grpc.StatusCode.INTERNAL),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def is_prefix_missing(exc: BaseException) -> bool:
    """A stage (in this process or a worker's) no longer holds the prefix a sequence asked to resume from."""
    return isinstance(exc, PrefixNotFound) or (isinstance(exc, RemoteError) and exc.code == grpc.StatusCode.ABORTED)
