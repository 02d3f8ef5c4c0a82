"""Tensors and stage messages <-> protobuf, with every size checked before anything is built.

The one place where proto messages become typed objects (SeqInput, SeqOutput, WorkerInfo) and back.
Anything malformed raises CodecError, which the servicer turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import msgpack
import torch

from deltafin.errors import CodecError
from deltafin.models.attn_res import ResidualState
from deltafin.stage import SeqInput, SeqOutput
from deltafin.transport.generated import deltafin_pb2 as pb

PROTOCOL_VERSION = 4  # 2: budgets are whole-stage memory (sizing.py), worker ids; 3: prefix cache;
# 4: speculative forwards and releases that keep a session's first N tokens
DEFAULT_MAX_MESSAGE = 1 << 30  # gRPC message cap: a long prefill's residual state is hundreds of MB at K3 width
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "int32": torch.int32}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_RANK = 4
MAX_ELEMENTS = 1 << 31  # no message may claim more than 2G elements, whatever its byte count

if sys.byteorder != "little":  # pragma: no cover - every supported machine is little-endian
    raise ImportError("the Deltafin wire format is little-endian")




def encode_tensor(t: torch.Tensor) -> pb.Tensor:
    if t.dtype not in NAMES:
        raise CodecError(f"cannot send dtype {t.dtype}")
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    return pb.Tensor(dtype=NAMES[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def decode_tensor(msg: pb.Tensor, what: str) -> torch.Tensor:
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"{what}: unknown dtype {msg.dtype!r} (expected one of {', '.join(DTYPES)})")
    shape = list(msg.shape)
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        raise CodecError(f"{what}: invalid shape {shape}")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise CodecError(f"{what}: shape {shape} is absurd ({numel} elements)")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(msg.data) != numel * itemsize:
        raise CodecError(f"{what}: {len(msg.data)} bytes of data for {msg.dtype}{shape} "
                         f"(needs {numel * itemsize})")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).view(shape)


def encode_inputs(batch: list[SeqInput]) -> list[pb.SequenceInput]:
    out = []
    for item in batch:
        msg = pb.SequenceInput(session_id=item.session_id, cache_len=item.cache_len,
                               resume_from=item.resume_from or "", save_as=item.save_as or "",
                               speculative=item.speculative)
        if item.ids is not None:
            msg.ids.CopyFrom(encode_tensor(item.ids))
        if item.state is not None:
            msg.p.CopyFrom(encode_tensor(item.state.P))
            msg.b.CopyFrom(encode_tensor(item.state.B))
        out.append(msg)
    return out


def decode_inputs(msgs: list[pb.SequenceInput]) -> list[SeqInput]:
    out = []
    for i, msg in enumerate(msgs):
        what = f"sequence {i} ({msg.session_id!r})"
        if not msg.session_id:
            raise CodecError(f"sequence {i}: empty session id")
        if msg.cache_len < 0:
            raise CodecError(f"{what}: negative cache_len")
        has_ids, has_state = msg.HasField("ids"), msg.HasField("p") or msg.HasField("b")
        if has_ids == has_state:
            raise CodecError(f"{what}: exactly one of ids or (p, b) is required")
        extra = {"resume_from": msg.resume_from or None, "save_as": msg.save_as or None,
                 "speculative": msg.speculative}
        if msg.resume_from and msg.cache_len == 0:
            raise CodecError(f"{what}: resume_from needs the prefix's length as cache_len")
        if has_ids:
            out.append(SeqInput(msg.session_id, msg.cache_len, ids=decode_tensor(msg.ids, f"{what} ids"), **extra))
        else:
            state = ResidualState(decode_tensor(msg.p, f"{what} p"), decode_tensor(msg.b, f"{what} b"))
            out.append(SeqInput(msg.session_id, msg.cache_len, state=state, **extra))
    return out


def encode_outputs(outputs: list[SeqOutput]) -> list[pb.SequenceOutput]:
    out = []
    for o in outputs:
        msg = pb.SequenceOutput(session_id=o.session_id)
        if o.state is not None:
            msg.p.CopyFrom(encode_tensor(o.state.P))
            msg.b.CopyFrom(encode_tensor(o.state.B))
        if o.logits is not None:
            msg.logits.CopyFrom(encode_tensor(o.logits))
        out.append(msg)
    return out


def decode_outputs(msgs: list[pb.SequenceOutput]) -> list[SeqOutput]:
    out = []
    for msg in msgs:
        what = f"output {msg.session_id!r}"
        if msg.HasField("logits"):
            out.append(SeqOutput(msg.session_id, logits=decode_tensor(msg.logits, f"{what} logits")))
        else:
            state = ResidualState(decode_tensor(msg.p, f"{what} p"), decode_tensor(msg.b, f"{what} b"))
            out.append(SeqOutput(msg.session_id, state=state))
    return out


def pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, what: str) -> dict:
    try:
        obj = msgpack.unpackb(data, raw=False, max_bin_len=1 << 20, max_str_len=1 << 20) if data else {}
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError) as e:
        raise CodecError(f"{what}: not a msgpack map ({e})") from None
    if not isinstance(obj, dict):
        raise CodecError(f"{what}: not a msgpack map")
    return obj


@dataclass(frozen=True)
class WorkerDescription:
    """What a worker says about itself (Info RPC and zeroconf TXT record)."""

    name: str
    address: str  # host:port
    device: str
    memory_bytes: int
    disk_gbps: float
    model_fingerprint: str
    layers: tuple[tuple[int, int], ...]  # [start, end) ranges present on its disk
    has_top: bool
    protocol_version: int = PROTOCOL_VERSION
    version: str = ""
    state: str = "idle"
    assigned: tuple[int, int] = (0, 0)
    host_memory_bytes: int = 0  # RAM beside a discrete GPU; 0 elsewhere
    worker_id: str = ""  # unique per worker process
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """What identifies this worker in a cluster: its id (names are for display and need not be unique)."""
        return self.worker_id or self.address

    def has_layers(self, start: int, end: int) -> bool:
        return all(any(a <= i < b for a, b in self.layers) for i in range(start, end))


def encode_info(d: WorkerDescription) -> pb.WorkerInfo:
    return pb.WorkerInfo(protocol_version=d.protocol_version, name=d.name, device=d.device,
                         memory_bytes=d.memory_bytes, disk_gbps=d.disk_gbps, model_fingerprint=d.model_fingerprint,
                         layers=[pb.LayerRange(start=a, end=b) for a, b in d.layers], has_top=d.has_top,
                         assigned=pb.LayerRange(start=d.assigned[0], end=d.assigned[1]), state=d.state,
                         version=d.version, host_memory_bytes=d.host_memory_bytes, worker_id=d.worker_id)


def decode_info(msg: pb.WorkerInfo, address: str) -> WorkerDescription:
    return WorkerDescription(name=msg.name, address=address, device=msg.device, memory_bytes=msg.memory_bytes,
                             disk_gbps=msg.disk_gbps, model_fingerprint=msg.model_fingerprint,
                             layers=tuple((r.start, r.end) for r in msg.layers), has_top=msg.has_top,
                             protocol_version=msg.protocol_version, version=msg.version, state=msg.state,
                             assigned=(msg.assigned.start, msg.assigned.end), host_memory_bytes=msg.host_memory_bytes,
                             worker_id=msg.worker_id)


def layer_ranges(layers: tuple[int, ...] | list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted layer indices -> compact [start, end) ranges."""
    out: list[list[int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)
