"""Every error Deltafin reports, and the two tables that say how it reaches a client: the gRPC status a
worker answers with (transport/grpc_status.py applies it) and the HTTP status the API answers with
(coordinator/http/server.py applies it). Entry points print any of these as one line, never a traceback.

Most specific first in both tables: the first class an error is an instance of decides.
"""

from __future__ import annotations

from typing import Any


class DeltafinError(Exception):
    """Base class for every error Deltafin reports to its user."""


# ---- the checkpoint and the plan ----------------------------------------------------------------------------


class ConfigError(DeltafinError):
    """config.json describes a model Deltafin cannot run (unknown type, inconsistent lists, ...)."""


class ModelFormatError(DeltafinError):
    """The checkpoint on disk does not match what its config implies.

    `problems` lists every problem found, each naming the tensor or file concerned.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = self.problems[0] if len(self.problems) == 1 else f"{len(self.problems)} problems"
        body = "" if len(self.problems) == 1 else "\n  - " + "\n  - ".join(self.problems)
        super().__init__(head + body)


class SpineNotConverted(DeltafinError):
    """The plan needs a converted spine (int8, q4) that is missing or stale, and conversion was refused."""


class CorruptSpine(ModelFormatError):
    """A converted spine's unit (a file of weights/spine_files.py) does not match its checksums."""

    def __init__(self, message: str, unit: str):
        super().__init__(message)
        self.unit = unit


class SizingError(DeltafinError):
    """What was asked cannot fit in the memory given; the message has the numbers."""


class PlanError(DeltafinError):
    """The layers cannot be split over the workers given (too little memory, layers missing on disk)."""


# ---- a stage ------------------------------------------------------------------------------------------------


class StageError(DeltafinError):
    """A request this stage cannot serve (the stage itself stays usable)."""


class InvalidInput(StageError):
    """A forward's inputs are malformed (shapes, ids, token counts, option combinations)."""


class SessionNotFound(StageError):
    """The session is not on this stage (never started, released, expired or evicted)."""


class SessionOutOfSync(StageError):
    """The call's cache_len is not where the session is (nor a position it may rewind to)."""


class OutOfMemory(StageError):
    """The session budget cannot hold this forward's sequences."""


class Cancelled(StageError):
    """The forward was cancelled (its caller went away)."""


class StatesGone(StageError):
    """The states handed to this worker for a forward (stage to stage) are not here: never whole, or dropped."""


class PrefixNotFound(StageError):
    """A sequence asked to resume from a prefix this stage does not hold (evicted, or never kept)."""


# ---- the wire and the cluster -------------------------------------------------------------------------------


class CodecError(DeltafinError):
    """A message that does not decode: wrong sizes, dtypes or shapes."""


class AuthError(DeltafinError):
    """A cluster key, TLS file or signature that is missing, malformed or wrong."""


class NotAssigned(DeltafinError):
    """The worker has no stage loaded (yet)."""


class FingerprintMismatch(DeltafinError):
    """Coordinator and worker hold different checkpoints."""


class RemoteError(DeltafinError):
    """An RPC to a worker failed; `code` is its gRPC status (a grpc.StatusCode)."""

    def __init__(self, worker: str, code: Any, details: str):
        self.worker, self.code, self.details = worker, code, details
        super().__init__(f"worker {worker}: {code.name}: {details}")


class ClusterError(DeltafinError):
    """No usable workers: none found, or every one refused (another model, protocol or key)."""


class WorkerLost(DeltafinError):
    """A worker stopped answering while it held a forward."""

    def __init__(self, worker: str, seconds: float):
        self.worker = worker
        super().__init__(f"worker {worker} has not answered for {seconds:.1f}s: treating it as lost")


class HolderError(DeltafinError):
    """An expert call to another worker failed (wide experts): the stage answers with the holder's status, so
    that a holder that is gone (UNAVAILABLE) is recovered from like a lost stage. `status` is a gRPC status
    name."""

    def __init__(self, holder: str, status: str, details: str):
        self.holder, self.status, self.details = holder, status, details
        super().__init__(f"expert holder {holder}: {status}: {details}")


