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
    __slots__ = ("protocol_version", "name", "device", "memory_bytes", "disk_gbps", "model_fingerprint", "layers", "has_top", "assigned", "state", "version", "host_memory_bytes", "worker_id", "expert_layers", "expert_gbps", "expert_disks", "forward_layers_done", "forward_layers", "damaged", "spine", "converted", "spine_room_bytes", "addresses", "compute")
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
    EXPERT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_GBPS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_DISKS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    SPINE_FIELD_NUMBER: _ClassVar[int]
    CONVERTED_FIELD_NUMBER: _ClassVar[int]
    SPINE_ROOM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
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
    expert_layers: _containers.RepeatedCompositeFieldContainer[LayerRange]
    expert_gbps: float
    expert_disks: int
    forward_layers_done: int
    forward_layers: int
    damaged: _containers.RepeatedScalarFieldContainer[str]
    spine: str
    converted: _containers.RepeatedCompositeFieldContainer[ConvertedSpine]
    spine_room_bytes: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    compute: ComputeSpeed
    def __init__(self, protocol_version: _Optional[int] = ..., name: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., disk_gbps: _Optional[float] = ..., model_fingerprint: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., has_top: _Optional[bool] = ..., assigned: _Optional[_Union[LayerRange, _Mapping]] = ..., state: _Optional[str] = ..., version: _Optional[str] = ..., host_memory_bytes: _Optional[int] = ..., worker_id: _Optional[str] = ..., expert_layers: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., expert_gbps: _Optional[float] = ..., expert_disks: _Optional[int] = ..., forward_layers_done: _Optional[int] = ..., forward_layers: _Optional[int] = ..., damaged: _Optional[_Iterable[str]] = ..., spine: _Optional[str] = ..., converted: _Optional[_Iterable[_Union[ConvertedSpine, _Mapping]]] = ..., spine_room_bytes: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., compute: _Optional[_Union[ComputeSpeed, _Mapping]] = ...) -> None: ...

class ComputeSpeed(_message.Message):
    __slots__ = ("expert_one_s", "expert_token_s", "spine_one", "spine_many", "spread")
    class SpineOneEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class SpineManyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EXPERT_ONE_S_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    SPINE_ONE_FIELD_NUMBER: _ClassVar[int]
    SPINE_MANY_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    expert_one_s: float
    expert_token_s: float
    spine_one: _containers.ScalarMap[str, float]
    spine_many: _containers.ScalarMap[str, float]
    spread: float
    def __init__(self, expert_one_s: _Optional[float] = ..., expert_token_s: _Optional[float] = ..., spine_one: _Optional[_Mapping[str, float]] = ..., spine_many: _Optional[_Mapping[str, float]] = ..., spread: _Optional[float] = ...) -> None: ...

class ConvertedSpine(_message.Message):
    __slots__ = ("format", "units")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    format: str
    units: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, format: _Optional[str] = ..., units: _Optional[_Iterable[str]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("start", "end", "model_fingerprint", "options", "experts", "plan")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    model_fingerprint: str
    options: StageOptions
    experts: ExpertPlacement
    plan: StagePlan
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., options: _Optional[_Union[StageOptions, _Mapping]] = ..., experts: _Optional[_Union[ExpertPlacement, _Mapping]] = ..., plan: _Optional[_Union[StagePlan, _Mapping]] = ...) -> None: ...

class ExpertPlacement(_message.Message):
    __slots__ = ("holders", "layers", "probe_interval", "lost_after", "call_timeout", "links")
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PROBE_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LOST_AFTER_FIELD_NUMBER: _ClassVar[int]
    CALL_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    layers: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    probe_interval: float
    lost_after: float
    call_timeout: float
    links: _containers.RepeatedCompositeFieldContainer[HolderLink]
    def __init__(self, holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., layers: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ..., probe_interval: _Optional[float] = ..., lost_after: _Optional[float] = ..., call_timeout: _Optional[float] = ..., links: _Optional[_Iterable[_Union[HolderLink, _Mapping]]] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("worker_id", "address", "name", "expert_gbps", "expert_one_s", "expert_token_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXPERT_GBPS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_ONE_S_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    name: str
    expert_gbps: float
    expert_one_s: float
    expert_token_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., name: _Optional[str] = ..., expert_gbps: _Optional[float] = ..., expert_one_s: _Optional[float] = ..., expert_token_s: _Optional[float] = ...) -> None: ...

class HolderLink(_message.Message):
    __slots__ = ("a", "b", "rtt_s", "up_bps", "down_bps")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    UP_BPS_FIELD_NUMBER: _ClassVar[int]
    DOWN_BPS_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    rtt_s: float
    up_bps: float
    down_bps: float
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., rtt_s: _Optional[float] = ..., up_bps: _Optional[float] = ..., down_bps: _Optional[float] = ...) -> None: ...

