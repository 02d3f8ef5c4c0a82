"""What a worker says about itself (the Info RPC, its zeroconf record) <-> protobuf: its disks, memory, layers,
converted spines, addresses and measured compute."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltafin.plan.cluster.compute import ComputeSpeed
from deltafin.plan.memory.spine_copies import SpineDisk
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.protocol import PROTOCOL_VERSION


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
    expert_layers: tuple[tuple[int, int], ...] | None = None  # [start, end) ranges of experts it reads (None: layers)
    expert_gbps: float = 0.0  # its expert disks together (0: disk_gbps)
    expert_disks: int = 1
    damaged: tuple[str, ...] = ()  # shards on its disk that it cannot serve from: "FILE: layers A-B"
    spine: str = "auto"  # the spine format it was started with (--spine)
    spine_disk: SpineDisk | None = None  # the converted spines on its disk (None: not said)
    addresses: tuple[str, ...] = ()  # every address it is reached at (the coordinator measures and uses the fastest)
    compute: ComputeSpeed | None = None  # measured at start (runtime/compute_probe.py; None: not said)
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """What identifies this worker in a cluster: its id (names are for display and need not be unique)."""
        return self.worker_id or self.address

    def has_layers(self, start: int, end: int) -> bool:
        return all(any(a <= i < b for a, b in self.layers) for i in range(start, end))

    @property
    def expert_ranges(self) -> tuple[tuple[int, int], ...]:
        """The layers whose routed experts it can read (from any of its disks)."""
        return self.layers if self.expert_layers is None else self.expert_layers

    @property
    def expert_speed(self) -> float:
        return self.expert_gbps or self.disk_gbps


def encode_info(d: WorkerDescription) -> pb.WorkerInfo:
    return pb.WorkerInfo(protocol_version=d.protocol_version, name=d.name, device=d.device,
                         memory_bytes=d.memory_bytes, disk_gbps=d.disk_gbps, model_fingerprint=d.model_fingerprint,
                         layers=[pb.LayerRange(start=a, end=b) for a, b in d.layers], has_top=d.has_top,
                         assigned=pb.LayerRange(start=d.assigned[0], end=d.assigned[1]), state=d.state,
                         version=d.version, host_memory_bytes=d.host_memory_bytes, worker_id=d.worker_id,
                         expert_layers=[pb.LayerRange(start=a, end=b) for a, b in d.expert_ranges],
                         expert_gbps=d.expert_speed, expert_disks=d.expert_disks, damaged=list(d.damaged),
                         spine=d.spine, addresses=list(d.addresses), **_spine_disk_fields(d.spine_disk),
                         **({} if d.compute is None else {"compute": pb.ComputeSpeed(
                             expert_one_s=d.compute.expert_one_s, expert_token_s=d.compute.expert_token_s,
                             spine_one=dict(d.compute.spine_one), spine_many=dict(d.compute.spine_many),
                             spread=d.compute.spread)}))


def _spine_disk_fields(disk: SpineDisk | None) -> dict[str, Any]:
    return {} if disk is None else {
        "converted": [pb.ConvertedSpine(format=f, units=sorted(u)) for f, u in sorted(disk.copies.items())],
        **({"spine_room_bytes": disk.room} if disk.room is not None else {})}


def decode_info(msg: pb.WorkerInfo, address: str) -> WorkerDescription:
    return WorkerDescription(name=msg.name, address=address, device=msg.device, memory_bytes=msg.memory_bytes,
                             disk_gbps=msg.disk_gbps, model_fingerprint=msg.model_fingerprint,
                             layers=tuple((r.start, r.end) for r in msg.layers), has_top=msg.has_top,
                             protocol_version=msg.protocol_version, version=msg.version, state=msg.state,
                             assigned=(msg.assigned.start, msg.assigned.end), host_memory_bytes=msg.host_memory_bytes,
                             worker_id=msg.worker_id, expert_layers=tuple((r.start, r.end) for r in msg.expert_layers),
                             expert_gbps=msg.expert_gbps, expert_disks=msg.expert_disks or 1,
                             damaged=tuple(msg.damaged), spine=msg.spine or "auto", addresses=tuple(msg.addresses),
                             spine_disk=SpineDisk({c.format: frozenset(c.units) for c in msg.converted},
                                                  msg.spine_room_bytes if msg.HasField("spine_room_bytes") else None),
                             compute=_compute(msg.compute) if msg.HasField("compute") else None)


def _compute(msg: pb.ComputeSpeed) -> ComputeSpeed:
    return ComputeSpeed(msg.expert_one_s, msg.expert_token_s, dict(msg.spine_one), dict(msg.spine_many), msg.spread)


def layer_ranges(layers: tuple[int, ...] | list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted layer indices -> compact [start, end) ranges."""
    out: list[list[int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)