class NotHeld(StageError):
    """An expert call asked for experts this worker does not serve (its placement changed, or another plan)."""


class ClusterUnavailable(DeltafinError):
    """The workers that answer cannot run the model (or kept failing): this request fails."""


class PartialFailure(DeltafinError):
    """Some sequences of a batch failed and the others did not: `results` holds an output or an error each."""

    def __init__(self, results: list[Any]):
        self.results = results
        errors = [r for r in results if isinstance(r, BaseException)]
        super().__init__(f"{len(errors)} of {len(results)} sequences failed: {errors[0]}")


# ---- requests -----------------------------------------------------------------------------------------------


class SamplingError(DeltafinError):
    """Invalid sampling parameters (the HTTP API answers 400 with the parameter named)."""

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(message)


class DraftUnavailable(DeltafinError):
    """Drafts asked for that this model cannot make: no draft head, or one for another model (the HTTP API answers
    400, naming `speculative`)."""

    param = "speculative"


class ChatFormatError(DeltafinError):
    """A conversation the K3 format cannot express (the HTTP API answers 400, naming `messages`)."""

    param = "messages"


class PromptTooLong(DeltafinError):
    """The prompt plus the tokens asked for do not fit the context limit."""


class QueueFull(DeltafinError):
    """Every slot is busy and the waiting queue is full."""


class ShuttingDown(DeltafinError):
    """The server is stopping: no new requests, and generations still running when its grace period ends are
    ended (a stream with an error event, a whole response with 503)."""


# ---- how they reach a client --------------------------------------------------------------------------------

# error -> the gRPC status name a worker answers with
GRPC_STATUS: list[tuple[type[DeltafinError], str]] = [
    (CodecError, "INVALID_ARGUMENT"),
    (InvalidInput, "INVALID_ARGUMENT"),
    (SessionNotFound, "NOT_FOUND"),
    (StatesGone, "NOT_FOUND"),  # lost state: the stages before advanced, so the sessions are replayed
    (PrefixNotFound, "ABORTED"),  # not lost state: the coordinator starts the session afresh
    (NotHeld, "FAILED_PRECONDITION"),
    (SessionOutOfSync, "FAILED_PRECONDITION"),
    (OutOfMemory, "RESOURCE_EXHAUSTED"),
    (SizingError, "RESOURCE_EXHAUSTED"),  # an assignment this worker's budget cannot hold
    (Cancelled, "CANCELLED"),
    (NotAssigned, "FAILED_PRECONDITION"),
    (FingerprintMismatch, "FAILED_PRECONDITION"),
    (ModelFormatError, "DATA_LOSS"),
    (ConfigError, "FAILED_PRECONDITION"),
    (DeltafinError, "INTERNAL"),
]

# error -> (HTTP status, OpenAI error type, OpenAI error code or None) the API answers with
HTTP_STATUS: list[tuple[type[DeltafinError], tuple[int, str, str | None]]] = [
    (QueueFull, (429, "rate_limit_error", "rate_limit_exceeded")),
    (ShuttingDown, (503, "server_error", "server_shutting_down")),
    (PromptTooLong, (400, "invalid_request_error", "context_length_exceeded")),
    (SamplingError, (400, "invalid_request_error", None)),
    (ChatFormatError, (400, "invalid_request_error", None)),
    (DraftUnavailable, (400, "invalid_request_error", None)),
    (ClusterUnavailable, (503, "server_error", "cluster_unavailable")),
    (RemoteError, (503, "server_error", "worker_unavailable")),
    (WorkerLost, (503, "server_error", "worker_unavailable")),
    (DeltafinError, (500, "server_error", None)),
]


def lookup(table: list[tuple[type[DeltafinError], Any]], error: BaseException) -> Any:
    """The table's entry for `error` (None for an error that is not Deltafin's)."""
    return next((value for kind, value in table if isinstance(error, kind)), None)
