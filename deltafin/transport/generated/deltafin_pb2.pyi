from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("protocol_version", "name", "device", "memory_bytes", "disk_gbps", "model_fingerprint", "layers", "has_top", "assigned", "state", "version", "host_memory_bytes", "worker_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_GBPS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOP_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    name: str
    device: str
    memory_bytes: int
    disk_gbps: float
    model_fingerprint: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerRange]
    has_top: bool
    assigned: LayerRange
    state: str
    version: str
    host_memory_bytes: int
    worker_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., name: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., disk_gbps: _Optional[float] = ..., model_fingerprint: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., has_top: _Optional[bool] = ..., assigned: _Optional[_Union[LayerRange, _Mapping]] = ..., state: _Optional[str] = ..., version: _Optional[str] = ..., host_memory_bytes: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("start", "end", "model_fingerprint", "options")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    model_fingerprint: str
    options: bytes
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., options: _Optional[bytes] = ...) -> None: ...

class AssignProgress(_message.Message):
    __slots__ = ("message", "fraction", "ready")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    message: str
    fraction: float
    ready: bool
    def __init__(self, message: _Optional[str] = ..., fraction: _Optional[float] = ..., ready: _Optional[bool] = ...) -> None: ...

class SequenceInput(_message.Message):
    __slots__ = ("session_id", "cache_len", "ids", "p", "b", "resume_from", "save_as", "speculative")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    P_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    SAVE_AS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_len: int
    ids: Tensor
    p: Tensor
    b: Tensor
    resume_from: str
    save_as: str
    speculative: bool
    def __init__(self, session_id: _Optional[str] = ..., cache_len: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., p: _Optional[_Union[Tensor, _Mapping]] = ..., b: _Optional[_Union[Tensor, _Mapping]] = ..., resume_from: _Optional[str] = ..., save_as: _Optional[str] = ..., speculative: _Optional[bool] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("request_id", "sequences", "all_logits")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ALL_LOGITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInput]
    all_logits: bool
    def __init__(self, request_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[SequenceInput, _Mapping]]] = ..., all_logits: _Optional[bool] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("session_id", "p", "b", "logits")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    P_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    p: Tensor
    b: Tensor
    logits: Tensor
    def __init__(self, session_id: _Optional[str] = ..., p: _Optional[_Union[Tensor, _Mapping]] = ..., b: _Optional[_Union[Tensor, _Mapping]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_ids", "keep_as", "keep_lengths")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_AS_FIELD_NUMBER: _ClassVar[int]
    KEEP_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    keep_as: _containers.RepeatedScalarFieldContainer[str]
    keep_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., keep_as: _Optional[_Iterable[str]] = ..., keep_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: bytes
    def __init__(self, stats: _Optional[bytes] = ...) -> None: ...
