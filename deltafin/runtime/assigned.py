"""What a worker computes with once assigned: its stage (when it has layers), and with wide experts its expert
store, the holder that serves other stages' calls from it, and its stage's router over every holder.

A new assignment of the same layers with the same options and plan (a re-plan that left this worker alone, or only the
placement of the experts changed: a holder was lost or joined) keeps the stage, its sessions and its store, and
only re-points them; anything else loads afresh. Pure of transport: the other holders come in as `peers`
(worker/peers.py over gRPC, or wide.LocalPeer in one process).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.manifest import check_held
from deltafin.checkpoint.shards import Checkpoint
from deltafin.errors import NotAssigned, OutOfMemory, SizingError
from deltafin.plan.cluster.expert_placement import ExpertPlacement
from deltafin.plan.memory.holder_sizing import choose_holder, size_holder
from deltafin.plan.memory.sizing import Placement
from deltafin.plan.memory.stage_plan import Budget, StagePlan
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_build import ExpertProvider, disk_plan, expert_backend_for, open_experts
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.wide import ExpertHolder, Peer, WideExperts, wide_stats
from deltafin.runtime.worker_stats import StageStats
from deltafin.weights.reader import layer_spans

log = logging.getLogger(__name__)


@dataclass
class Assigned:
    start: int
    end: int
    options: StageOptions
    stage: Stage | None  # None: an expert holder only
    experts: ExpertPlacement | None = None  # None: local experts
    store: ExpertProvider | None = None  # the expert store (wide: the worker's share of every layer it holds)
    holder: ExpertHolder | None = None
    plan: StagePlan | None = None

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    def stats(self, me: str) -> StageStats:
        """The stage's counters (or the holder's store's), with wide experts' own and others' figures."""
        if self.stage is not None:
            stats = self.stage.stats()  # with the plan it holds
        elif self.store is not None and hasattr(self.store, "snapshot_stats"):
            stats = StageStats(experts=self.store.snapshot_stats().totals(),  # type: ignore[attr-defined]
                               disks=tuple(self.store.disk_stats()), plan=self.plan)  # type: ignore[attr-defined]
        else:
            stats = StageStats(plan=self.plan)
        if self.experts is not None and self.store is not None and self.holder is not None:
            index = self.experts.ranges.index(me)
            share = self.experts.ranges.describe(index) if index is not None else "none"
            wide = wide_stats(self.store, self.holder, self.stage.wide if self.stage else None, self.layers, share)
            stats = dataclasses.replace(stats, wide=wide)
        return stats

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()
        elif self.store is not None:
            self.store.close()


def _same_load(old: Assigned, options: StageOptions, plan: StagePlan | None) -> bool:
    """`old` loaded what this assignment asks for: the same options, and the same plan where one is given (the
    planned share of experts only changes expectations; none given: the stage plans itself as `old` did)."""
    if old.options != options:
        return False
    return plan is None or (old.plan is not None and _unshared(old.plan) == _unshared(plan))


def _unshared(plan: StagePlan) -> StagePlan:
    return dataclasses.replace(plan, expert_share=0.0, expert_bytes_per_token=0, spine_why="")