class LayerExperts(_message.Message):
    __slots__ = ("layer", "bounds")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    bounds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., bounds: _Optional[_Iterable[int]] = ...) -> None: ...

class StageOptions(_message.Message):
    __slots__ = ("dtype", "io", "read_threads", "cache_policy", "prefetch", "prefetch_layers", "wire", "expert_mode")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IO_FIELD_NUMBER: _ClassVar[int]
    READ_THREADS_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MODE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    io: str
    read_threads: int
    cache_policy: str
    prefetch: bool
    prefetch_layers: int
    wire: str
    expert_mode: str
    def __init__(self, dtype: _Optional[str] = ..., io: _Optional[str] = ..., read_threads: _Optional[int] = ..., cache_policy: _Optional[str] = ..., prefetch: _Optional[bool] = ..., prefetch_layers: _Optional[int] = ..., wire: _Optional[str] = ..., expert_mode: _Optional[str] = ...) -> None: ...

class AssignProgress(_message.Message):
    __slots__ = ("message", "fraction", "ready", "prefix_disk_bytes", "state_identity")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    message: str
    fraction: float
    ready: bool
    prefix_disk_bytes: int
    state_identity: str
    def __init__(self, message: _Optional[str] = ..., fraction: _Optional[float] = ..., ready: _Optional[bool] = ..., prefix_disk_bytes: _Optional[int] = ..., state_identity: _Optional[str] = ...) -> None: ...

class SequenceInput(_message.Message):
    __slots__ = ("session_id", "cache_len", "ids", "p", "b", "resume_from", "speculative", "save_at", "feature_layers", "features_from")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    P_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    SAVE_AT_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_len: int
    ids: Tensor
    p: Tensor
    b: Tensor
    resume_from: str
    speculative: bool
    save_at: _containers.RepeatedCompositeFieldContainer[KeepPoint]
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    features_from: int
    def __init__(self, session_id: _Optional[str] = ..., cache_len: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., p: _Optional[_Union[Tensor, _Mapping]] = ..., b: _Optional[_Union[Tensor, _Mapping]] = ..., resume_from: _Optional[str] = ..., speculative: _Optional[bool] = ..., save_at: _Optional[_Iterable[_Union[KeepPoint, _Mapping]]] = ..., feature_layers: _Optional[_Iterable[int]] = ..., features_from: _Optional[int] = ...) -> None: ...

class KeepPoint(_message.Message):
    __slots__ = ("tokens", "prefix_id")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    prefix_id: str
    def __init__(self, tokens: _Optional[int] = ..., prefix_id: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("request_id", "sequences", "all_logits", "part_bytes", "hand_to", "handed_from", "lost_after")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ALL_LOGITS_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    HAND_TO_FIELD_NUMBER: _ClassVar[int]
    HANDED_FROM_FIELD_NUMBER: _ClassVar[int]
    LOST_AFTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInput]
    all_logits: bool
    part_bytes: int
    hand_to: str
    handed_from: str
    lost_after: float
    def __init__(self, request_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[SequenceInput, _Mapping]]] = ..., all_logits: _Optional[bool] = ..., part_bytes: _Optional[int] = ..., hand_to: _Optional[str] = ..., handed_from: _Optional[str] = ..., lost_after: _Optional[float] = ...) -> None: ...

