"""Layer partition across workers (pure): contiguous ranges, sized by memory and disk bandwidth, only from
layers each worker holds, with an explanation table; with wide experts, also the placement of every MoE
layer's routed experts over the workers that hold their bytes (deltafin/plan/cluster/expert_placement.py).

Every candidate stage is sized by sizing.choose on that worker's device and budget (the same function the
worker's stage runs on the assignment), so a plan that fits here fits there. Cost of a stage per token =
(expected expert bytes missed + spine bytes streamed) / the worker's disk bandwidth. For one sequence the
stages run one after another, so the plan minimizes the sum; ties (e.g. equal disks) are broken toward
memory-proportional ranges.

Wide experts (`experts="wide"`): every worker's expert store serves its share of every MoE layer it holds, so
the expert reads of a token are spread over all the disks and a stage's cost is only the spine it streams.
Workers that take no layers still serve experts when their memory holds the working set. Shares follow each
disk's speed and each cache (placement.cache_aware_weights), and the prediction is, per MoE layer, the slowest
holder's reads, plus one round trip and the outputs over the network per layer, plus the spine streamed.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import cache

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import id_ranges
from deltafin.errors import DeltafinError, PlanError, SizingError
from deltafin.formats import spine_format
from deltafin.plan.cluster.cluster_plan import (
    GB,
    ClusterPlan,
    PlannedStage,
    WorkerCapacity,
    stage_placement,
)
from deltafin.plan.cluster.expert_placement import ExpertRanges, cache_aware_weights
from deltafin.plan.cluster.links import Links
from deltafin.plan.memory.context import at_context, context_why, cost_per_1k, longest_context
from deltafin.plan.memory.holder_sizing import choose_holder
from deltafin.plan.memory.kept_prefixes import kept_prefixes_text
from deltafin.plan.memory.layer_table import model_spines
from deltafin.plan.memory.least import too_small
from deltafin.plan.memory.sizing import Placement, SizingInput, choose
from deltafin.plan.memory.spine_choice import asked_spine, choose_spine
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.plan.memory.stage_plan import Budget, StagePlan
from deltafin.plan.timing.predict import PROMPT_LENGTHS, prefill_seconds, token_seconds, verify_table

log = logging.getLogger(__name__)

def plan_layers(cfg: ModelConfig, workers: list[WorkerCapacity], options: SizingInput | None = None,
                act_bytes: int = 4, experts: str = "local", links: Links | None = None) -> ClusterPlan:
    """Contiguous ranges covering every layer once, in the given worker order (workers that cannot
    usefully take layers are left out, or with wide experts serve experts only). Raises PlanError with the reason
    when no plan exists. `experts`: "local" (each stage reads its own layers' experts) or "wide". `links`: the
    cluster's, as measured (plan/cluster/links.py; None: all assumed), priced in every stage's cost and the predictions.

    The spine format is one for the whole cluster: with `spine="auto"`, bf16 if the cluster holds all of it
    resident, else row-int8 if it holds all of that, else q4 (and whatever q4 does not fit streams, as converted);
    each stage's sizing says why (`spine_why`), and the log once."""
    if not workers:
        raise PlanError("no workers to plan over")
    if experts not in ("wide", "local"):
        raise PlanError(f"unknown expert placement {experts!r}: wide or local")
    opts = options or SizingInput()
    wide = experts == "wide"
    if wide and not cfg.moe_layers:
        wide = False  # nothing to spread
    links = links or Links()
    plan, why, opts = _in_cluster_spine(cfg, workers, opts, act_bytes, wide)
    if plan is not None and plan.wide and len(plan.workers) < 2:  # workers refuse a plan of one holder
        log.warning("wide experts need two workers or more to spread over; %s computes its own layers' experts",
                    plan.workers[0].worker)
        plan, why, opts = _in_cluster_spine(cfg, workers, options or SizingInput(), act_bytes, False)
    if plan is None:
        raise PlanError(_why_not(cfg, workers, opts, act_bytes))
    streamed = [s.plan for s in plan.stages if s.plan.streamed_layers]
    if streamed:
        why += (f"; {sum(len(z.streamed_layers) for z in streamed)} layers still stream, read as "
                f"{'converted' if opts.converted and spine_format(opts.spine).converted else 'stored'} "
                f"({sum(z.spine_bytes_per_token for z in streamed) / GB:.1f} GB a token)")
    log.info("spine %s on %d stage(s): %s", opts.spine, len(plan.stages), why)
    stages = tuple(replace(s, plan=replace(s.plan, spine_why=why)) for s in plan.stages)
    plan = _with_context(cfg, replace(plan, stages=stages, links=links), workers, opts, act_bytes)
    kept = kept_prefixes_text(cfg, [(s.start, s.end, s.plan.prefixes) for s in plan.stages], act_bytes,
                              plan.context)
    return replace(plan, token=token_seconds(cfg, plan, act_bytes), verify=verify_table(cfg, plan, act_bytes),
                   kept_prefixes=kept,
                   first_token=tuple((n, prefill_seconds(cfg, plan, n, act_bytes=act_bytes)) for n in PROMPT_LENGTHS))


def _with_context(cfg: ModelConfig, plan: ClusterPlan, workers: list[WorkerCapacity], opts: SizingInput,
                  act_bytes: int) -> ClusterPlan:
    """The plan at the one context its stages share: as asked (--max-context), else the least of the longest
    each stage's memory holds with nothing else of its plan changed (plan/memory/context.py)."""
    by_key = {w.key: w for w in workers}
    sized = []
    for s in plan.stages:
        w = by_key[s.key]
        wide = {"expert_layers": s.plan.expert_layers, "expert_share": s.plan.expert_share} if plan.wide else {}
        sized.append((s, stage_placement(w, act_bytes, opts), w.budget, replace(opts, disks=w.disks, **wide)))
    context = opts.context or min(longest_context(cfg, s.plan, place, budget, o) for s, place, budget, o in sized)
    stages = tuple(s if s.plan.context == context else replace(s, plan=at_context(cfg, s.plan, place, o, context))
                   for s, place, _, o in sized)
    more = max(cost_per_1k(cfg, z.plan, place, o) for z, (_, place, _, o) in zip(stages, sized, strict=True))
    return replace(plan, stages=stages, context=context, context_why=context_why(cfg, opts, context, more))


def _in_cluster_spine(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingInput, act_bytes: int,
                      wide: bool) -> tuple[ClusterPlan | None, str, SizingInput]:
    """The cheapest plan in the cluster's spine format, why that format, and the options with it
    (plan/memory/spine_choice.py: as asked, by the coordinator or the workers; else by memory and what the disks
    hold)."""
    spine, asked = asked_spine(opts.spine, [(w.name, w.spine) for w in workers])
    by_key = {w.key: w for w in workers}

    def unready(plan: ClusterPlan, fmt: str) -> list[str]:
        disks = [(s.worker, by_key[s.key].spine_disk) for s in plan.stages]
        return [name for (name, disk), s in zip(disks, plan.stages, strict=True)
                if disk is not None and not disk.ready(cfg, fmt, s.start, s.end)]

    return choose_spine(replace(opts, spine=spine),
                        lambda o, whole: _plan(cfg, workers, o, act_bytes, whole, wide), unready,
                        asked or "as asked (--spine)", model_spines(cfg))


def _expert_layers(cfg: ModelConfig, w: WorkerCapacity) -> int:
    return sum(1 for layer in cfg.moe_layers if w.holds_experts(layer))


def _wide_options(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingInput) -> list[SizingInput]:
    """Each worker's sizing options with wide experts, its share first guessed from its disk speed alone."""
    speed = sum(w.expert_speed for w in workers if _expert_layers(cfg, w)) or 1.0
    return [replace(opts, expert_layers=_expert_layers(cfg, w), disks=w.disks,
                    expert_share=w.expert_speed / speed if _expert_layers(cfg, w) else 0.0) for w in workers]


def _plan(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingInput, act_bytes: int,
          resident_only: bool, wide: bool) -> ClusterPlan | None:
    """The cheapest plan in one spine format (with `resident_only`, stages that stream spine are left out)."""
    n = cfg.num_layers
    per_worker = _wide_options(cfg, workers, opts) if wide else [replace(opts, disks=w.disks) for w in workers]

    @cache
    def sized(place: Placement, budget: Budget, o: SizingInput, a: int, b: int) -> StagePlan | None:
        try:
            return choose(cfg, a, b, place, budget, o)
        except SizingError:
            return None

    def size(i: int, a: int, b: int) -> StagePlan | None:  # (workers alike share their stages' plans)
        return sized(stage_placement(workers[i], act_bytes, opts), workers[i].budget, per_worker[i], a, b)

    # best[i][b]: (cost, stages) covering layers [0, b) with the first i workers
    best: list[list[tuple[float, tuple[PlannedStage, ...]] | None]] = [[None] * (n + 1)
                                                                     for _ in range(len(workers) + 1)]
    best[0][0] = (0.0, ())
    for i, w in enumerate(workers):
        for b in range(n + 1):
            cand = best[i][b]  # skip this worker
            for a in range(b - 1, -1, -1):  # longer ranges need at least as much memory: stop at the first miss
                before = best[i][a]
                if not w.holds(a, b):
                    break
                if before is None or ((a == 0 or b == n) and not w.has_top):
                    continue
                sizing = size(i, a, b)
                if sizing is None or (resident_only and sizing.streamed_layers):
                    break
                stage, cost = _candidate(w, a, b, sizing, wide)
                if cand is None or before[0] + cost < cand[0]:
                    cand = (before[0] + cost, (*before[1], stage))
            best[i + 1][b] = cand
    done = best[len(workers)][n]
    if done is None:
        return None
    return _place_experts(cfg, workers, done[1], per_worker, act_bytes) if wide else ClusterPlan(done[1])


def _candidate(w: WorkerCapacity, a: int, b: int, plan: StagePlan, wide: bool) -> tuple[PlannedStage, float]:
    """A stage of layers [a, b) on `w` and its cost: its reads' seconds (with wide experts only its spine's: the
    experts are read by every holder), and a tie-break that is least when spines follow memory. (Its hop over its
    link is left to the predictions: an extra stage costs a round trip, and buys memory.)"""
    read = plan.spine_bytes_per_token + (0 if wide else plan.expert_bytes_per_token)
    seconds = read / (max(w.disk_gbps, 1e-3) * GB)
    stage = PlannedStage(w.name, w.address, a, b, plan, seconds, w.worker_id, w.memory_bytes, w.host_memory_bytes,
                      w.disk_gbps, w.expert_speed, w.compute)
    weight = plan.layers + plan.top + plan.spine_bytes_per_token  # sum of spine^2 / memory
    return stage, seconds + 1e-2 * weight ** 2 / max(1, w.memory_bytes) / GB


def _place_experts(cfg: ModelConfig, workers: list[WorkerCapacity], stages: tuple[PlannedStage, ...],
                   per_worker: list[SizingInput], act_bytes: int) -> ClusterPlan:
    """Wide experts over the plan's stages and the workers left without layers that can hold the working set of
    an expert holder: shares by disk speed and cache, the stages sized again with them, the prediction."""
    index = {w.key: i for i, w in enumerate(workers)}
    holders = []
    for i, w in enumerate(workers):
        if w.key in {s.key for s in stages} or not per_worker[i].expert_layers:
            continue
        try:
            z = choose_holder(cfg, stage_placement(w, act_bytes, per_worker[i]), w.budget, per_worker[i])
        except SizingError:
            continue
        holders.append(PlannedStage(w.name, w.address, 0, 0, z, 0.0, w.worker_id, w.memory_bytes, w.host_memory_bytes,
                                 w.disk_gbps, w.expert_speed, w.compute))
    members = [*stages, *holders]
    caps = [workers[index[m.key]] for m in members]
    slot = expert_slot_bytes(cfg)
    held = [min(1.0, m.plan.expert_cache // slot / (m.plan.expert_layers * cfg.num_experts))
            if m.plan.expert_layers else 0.0 for m in members]
    weights = cache_aware_weights([c.expert_speed if m.plan.expert_layers else 0.0 for c, m in
                                   zip(caps, members, strict=True)], held)
    placement = ExpertRanges.build([m.key for m in members], cfg.moe_layers, cfg.num_experts,
                                      lambda i, layer: weights[i] if caps[i].holds_experts(layer) else 0.0)
    sized = []
    tokens = min(m.plan.forward_tokens for m in members)  # a holder serves calls of the stages' forwards
    for i, (m, c) in enumerate(zip(members, caps, strict=True)):
        layers = m.plan.expert_layers
        share = placement.count(i) / (layers * cfg.num_experts) if layers else 0.0
        o = replace(per_worker[index[m.key]], expert_share=share, prefill_chunk=tokens)
        place = stage_placement(c, act_bytes, o)
        z = choose_holder(cfg, place, c.budget, o) if m.plan.holder_only else choose(cfg, m.start, m.end, place,
                                                                                       c.budget, o)
        seconds = (z.expert_bytes_per_token / max(c.expert_speed, 1e-3) + z.spine_bytes_per_token
                   / max(c.disk_gbps, 1e-3)) / GB
        sized.append(replace(m, plan=z, seconds_per_token=seconds))
    return ClusterPlan(tuple(sized[:len(stages)]), tuple(sized[len(stages):]), placement)


def _why_not(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingInput, act_bytes: int) -> str:
    have = set()
    for w in workers:
        for a, b in w.layers:
            have.update(range(a, b))
    missing = [i for i in range(cfg.num_layers) if i not in have]
    if missing:
        damage = "; ".join(f"{w.name} ({w.address or w.key}) has them but cannot serve them: {d}"
                           for w in workers for d in w.damaged)
        if damage:
            return f"no worker holds layers {id_ranges(missing)}: {damage}"
        return (f"no worker holds layers {id_ranges(missing)}: copy them to a worker's disk or add a worker that has "
                "them")
    if not any(w.has_top for w in workers):
        return "no worker holds the embedding/head shard: the first and last stages need it"
    held = [(w.name, w.memory_bytes, stage_placement(w, act_bytes, opts), [i for a, b in w.layers for i in range(a, b)],
             w.has_top, _expert_layers(cfg, w)) for w in workers]
    small = too_small(cfg, held, opts)
    if small is not None:  # not even its smallest stage fits: more workers would not help it
        return small
    biggest = max(workers, key=lambda w: w.memory_bytes)
    try:  # the smallest useful stage on the largest worker: one layer with the embedding
        choose(cfg, 0, 1, stage_placement(biggest, act_bytes, opts), biggest.budget, opts)
    except SizingError as e:
        return f"the cluster cannot hold the model's working set: on {biggest.name}, {e}"
    return (f"the workers' memory ({', '.join(f'{w.name} {w.memory_bytes / GB:.1f} GB' for w in workers)}) cannot "
            f"hold all {cfg.num_layers} layers with their working sets: add memory or workers")


def split_layers(cfg: ModelConfig, n: int) -> list[tuple[int, int]]:
    """Split the layers into n contiguous, near-equal ranges (the in-process `--stages N`)."""
    if not 1 <= n <= cfg.num_layers:
        raise DeltafinError(f"--stages must be between 1 and the number of layers ({cfg.num_layers})")
    bounds = [round(i * cfg.num_layers / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]