def assign(ckpt: Checkpoint, start: int, end: int, device: torch.device, options: StageOptions,
           plan: StagePlan | None, experts: ExpertPlacement | None, me: str, peers: Mapping[str, Peer],
           old: Assigned | None, progress: Callable[[str, float], None] | None = None) -> Assigned:
    """Load (or keep from `old`) what the assignment asks for: the stage `sizing` plans (checked already:
    plan/memory/stage_check.py), or with None the one this worker plans within its own budget; `old` is closed unless
    kept."""
    cfg = ckpt.config
    if experts is None:
        return _local(ckpt, start, end, device, options, plan, old, progress)
    index = experts.ranges.index(me)
    if index is None:
        raise NotAssigned(f"the expert plan does not name this worker ({me}): the coordinator must include it")
    serves = experts.ranges.layers_of(index)
    shares = {i: experts.ranges.share(index, i) for i in serves}
    check_held(ckpt.model_dir, cfg, start, end, shares)
    known = wide_known(experts, index)  # to plan it here
    if old is not None and old.experts is not None and (old.start, old.end) == (start, end) and \
            _same_load(old, options, plan):
        assert old.store is not None
        stage, store, plan = old.stage, old.store, old.plan
        store.set_layers(serves)  # type: ignore[attr-defined]
        log.info("kept layers %s and the expert store; the experts' placement changed", _span(start, end))
    else:
        if old is not None:
            old.close()
        if end > start:
            backend = expert_backend_for(cfg, device, options.mode)
            plan = plan or disk_plan(ckpt, start, end, device, options, backend, known)
            stage = Stage(ckpt, start, end, device=device, options=options, plan=plan, progress=progress,
                          serves=shares)
            store, plan = stage.experts, stage.plan
        else:
            stage, plan = None, plan or holder_plan(ckpt, device, options, known)
            log.info("expert holder on %s: %s", device, plan.describe())
            store = open_experts(ckpt, plan, options, device, shares, expert_backend_for(cfg, device, options.mode),
                                 progress)
    holder = ExpertHolder(cfg, store, device, options.torch_dtype)  # type: ignore[arg-type]
    if stage is not None:
        stage.set_wide(_wide(cfg, experts, me, store, peers, options.wire == "bf16"))
    return Assigned(start, end, options, stage, experts, store, holder, plan)


def _wide(cfg: ModelConfig, experts: ExpertPlacement, me: str, store: Any, peers: Mapping[str, Peer],
          lossy: bool) -> WideExperts:
    """The stage side of `plan` on holder `me`: the other holders as its peers, a prompt's calls divided by the
    plan's speeds and links."""
    others = {h: p for h, p in peers.items() if h != me}
    names = {h.key: h.name or h.address for h in experts.holders}
    row_bytes = cfg.expert_dim * (2 if lossy else 4)
    prompts = experts.prompt_split(me, cfg.experts_per_token, cfg.bytes_per_expert, row_bytes)
    return WideExperts(cfg, experts.ranges, me, store, others, names, lossy=lossy, prompts=prompts)


def wide_known(experts: ExpertPlacement, index: int) -> dict[str, Any]:
    """What a stage's plan knows of holder `index`'s part of a wide plan (plan_stage's `known`), where the worker
    plans the stage itself: the MoE layers its store serves and its share of their experts."""
    return {"expert_layers": len(experts.ranges.layers_of(index)), "expert_share": experts.ranges.fraction(index)}


def _local(ckpt: Checkpoint, start: int, end: int, device: torch.device, options: StageOptions,
           plan: StagePlan | None, old: Assigned | None,
           progress: Callable[[str, float], None] | None) -> Assigned:
    """A stage computing its own layers' experts: `old` kept if it is the same assignment, else closed."""
    if old is not None and old.experts is None and (old.start, old.end) == (start, end) and \
            _same_load(old, options, plan):
        log.info("kept layers %s with their caches: the same assignment", _span(start, end))
        return old
    if old is not None:
        old.close()
    stage = Stage(ckpt, start, end, device=device, options=options, plan=plan, progress=progress)
    return Assigned(start, end, options, stage, store=stage.experts, plan=stage.plan)


def holder_plan(ckpt: Checkpoint, device: torch.device, options: StageOptions,
                  known: Mapping[str, Any]) -> StagePlan:
    """The memory plan of a worker that only serves experts (`known`: its part of the wide plan, plan_stage's):
    within its budget, or (none) the cache it is given."""
    place = Placement(device.type, options.act_bytes,
                      "mlx" if expert_backend_for(ckpt.config, device, options.mode) == "mlx" else "torch")
    inputs = options.sizing_for(ckpt.config, layer_spans(ckpt), **known)
    if options.memory_bytes is None:
        return size_holder(ckpt.config, place, options.sizing.expert_cache_bytes or 0, inputs)
    try:
        return choose_holder(ckpt.config, place, Budget(options.memory_bytes, options.host_memory_bytes), inputs)
    except SizingError as e:
        raise OutOfMemory(str(e)) from None


def _span(start: int, end: int) -> str:
    return f"{start}-{end - 1}" if end > start else "(none: an expert holder)"
