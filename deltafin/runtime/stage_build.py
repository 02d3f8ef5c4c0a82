"""How a stage's parts are made from its options, before it computes: what it will hold (`plan_stage`, pure),
the check that the checkpoint holds its tensors, how each of its weights is placed on the device
(`WeightPlacer`, as sizing.py counts it), where its routed experts come from (`ExpertProvider`, built by
`open_experts` on the backend `expert_backend_for` picks) and the disk folder of its kept prefixes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.manifest import check_held
from deltafin.checkpoint.shards import Checkpoint, fingerprint, id_ranges, open_copy
from deltafin.errors import OutOfMemory, SizingError
from deltafin.expert_modes import EXACT, ExpertMode
from deltafin.formats import auto_spines, held_format, low_bit_format, spine_format, stored_spine, weight_format
from deltafin.formats.q4 import Q4
from deltafin.kernels.linear import Weight, expert_backend, kernel_family, q4_on_mlx
from deltafin.kernels.quant import Q4Weight
from deltafin.models.common import activation
from deltafin.models.weights import ExpertWeights
from deltafin.plan.memory.context import grown
from deltafin.plan.memory.kept_prefixes import default_prefix_disk_bytes
from deltafin.plan.memory.layer_table import STORED, matrix_format
from deltafin.plan.memory.sizing import QUALITY_SOURCE, Placement, choose, size_stage
from deltafin.plan.memory.spine_copies import SpineDisk, stage_units
from deltafin.plan.memory.stage_plan import Budget, StagePlan
from deltafin.runtime.prefix_disk import PrefixDisk
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights.diskspeed import measure_disk
from deltafin.weights.expert_copy import Want, prepare_copy, whole_layers
from deltafin.weights.expert_heat import ExpertHeat
from deltafin.weights.reader import layer_spans
from deltafin.weights.resident import ResidentExperts
from deltafin.weights.spine_convert import prepare_spine, spine_disk
from deltafin.weights.spine_files import RECIPE, SpineFiles
from deltafin.weights.store import ExpertStore

log = logging.getLogger(__name__)


class ExpertProvider(Protocol):
    def experts(self, layer: int, ids: list[int]) -> Iterable[tuple[int, ExpertWeights]]: ...

    def resident_bytes(self) -> int: ...

    def close(self) -> None: ...


def plan_stage(cfg: ModelConfig, start: int, end: int, device: torch.device, options: StageOptions,
               spans: tuple[int, ...] | None = None, experts: str = "torch",
               known: Mapping[str, Any] | None = None) -> StagePlan:
    """What the stage will hold (pure): within `memory_bytes` if set (its context, where none is given, the longest
    that memory holds: plan/memory/context.py), else everything resident; `experts` is where the routed experts run
    (torch or mlx); `known`: what the plan knows beside the options (SizingInput's own fields: a wide stage's
    `expert_layers` and `expert_share`, `converted`)."""
    place = Placement(device.type, options.act_bytes, experts)
    sizing = options.sizing_for(cfg, spans, **(known or {}))
    if options.memory_bytes is None:
        spine = stored_spine() if options.sizing.spine == "auto" else options.sizing.spine
        return size_stage(cfg, start, end, place, spine, options.sizing.expert_cache_bytes, end - start, sizing)
    budget = Budget(options.memory_bytes, options.host_memory_bytes)
    try:
        return grown(cfg, choose(cfg, start, end, place, budget, sizing), place, budget, sizing)
    except SizingError as e:
        raise OutOfMemory(str(e)) from None


def check_stage_held(ckpt: Checkpoint, start: int, end: int, top: bool, serves: Iterable[int] | None) -> None:
    """The stage's tensors are in the checkpoint, and (local experts) a partial download holds all of its layers'
    experts; a wide stage's share is checked where the plan is known (assigned.py)."""
    ckpt.raise_problems(layers=range(start, end), top=top)
    if serves is None:
        check_held(ckpt.model_dir, ckpt.config, start, end, None)