class HandOffAck(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("session_id", "p", "b", "logits", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    P_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    p: Tensor
    b: Tensor
    logits: Tensor
    features: _containers.RepeatedCompositeFieldContainer[LayerFeatures]
    def __init__(self, session_id: _Optional[str] = ..., p: _Optional[_Union[Tensor, _Mapping]] = ..., b: _Optional[_Union[Tensor, _Mapping]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., features: _Optional[_Iterable[_Union[LayerFeatures, _Mapping]]] = ...) -> None: ...

class LayerFeatures(_message.Message):
    __slots__ = ("layer", "rows")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    rows: Tensor
    def __init__(self, layer: _Optional[int] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("sequences", "handed")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    HANDED_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    handed: bool
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., handed: _Optional[bool] = ...) -> None: ...

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

class ExpertRequest(_message.Message):
    __slots__ = ("layer", "z", "rows", "experts", "hints", "weights", "bf16", "hints_ahead")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    BF16_FIELD_NUMBER: _ClassVar[int]
    HINTS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    layer: int
    z: Tensor
    rows: Tensor
    experts: Tensor
    hints: _containers.RepeatedCompositeFieldContainer[ExpertHint]
    weights: Tensor
    bf16: bool
    hints_ahead: bool
    def __init__(self, layer: _Optional[int] = ..., z: _Optional[_Union[Tensor, _Mapping]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., experts: _Optional[_Union[Tensor, _Mapping]] = ..., hints: _Optional[_Iterable[_Union[ExpertHint, _Mapping]]] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ..., bf16: _Optional[bool] = ..., hints_ahead: _Optional[bool] = ...) -> None: ...

class ExpertHint(_message.Message):
    __slots__ = ("layer", "experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertResponse(_message.Message):
    __slots__ = ("outputs", "rows")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    outputs: Tensor
    rows: Tensor
    def __init__(self, outputs: _Optional[_Union[Tensor, _Mapping]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class FindPrefixRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: Tensor
    def __init__(self, tokens: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class FindPrefixResponse(_message.Message):
    __slots__ = ("prefix_id", "length")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    length: int
    def __init__(self, prefix_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class HeldPrefixesRequest(_message.Message):
    __slots__ = ("prefix_ids", "logits_for")
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FOR_FIELD_NUMBER: _ClassVar[int]
    prefix_ids: _containers.RepeatedScalarFieldContainer[str]
    logits_for: str
    def __init__(self, prefix_ids: _Optional[_Iterable[str]] = ..., logits_for: _Optional[str] = ...) -> None: ...

class HeldPrefixesResponse(_message.Message):
    __slots__ = ("prefix_ids", "lengths", "logits")
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    prefix_ids: _containers.RepeatedScalarFieldContainer[str]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    logits: Tensor
    def __init__(self, prefix_ids: _Optional[_Iterable[str]] = ..., lengths: _Optional[_Iterable[int]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: StageStats
    def __init__(self, stats: _Optional[_Union[StageStats, _Mapping]] = ...) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("state", "name", "rss_peak_bytes", "forwards", "tokens", "seconds", "compute_s", "spine_streamed_bytes", "spine_read_s", "spine_wait_s", "sessions", "session_bytes", "layers", "prefixes", "prefix_bytes", "prefix_budget", "prefixes_kept", "prefixes_resumed", "prefixes_evicted", "prefixes_refused", "experts", "plan", "wide", "disks", "experts_s", "prefixes_restored", "prefix_disk_files", "prefix_disk_bytes", "spilled_forwards", "spill_bytes_read", "spill_bytes_written", "spill_s", "handed_on", "hand_offs_failed", "handed_in")
    STATE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RSS_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SPINE_STREAMED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPINE_READ_S_FIELD_NUMBER: _ClassVar[int]
    SPINE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_KEPT_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_RESUMED_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    WIDE_FIELD_NUMBER: _ClassVar[int]
    DISKS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_S_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_RESTORED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_FILES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    SPILL_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    SPILL_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SPILL_S_FIELD_NUMBER: _ClassVar[int]
    HANDED_ON_FIELD_NUMBER: _ClassVar[int]
    HAND_OFFS_FAILED_FIELD_NUMBER: _ClassVar[int]
    HANDED_IN_FIELD_NUMBER: _ClassVar[int]
    state: str
    name: str
    rss_peak_bytes: int
    forwards: int
    tokens: int
    seconds: float
    compute_s: float
    spine_streamed_bytes: int
    spine_read_s: float
    spine_wait_s: float
    sessions: int
    session_bytes: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    prefixes: int
    prefix_bytes: int
    prefix_budget: int
    prefixes_kept: int
    prefixes_resumed: int
    prefixes_evicted: int
    prefixes_refused: int
    experts: ExpertStats
    plan: StagePlan
    wide: WideStats
    disks: _containers.RepeatedCompositeFieldContainer[DiskStats]
    experts_s: float
    prefixes_restored: int
    prefix_disk_files: int
    prefix_disk_bytes: int
    spilled_forwards: int
    spill_bytes_read: int
    spill_bytes_written: int
    spill_s: float
    handed_on: int
    hand_offs_failed: int
    handed_in: int
    def __init__(self, state: _Optional[str] = ..., name: _Optional[str] = ..., rss_peak_bytes: _Optional[int] = ..., forwards: _Optional[int] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., compute_s: _Optional[float] = ..., spine_streamed_bytes: _Optional[int] = ..., spine_read_s: _Optional[float] = ..., spine_wait_s: _Optional[float] = ..., sessions: _Optional[int] = ..., session_bytes: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., prefixes: _Optional[int] = ..., prefix_bytes: _Optional[int] = ..., prefix_budget: _Optional[int] = ..., prefixes_kept: _Optional[int] = ..., prefixes_resumed: _Optional[int] = ..., prefixes_evicted: _Optional[int] = ..., prefixes_refused: _Optional[int] = ..., experts: _Optional[_Union[ExpertStats, _Mapping]] = ..., plan: _Optional[_Union[StagePlan, _Mapping]] = ..., wide: _Optional[_Union[WideStats, _Mapping]] = ..., disks: _Optional[_Iterable[_Union[DiskStats, _Mapping]]] = ..., experts_s: _Optional[float] = ..., prefixes_restored: _Optional[int] = ..., prefix_disk_files: _Optional[int] = ..., prefix_disk_bytes: _Optional[int] = ..., spilled_forwards: _Optional[int] = ..., spill_bytes_read: _Optional[int] = ..., spill_bytes_written: _Optional[int] = ..., spill_s: _Optional[float] = ..., handed_on: _Optional[int] = ..., hand_offs_failed: _Optional[int] = ..., handed_in: _Optional[int] = ...) -> None: ...

class WideStats(_message.Message):
    __slots__ = ("share", "own_expert_bytes", "others_expert_bytes", "own_lookups", "own_hits", "others_lookups", "others_hits", "peer_wait_s", "calls_served", "pairs_served", "served_s", "holders")
    SHARE_FIELD_NUMBER: _ClassVar[int]
    OWN_EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OTHERS_EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWN_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    OWN_HITS_FIELD_NUMBER: _ClassVar[int]
    OTHERS_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    OTHERS_HITS_FIELD_NUMBER: _ClassVar[int]
    PEER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    CALLS_SERVED_FIELD_NUMBER: _ClassVar[int]
    PAIRS_SERVED_FIELD_NUMBER: _ClassVar[int]
    SERVED_S_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    share: str
    own_expert_bytes: int
    others_expert_bytes: int
    own_lookups: int
    own_hits: int
    others_lookups: int
    others_hits: int
    peer_wait_s: float
    calls_served: int
    pairs_served: int
    served_s: float
    holders: _containers.RepeatedCompositeFieldContainer[HolderStats]
    def __init__(self, share: _Optional[str] = ..., own_expert_bytes: _Optional[int] = ..., others_expert_bytes: _Optional[int] = ..., own_lookups: _Optional[int] = ..., own_hits: _Optional[int] = ..., others_lookups: _Optional[int] = ..., others_hits: _Optional[int] = ..., peer_wait_s: _Optional[float] = ..., calls_served: _Optional[int] = ..., pairs_served: _Optional[int] = ..., served_s: _Optional[float] = ..., holders: _Optional[_Iterable[_Union[HolderStats, _Mapping]]] = ...) -> None: ...

class HolderStats(_message.Message):
    __slots__ = ("name", "calls", "experts", "pairs", "seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    calls: int
    experts: int
    pairs: int
    seconds: float
    def __init__(self, name: _Optional[str] = ..., calls: _Optional[int] = ..., experts: _Optional[int] = ..., pairs: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DiskStats(_message.Message):
    __slots__ = ("dir", "gbps", "bytes_read", "reads")
    DIR_FIELD_NUMBER: _ClassVar[int]
    GBPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    dir: str
    gbps: float
    bytes_read: int
    reads: int
    def __init__(self, dir: _Optional[str] = ..., gbps: _Optional[float] = ..., bytes_read: _Optional[int] = ..., reads: _Optional[int] = ...) -> None: ...

class ExpertStats(_message.Message):
    __slots__ = ("lookups", "hits", "prefetch_hits", "misses", "prefetch_issued", "prefetch_bytes", "prefetch_cancelled", "wasted_bytes", "io_wait_s", "reads", "bytes_read", "read_seconds", "hit_rate", "prefetch_recall")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ISSUED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    WASTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    IO_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_RECALL_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hits: int
    prefetch_hits: int
    misses: int
    prefetch_issued: int
    prefetch_bytes: int
    prefetch_cancelled: int
    wasted_bytes: int
    io_wait_s: float
    reads: int
    bytes_read: int
    read_seconds: float
    hit_rate: float
    prefetch_recall: float
    def __init__(self, lookups: _Optional[int] = ..., hits: _Optional[int] = ..., prefetch_hits: _Optional[int] = ..., misses: _Optional[int] = ..., prefetch_issued: _Optional[int] = ..., prefetch_bytes: _Optional[int] = ..., prefetch_cancelled: _Optional[int] = ..., wasted_bytes: _Optional[int] = ..., io_wait_s: _Optional[float] = ..., reads: _Optional[int] = ..., bytes_read: _Optional[int] = ..., read_seconds: _Optional[float] = ..., hit_rate: _Optional[float] = ..., prefetch_recall: _Optional[float] = ...) -> None: ...

class StagePlan(_message.Message):
    __slots__ = ("start", "end", "device", "spine", "resident_layers", "streamed_layers", "layers", "top", "stream_buffers", "stream_copies", "experts_resident", "expert_cache", "expert_staging", "expert_landing", "sessions", "prefixes", "workspace", "overhead", "forward_tokens", "spine_bytes_per_token", "expert_bytes_per_token", "discrete", "total", "host", "device_total", "expert_calls", "expert_layers", "expert_share", "sequences", "spine_why", "converted", "context", "wide", "prompt_tokens", "spill_tokens", "expert_read_share")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SPINE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STREAMED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    STREAM_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    STREAM_COPIES_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CACHE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_STAGING_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LANDING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPINE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DISCRETE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CALLS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SHARE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SPINE_WHY_FIELD_NUMBER: _ClassVar[int]
    CONVERTED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    WIDE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_READ_SHARE_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    device: str
    spine: str
    resident_layers: _containers.RepeatedScalarFieldContainer[int]
    streamed_layers: _containers.RepeatedScalarFieldContainer[int]
    layers: int
    top: int
    stream_buffers: int
    stream_copies: int
    experts_resident: bool
    expert_cache: int
    expert_staging: int
    expert_landing: int
    sessions: int
    prefixes: int
    workspace: int
    overhead: int
    forward_tokens: int
    spine_bytes_per_token: int
    expert_bytes_per_token: int
    discrete: bool
    total: int
    host: int
    device_total: int
    expert_calls: int
    expert_layers: int
    expert_share: float
    sequences: int
    spine_why: str
    converted: bool
    context: int
    wide: bool
    prompt_tokens: int
    spill_tokens: int
    expert_read_share: float
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., device: _Optional[str] = ..., spine: _Optional[str] = ..., resident_layers: _Optional[_Iterable[int]] = ..., streamed_layers: _Optional[_Iterable[int]] = ..., layers: _Optional[int] = ..., top: _Optional[int] = ..., stream_buffers: _Optional[int] = ..., stream_copies: _Optional[int] = ..., experts_resident: _Optional[bool] = ..., expert_cache: _Optional[int] = ..., expert_staging: _Optional[int] = ..., expert_landing: _Optional[int] = ..., sessions: _Optional[int] = ..., prefixes: _Optional[int] = ..., workspace: _Optional[int] = ..., overhead: _Optional[int] = ..., forward_tokens: _Optional[int] = ..., spine_bytes_per_token: _Optional[int] = ..., expert_bytes_per_token: _Optional[int] = ..., discrete: _Optional[bool] = ..., total: _Optional[int] = ..., host: _Optional[int] = ..., device_total: _Optional[int] = ..., expert_calls: _Optional[int] = ..., expert_layers: _Optional[int] = ..., expert_share: _Optional[float] = ..., sequences: _Optional[int] = ..., spine_why: _Optional[str] = ..., converted: _Optional[bool] = ..., context: _Optional[int] = ..., wide: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., spill_tokens: _Optional[int] = ..., expert_read_share: _Optional[float] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class EchoReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class MeasureLinkRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class LinkMeasure(_message.Message):
    __slots__ = ("rtt_s", "up_bps", "down_bps", "probe_bytes")
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    UP_BPS_FIELD_NUMBER: _ClassVar[int]
    DOWN_BPS_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    rtt_s: float
    up_bps: float
    down_bps: float
    probe_bytes: int
    def __init__(self, rtt_s: _Optional[float] = ..., up_bps: _Optional[float] = ..., down_bps: _Optional[float] = ..., probe_bytes: _Optional[int] = ...) -> None: ...
