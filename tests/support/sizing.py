"""Planned against allocated: what a stage holds, part by part, and what its plan gave it."""

from __future__ import annotations

import dataclasses

import torch

from deltafin.kernels.quant import Int8Weight, MXFP4Weight
from deltafin.runtime.stage import Stage
from deltafin.weights.resident import ResidentExperts
from deltafin.weights.store import ExpertStore


def _tensors(obj, seen: set[int]):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (MXFP4Weight, Int8Weight)) or dataclasses.is_dataclass(obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), seen)


def _weight_bytes(objs) -> int:
    """Bytes of every tensor held, each byte of memory counted once (by storage on the CPU, storages that lie in
    one another counted as one: the tensors of a converted spine's unit kept as stored are storages of their own
    over the unit's buffer; placed tensors on a discrete device are separate allocations)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    total = 0
    for obj in objs:
        for t in _tensors(obj, seen):
            if t.device.type == "meta":
                total += t.numel() * t.element_size()
            else:
                ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                storages[ptr] = max(n, storages.get(ptr, 0))
    end = 0
    for ptr, n in sorted(storages.items()):  # the union of the storages' address ranges
        total += max(0, ptr + n - max(ptr, end))
        end = max(end, ptr + n)
    return total


def held(stage: Stage) -> dict[str, int]:
    """What `stage` holds, by the parts the plan counts."""
    experts = stage.experts
    if isinstance(experts, ExpertStore):
        host = experts.pool.nbytes
        device = experts.device_slots.nbytes if experts.device_slots is not None else 0
    else:
        assert isinstance(experts, ResidentExperts)
        host, device = (0, experts.resident_bytes()) if stage.device.type != "cpu" else (experts.resident_bytes(), 0)
    return {"spine": _weight_bytes([*stage.spine.resident.values(), stage.top]),
            "buffers": sum(len(b) for b in stage.spine._buffers), "experts": host + device,
            "sessions": stage.session_bytes()}


def plan_of(stage: Stage) -> dict[str, int]:
    """What the plan gave `stage`, by the same parts."""
    z = stage.plan
    return {"spine": z.layers + z.top, "buffers": z.stream_buffers,
            "experts": z.expert_cache + z.expert_staging + z.expert_landing, "sessions": z.sessions}