def converted_spine(ckpt: Checkpoint, start: int, end: int, plan: StagePlan, options: StageOptions,
                    device: torch.device) -> SpineFiles | None:
    """The converted spine a stage in a converted format's plan reads (converted first where it is missing, stale
    or partial; None where there is no room for it: the placer then quantizes as the layers load)."""
    if not spine_format(plan.spine).converted:
        return None
    why = (f"layers [{start}, {end}): {len(plan.resident_layers)} resident in {plan.spine}, "
           f"{len(plan.streamed_layers)} streamed")
    return prepare_spine(ckpt, plan.spine, stage_units(ckpt.config, start, end), why=why,
                         convert=options.convert, root=options.spine_dir, device=device)


def disk_plan(ckpt: Checkpoint, start: int, end: int, device: torch.device, options: StageOptions,
              experts: str, known: Mapping[str, Any] | None = None) -> StagePlan:
    """A stage's plan, following what the disk holds (nothing is written): a converted copy there is read, one
    missing is planned for where there is room to convert it, and without room the plan that needs none
    (`without_room`). `experts`: where the routed experts run (expert_backend_for); `known`: as plan_stage's."""
    on = "mlx" if experts == "mlx" else "torch"

    def plan(opts: StageOptions, **more: Any) -> StagePlan:
        return plan_stage(ckpt.config, start, end, device, opts, layer_spans(ckpt), on, {**(known or {}), **more})

    sizing = plan(options)
    if spine_format(sizing.spine).converted and sizing.converted:
        disk = spine_disk(ckpt, options.spine_dir)
        if not disk.ready(ckpt.config, sizing.spine, start, end):
            sizing = without_room(plan, options, sizing, disk, ckpt.config)
    return sizing


def plan_with_spine(ckpt: Checkpoint, start: int, end: int, device: torch.device, options: StageOptions,
                    experts: str, plan: StagePlan | None = None) -> tuple[StagePlan, SpineFiles | None]:
    """A stage's plan (`plan`, as the planner made it, else `disk_plan`) and the converted spine it reads, converted
    first where it is missing (where the room for it went since it was planned: the plan without a copy)."""
    sizing = plan if plan is not None else disk_plan(ckpt, start, end, device, options, experts)
    files = converted_spine(ckpt, start, end, sizing, options, device) if sizing.converted else None
    # the room went while this one looked
    if files is None and spine_format(sizing.spine).converted and sizing.converted:
        on = "mlx" if experts == "mlx" else "torch"
        bare, known = without_copy(options, sizing)
        sizing = plan_stage(ckpt.config, start, end, device, bare, layer_spans(ckpt), on, known)
        log.warning("no converted %s spine: %s", sizing.spine, sizing.spine_why)
    return sizing, files


def without_copy(options: StageOptions, planned: StagePlan) -> tuple[StageOptions, Mapping[str, Any]]:
    """The options, and what the plan knows (plan_stage's `known`), that plan `planned`'s stage again in its format
    without a converted copy: within the budget it was planned in where the options name none (a plan made
    elsewhere), for the same sequences and context."""
    budget = options.memory_bytes if options.memory_bytes is not None else planned.device_total
    wide = {"expert_layers": planned.expert_layers, "expert_share": planned.expert_share} if planned.wide else {}
    return (options.replace(memory_bytes=budget, spine=planned.spine, sequences=planned.sequences,
                            context=planned.context), {"converted": False, **wide})


def without_room(plan: Callable[..., StagePlan], options: StageOptions, chosen: StagePlan,
                 disk: SpineDisk, cfg: ModelConfig) -> StagePlan:
    """The plan when `chosen`'s format has no converted copy on the disk and no room to write one: with `--spine
    auto`, another format's copy that is there and fits (read at the disk's speed, never quantized at every start);
    else the plan that needs no copy (the format asked, or auto's without a copy: a format auto chooses for more
    than room, int8, quantized as the resident layers load, the streamed ones read as stored)."""
    a, b, fmt = chosen.start, chosen.end, chosen.spine
    lack = (f"no converted {fmt} copy of layers {a}-{b - 1} and no room to write one "
            f"({disk.missing_bytes(cfg, fmt, a, b) / 1e9:.1f} GB to write, {(disk.room or 0) / 1e9:.1f} GB free)")
    if options.sizing.spine == "auto":
        for other in (f for f in auto_spines() if spine_format(f).converted and f != fmt and disk.has(cfg, f, a, b)):
            try:
                s = plan(options.replace(spine=other))
            except OutOfMemory:
                continue
            why = (f"{lack}: the converted {other} copy on the disk is read ({other} costs "
                   f"{spine_format(other).quality} {QUALITY_SOURCE})")
            log.warning("spine %s: %s", other, why)
            return dataclasses.replace(s, spine_why=why)
    s = plan(options, converted=False)
    why = f"{lack}: {s.spine} quantized as the resident layers load, at every start" + (
        f"; {len(s.streamed_layers)} layers stream as stored" if s.streamed_layers else "")
    log.warning("spine %s: %s", s.spine, why)
    return dataclasses.replace(s, spine_why=why)


@dataclass(frozen=True)
class WeightPlacer:
    """Places a stage's spine tensors on `device` as sizing.py counts them (roles: see models/weights.py), in
    the plan's `spine` format."""

    device: torch.device
    dtype: torch.dtype  # activations
    spine: str
    mlx_q4: bool = False  # q4 matmuls run on MLX: its weights go to MLX's memory (one copy) instead of the device
    converted: bool = True  # streamed layers come in converted (else as stored, and stay so: sizing.converted)

    @classmethod
    def of(cls, plan: StagePlan, device: torch.device, dtype: torch.dtype) -> WeightPlacer:
        """The placer of a stage's plan: its format, on MLX where q4 matmuls run there, its streamed layers'."""
        mlx_q4 = spine_format(plan.spine).holds(Q4) and q4_on_mlx(device.type)
        return cls(device, dtype, plan.spine, mlx_q4, plan.converted)

    def place(self, t: Weight, role: str, resident: bool = True) -> Weight:
        if weight_format(t) is not None:  # read from a converted spine: only moved
            return self._moved(t)
        if role == "vector":
            return t.to(self.device, torch.float32)
        if role == "dense":
            return t.to(self.device, self.dtype)
        fmt = matrix_format(self.spine) if resident or self.converted else STORED
        held = None if fmt == STORED else held_format(fmt, role, tuple(t.shape))
        if held is not None:  # the spine's format, or the one it keeps this matrix in (formats.held_format)
            return self._moved(held.quantize(t))
        if t.dtype in (torch.bfloat16, torch.float16):  # as stored: fp32 activations multiply it directly
            return t if t.device == self.device else t.to(self.device)
        return t.to(self.device, self.dtype)

    def _moved(self, w: Weight) -> Weight:
        """A quantized weight on the device (a q4 one in MLX's memory where q4 matmuls run there)."""
        if self.mlx_q4 and isinstance(w, Q4Weight):
            from deltafin.kernels.mlx_q4 import mlx_resident  # lazily: the MLX path loads only where it runs

            return mlx_resident(w)
        return w.to(self.device)

    def place_streamed(self, t: torch.Tensor, role: str) -> Weight:
        return self.place(t, role, resident=False)


def open_experts(ckpt: Checkpoint, plan: StagePlan, options: StageOptions, device: torch.device,
                 layers: Iterable[int] | Want, backend: str,
                 progress: Callable[[str, float], None] | None = None) -> ExpertProvider:
    """The routed experts of `layers` as the plan says: streamed through a cache (from the model's disk and any
    `expert_dir`; with `expert_heat_dir`, warmed at start with the experts most used before; in an expert mode that
    reads a low-bit copy, with the copy of what it serves: `layers` by layer, a wide worker's share of each, else
    all, converted first where missing, `progress` hearing how far), or resident (on MLX, or torch)."""
    cfg, low = ckpt.config, options.mode.low_bit
    want = layers if isinstance(layers, Mapping) else whole_layers(cfg, layers)
    layers = sorted(want)
    if plan.streaming:
        copy = prepare_copy(ckpt, low, want, convert=options.convert, device=device, report=progress) if low else None
        copies = [open_copy(ckpt, d) for d in options.expert_dir]
        speeds = options.disk_gbps
        if speeds is None and copies:
            speeds = tuple(measure_disk(c, options.sizing.read_threads, options.io) for c in (ckpt, *copies))
            log.info("expert disks: %s", ", ".join(f"{c.model_dir} {g:.2f} GB/s"
                                                    for c, g in zip((ckpt, *copies), speeds, strict=True)))
        demand_layers = 2 if plan.wide and not plan.holder_only else 1
        heat = ExpertHeat.for_checkpoint(options.expert_heat_dir, ckpt) if options.expert_heat_dir else None
        if heat is not None and low and options.mode.low_tail is None:
            heat.warm_ids_from = cfg.num_experts  # every expert is read from its copy: warm the copies
        return ExpertStore(ckpt, layers, device=device, cache_bytes=plan.expert_cache, io=options.io,
                           threads=options.sizing.read_threads, policy=options.cache_policy, prefetch=options.prefetch,
                           backend=backend, act=activation(cfg), copies=copies, disk_gbps=speeds,
                           demand_layers=demand_layers, heat=heat, low=copy)
    if backend == "mlx":
        from deltafin.weights.mlx_slots import MLXResidentExperts  # lazily: the MLX path loads only where it runs

        return MLXResidentExperts(ckpt, layers, activation(cfg), io=options.io)
    return ResidentExperts(ckpt, layers, device, io=options.io, low=low_bit_format(low) if low else None)


def expert_backend_for(cfg: ModelConfig, device: torch.device, mode: ExpertMode | None = None) -> str:
    """torch or mlx (kernels.linear.expert_backend), MLX only once it passed its self-check, and not in an expert
    mode that reads a low-bit copy (MLX's one call over a layer's experts takes one format: those run expert by
    expert, each matrix through `linear`, whose MLX fast path multiplies the copy's 3-bit groups)."""
    if not cfg.moe_layers or expert_backend(device.type) != "mlx" or (mode is not None and mode.low_bit):
        return "torch"
    from deltafin.kernels.mlx_moe import verified  # lazily: the MLX path loads only where it runs

    return "mlx" if verified(activation(cfg)) else "torch"


def state_identity(ckpt: Checkpoint, start: int, end: int, device: torch.device, options: StageOptions,
                   plan: StagePlan, expert_backend: str) -> str:
    """What a kept state's numbers depend on, as one name: the checkpoint, the layers, the activation dtype, the
    device, each layer's spine format (a converted one's recipe), where the routed experts run and the kernels
    that multiply (their rounding differs), and an expert mode other than exact. A state is resumed only by a stage
    of the same identity: a kept prompt computed with a bf16 spine is never continued (nor its logits reused) by a
    q4 one, nor one computed with top-p experts by an exact stage."""
    dtype = str(options.torch_dtype).removeprefix("torch.")
    numbers = {"formats": spine_layout(plan), "recipe": RECIPE if spine_format(plan.spine).converted else None,
               "experts": f"mxfp4 on {expert_backend}", "kernels": kernel_family(device.type),
               "wide": plan.wide}
    if options.expert_mode != EXACT:
        numbers["expert_mode"] = options.expert_mode
    if options.mode.low_bit:  # the copy's rounding
        numbers["expert_copy"] = low_bit_format(options.mode.low_bit).recipe
    digest = hashlib.blake2b(json.dumps(numbers, sort_keys=True).encode(), digest_size=6).hexdigest()
    return f"{fingerprint(ckpt.model_dir)}-{start}-{end}-{dtype}-{device.type}-{plan.spine}-{digest}"


def spine_layout(plan: StagePlan) -> str:
    """Each of the stage's layers' matrix format, as ranges: "q4 0-7", "int8 0-4, stored 5-92"."""
    formats = [(i, matrix_format(plan.spine)) for i in plan.resident_layers]
    streamed = matrix_format(plan.spine) if plan.converted else STORED
    formats += [(i, streamed) for i in plan.streamed_layers]
    by_format: dict[str, list[int]] = {}
    for i, fmt in sorted(formats):
        by_format.setdefault(fmt, []).append(i)
    return ", ".join(f"{fmt} {id_ranges(layers)}" for fmt, layers in by_format.items())


def prefix_disk_for(ckpt: Checkpoint, device: torch.device, options: StageOptions, plan: StagePlan,
                    identity: str) -> PrefixDisk | None:
    """Where a stage's kept prefixes go on the disk (`prefix_dir`), in a folder of the stage's `identity`, within
    `prefix_disk_bytes` (default: the model's, at the planned context: kept_prefixes.default_prefix_disk_bytes)."""
    budget = options.prefix_disk_bytes
    if budget is None:
        budget = default_prefix_disk_bytes(ckpt.config, plan.context, options.act_bytes)
    if not options.prefix_dir or not budget or not plan.prefixes:
        return None
    return PrefixDisk(options.prefix_dir, identity, budget, device)
