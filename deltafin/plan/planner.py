"""Layer partition across workers (pure): contiguous ranges, sized by memory and disk bandwidth, only from
layers each worker holds, with an explanation table; with wide experts, also the placement of every MoE
layer's routed experts over the workers that hold their bytes (deltafin/plan/expert_placement.py).

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
from dataclasses import dataclass, replace
from functools import cache

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import id_ranges
from deltafin.errors import PlanError, SizingError
from deltafin.plan.expert_placement import ExpertPlacement, cache_aware_weights
from deltafin.plan.holder_sizing import choose_holder
from deltafin.plan.kept_prefixes import kept_prefixes_text
from deltafin.plan.least import too_small
from deltafin.plan.sizing import (
    Budget,
    Placement,
    SizingOptions,
    StageSizing,
    choose,
    expert_slot_bytes,
)
from deltafin.plan.spine_choice import asked_spine, choose_spine
from deltafin.plan.spine_copies import SpineDisk

log = logging.getLogger(__name__)

GB = 1e9
# wide experts: what one MoE layer's expert calls cost on the network (assumed, not measured on Macs): a round
# trip on a wired LAN or a Thunderbolt bridge (PERF.md: 0.1-0.5 ms) and the outputs back at 10 Gbit/s
EXPERT_CALL_RTT_S = 0.0005
LINK_BYTES_PER_S = 1.25e9

@dataclass(frozen=True)
class WorkerCapacity:
    name: str  # for display
    memory_bytes: int  # the stage's budget: device memory on a GPU, RAM on a CPU or a Mac
    disk_gbps: float
    layers: tuple[tuple[int, int], ...]  # [start, end) ranges on its disk
    has_top: bool  # embedding/head present
    address: str = ""
    device: str = "cpu"  # device type: cpu | cuda | mps
    host_memory_bytes: int | None = None  # RAM beside a discrete GPU
    worker_id: str = ""  # unique per worker process (names need not be)
    expert_layers: tuple[tuple[int, int], ...] | None = None  # ranges whose experts it can read (None: `layers`)
    expert_gbps: float = 0.0  # its expert disks together (0: disk_gbps)
    disks: int = 1  # disks it reads experts from
    damaged: tuple[str, ...] = ()  # damaged shards on its disk ("FILE: layers A-B"), for the plan's errors
    spine: str = "auto"  # the format it was started with (--spine): the plan honours it or refuses
    spine_disk: SpineDisk | None = None  # the converted spines on its disk (None: not known, taken as writable)

    @property
    def key(self) -> str:
        """What identifies the worker: its id, else its address, else its name."""
        return self.worker_id or self.address or self.name

    def holds(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self.layers)

    def holds_experts(self, layer: int) -> bool:
        return any(a <= layer < b for a, b in (self.layers if self.expert_layers is None else self.expert_layers))

    @property
    def expert_speed(self) -> float:
        return self.expert_gbps or self.disk_gbps

    @property
    def budget(self) -> Budget:
        return Budget(self.memory_bytes, self.host_memory_bytes)


@dataclass(frozen=True)
class StagePlan:
    worker: str
    address: str
    start: int
    end: int
    sizing: StageSizing
    seconds_per_token: float
    worker_id: str = ""
    memory_bytes: int = 0  # the worker's budget the stage was sized against
    host_memory_bytes: int | None = None
    disk_gbps: float = 0.0  # its model disk (the spine streams from it)
    expert_gbps: float = 0.0  # its expert disks together (0: disk_gbps)

    @property
    def key(self) -> str:
        return self.worker_id or self.address or self.worker

    @property
    def spine_bytes(self) -> int:
        """Resident spine (layers and top) as placed."""
        return self.sizing.layers + self.sizing.top

    @property
    def streamed_bytes(self) -> int:
        """Spine bytes read per token (layers that do not stay resident)."""
        return self.sizing.spine_bytes_per_token

    @property
    def cache_bytes(self) -> int:
        return 0 if self.sizing.experts_resident else self.sizing.expert_cache

    @property
    def expert_bytes_per_token(self) -> int:
        return self.sizing.expert_bytes_per_token


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    holders: tuple[StagePlan, ...] = ()  # wide experts: workers with no layers, serving their share (start == end)
    experts: ExpertPlacement | None = None  # wide experts: who computes which routed experts
    predicted_seconds: float | None = None  # wide experts: a token with every disk reading in parallel
    first_token: tuple[tuple[int, float], ...] = ()  # (prompt tokens, seconds to the first token), predicted
    kept_prefixes: str = ""  # what a kept prefix costs, where states are kept (sizing.kept_prefixes_text)
    context: int = 0  # tokens a request may have (prompt and reply): what the sessions were planned for

    @property
    def wide(self) -> bool:
        return self.experts is not None

    @property
    def workers(self) -> tuple[StagePlan, ...]:
        return self.stages + self.holders

    @property
    def seconds_per_token(self) -> float:
        if self.predicted_seconds is not None:
            return self.predicted_seconds
        return sum(s.seconds_per_token for s in self.stages)

    def table(self) -> str:
        text = self._wide_table() if self.wide else self._table()
        text += self._parts()
        if self.first_token:
            step = min(s.sizing.forward_tokens for s in self.stages)
            text += ("\ntime to first token (predicted from bytes and disk speeds, in forwards of "
                     f"{step} tokens): " + ", ".join(f"{n // 1024}K {_minutes(t)}" for n, t in self.first_token))
        if self.context:
            text += (f"\ncontext: {self.context:,} tokens a request (prompt and reply; --max-context plans for more, "
                     "each 1,024 tokens more taking its MLA latents' room in every sequence's caches)")
        if self.kept_prefixes:
            text += "\n" + self.kept_prefixes
        return text

    def _parts(self) -> str:
        """Why the spine format, and what each part of each worker's memory takes (GB): the plan's trade."""
        first = self.stages[0].sizing if self.stages else None
        lines = [f"\nspine {first.spine}: {first.spine_why}"] if first is not None and first.spine_why else []
        lines += [f"  {s.worker}: {s.sizing.forward_tokens:,}-token forwards, {s.sizing.sequences} sequence(s); "
                  f"{s.sizing.parts()}" for s in self.workers]
        return "\n".join(["", *lines]) if lines else ""

    def _wide_table(self) -> str:
        assert self.experts is not None
        head = (f"{'worker':<16} {'address':<21} {'dev':<5} {'layers':>7} {'spine':>11} {'resident':>9} "
                f"{'experts':>13} {'cache GB':>8} {'total/budget GB':>16} {'exp GB/tok':>10} {'spine GB/tok':>12} "
                f"{'disk s/tok':>10}")
        rows = [head]
        for s in self.workers:
            z = s.sizing
            layers = "-" if z.holder_only else f"{s.start}-{s.end - 1}"
            spine = "-" if z.holder_only else f"{z.spine} {len(z.resident_layers)}/{z.end - z.start}"
            share = self.experts.describe(self.experts.holders.index(s.key))
            rows.append(f"{s.worker[:16]:<16} {s.address[:21]:<21} {z.device:<5} {layers:>7} {spine:>11} "
                        f"{s.spine_bytes / GB:>9.2f} {share:>13} {z.expert_cache / GB:>8.2f} "
                        f"{f'{z.device_total / GB:.1f}/{s.memory_bytes / GB:.1f}':>16} "
                        f"{z.expert_bytes_per_token / GB:>10.3f} {z.spine_bytes_per_token / GB:>12.3f} "
                        f"{s.seconds_per_token:>10.3f}")
        experts = sum(s.sizing.expert_bytes_per_token for s in self.workers) / GB
        spine = sum(s.sizing.spine_bytes_per_token for s in self.workers) / GB
        rows.append(f"{'total (wide)':<16} {'':<21} {'':<5} {'':>7} {'':>11} "
                    f"{sum(s.spine_bytes for s in self.workers) / GB:>9.2f} {'':>13} {'':>8} {'':>16} "
                    f"{experts:>10.3f} {spine:>12.3f} {self.seconds_per_token:>10.3f}")
        rows.append("wide experts: every worker reads and computes its share of every MoE layer's routed experts for "
                    "every stage (experts: of a layer's, x layers); cache GB: its expert cache")
        rows.append("exp/spine GB/tok: what its disks read per token; disk s/tok: that at their speed; total: s/token "
                    "with every disk reading at once (per MoE layer the slowest holder's expected reads, plus "
                    f"{EXPERT_CALL_RTT_S * 1e3:.1f} ms a round trip and the outputs at "
                    f"{LINK_BYTES_PER_S * 8 / 1e9:.0f} Gbit/s)")
        return "\n".join(rows)

    def _table(self) -> str:
        head = (f"{'worker':<16} {'address':<21} {'dev':<5} {'layers':>7} {'spine':>11} {'resident':>9} "
                f"{'experts':>9} {'sessions':>8} {'total/budget GB':>16} {'GB/token':>9} {'s/token':>8}")
        rows = [head]
        for s in self.stages:
            z = s.sizing
            spine = f"{z.spine} {len(z.resident_layers)}/{z.end - z.start}"
            experts = "resident" if z.experts_resident else f"{z.expert_cache / GB:.2f} c"
            per_token = (z.expert_bytes_per_token + z.spine_bytes_per_token) / GB
            rows.append(f"{s.worker[:16]:<16} {s.address[:21]:<21} {z.device:<5} {f'{s.start}-{s.end - 1}':>7} "
                        f"{spine:>11} {s.spine_bytes / GB:>9.2f} {experts:>9} {z.sessions / GB:>8.2f} "
                        f"{f'{z.device_total / GB:.1f}/{s.memory_bytes / GB:.1f}':>16} {per_token:>9.3f} "
                        f"{s.seconds_per_token:>8.3f}")
        total = sum((s.sizing.expert_bytes_per_token + s.sizing.spine_bytes_per_token) for s in self.stages) / GB
        rows.append(f"{'total':<16} {'':<21} {'':<5} {'':>7} {'':>11} "
                    f"{sum(s.spine_bytes for s in self.stages) / GB:>9.2f} {'':>9} {'':>8} {'':>16} {total:>9.3f} "
                    f"{self.seconds_per_token:>8.3f}")
        rows.append("spine: format, layers resident of the stage's; resident: spine + embedding/head GB; experts: "
                    "resident, or the cache (c) in GB; GB/token: expert + spine bytes read per token")
        return "\n".join(rows)


def stage_placement(w: WorkerCapacity, act_bytes: int) -> Placement:
    """Where a worker's stage holds its tensors, as its own stage will: a Mac runs its routed experts on MLX (the
    package requires MLX on macOS arm64), read in place into MLX slots, so its plan has no landing slots."""
    return Placement(w.device, act_bytes, "mlx" if w.device == "mps" else "torch")


def plan_layers(cfg: ModelConfig, workers: list[WorkerCapacity], options: SizingOptions | None = None,
                act_bytes: int = 4, experts: str = "local") -> Plan:
    """Contiguous ranges covering every layer once, in the given worker order (workers that cannot
    usefully take layers are left out, or with wide experts serve experts only). Raises PlanError with the reason
    when no plan exists. `experts`: "local" (each stage reads its own layers' experts) or "wide".

    The spine format is one for the whole cluster: with `spine="auto"`, bf16 if the cluster holds all of it
    resident, else row-int8 if it holds all of that, else q4 (and whatever q4 does not fit streams, as converted);
    each stage's sizing says why (`spine_why`), and the log once."""
    if not workers:
        raise PlanError("no workers to plan over")
    if experts not in ("wide", "local"):
        raise PlanError(f"unknown expert placement {experts!r}: wide or local")
    opts = options or SizingOptions()
    wide = experts == "wide"
    if wide and not cfg.moe_layers:
        wide = False  # nothing to spread
    plan, why, opts = _in_cluster_spine(cfg, workers, opts, act_bytes, wide)
    if plan is not None and plan.wide and len(plan.workers) < 2:  # workers refuse a plan of one holder
        log.warning("wide experts need two workers or more to spread over; %s computes its own layers' experts",
                    plan.workers[0].worker)
        plan, why, opts = _in_cluster_spine(cfg, workers, options or SizingOptions(), act_bytes, False)
    if plan is None:
        raise PlanError(_why_not(cfg, workers, opts, act_bytes))
    streamed = [s.sizing for s in plan.stages if s.sizing.streamed_layers]
    if streamed:
        why += (f"; {sum(len(z.streamed_layers) for z in streamed)} layers still stream, read as "
                f"{'converted' if opts.converted and opts.spine != 'bf16' else 'stored'} "
                f"({sum(z.spine_bytes_per_token for z in streamed) / GB:.1f} GB a token)")
    log.info("spine %s on %d stage(s): %s", opts.spine, len(plan.stages), why)
    stages = tuple(replace(s, sizing=replace(s.sizing, spine_why=why)) for s in plan.stages)
    plan = replace(plan, stages=stages)
    kept = kept_prefixes_text(cfg, [(s.start, s.end, s.sizing.prefixes) for s in stages], act_bytes, opts.context)
    return replace(plan, first_token=tuple((n, prefill_seconds(cfg, plan, n)) for n in PROMPT_LENGTHS),
                   kept_prefixes=kept, context=opts.context)


def _in_cluster_spine(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingOptions, act_bytes: int,
                      wide: bool) -> tuple[Plan | None, str, SizingOptions]:
    """The cheapest plan in the cluster's spine format, why that format, and the options with it
    (plan/spine_choice.py: as asked, by the coordinator or the workers; else by memory and what the disks hold)."""
    spine, asked = asked_spine(opts.spine, [(w.name, w.spine) for w in workers])
    by_key = {w.key: w for w in workers}

    def unready(plan: Plan, fmt: str) -> list[str]:
        disks = [(s.worker, by_key[s.key].spine_disk) for s in plan.stages]
        return [name for (name, disk), s in zip(disks, plan.stages, strict=True)
                if disk is not None and not disk.ready(cfg, fmt, s.start, s.end)]

    return choose_spine(replace(opts, spine=spine), lambda o, whole: _plan(cfg, workers, o, act_bytes, whole, wide),
                        unready, asked or "as asked (--spine)")


def _expert_layers(cfg: ModelConfig, w: WorkerCapacity) -> int:
    return sum(1 for layer in cfg.moe_layers if w.holds_experts(layer))


def _wide_options(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingOptions) -> list[SizingOptions]:
    """Each worker's sizing options with wide experts, its share first guessed from its disk speed alone."""
    speed = sum(w.expert_speed for w in workers if _expert_layers(cfg, w)) or 1.0
    return [replace(opts, expert_layers=_expert_layers(cfg, w), disks=w.disks,
                    expert_share=w.expert_speed / speed if _expert_layers(cfg, w) else 0.0) for w in workers]


def _plan(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingOptions, act_bytes: int,
          resident_only: bool, wide: bool) -> Plan | None:
    """The cheapest plan in one spine format (with `resident_only`, stages that stream spine are left out)."""
    n = cfg.num_layers
    per_worker = _wide_options(cfg, workers, opts) if wide else [replace(opts, disks=w.disks) for w in workers]

    @cache
    def size(i: int, a: int, b: int) -> StageSizing | None:
        w = workers[i]
        try:
            return choose(cfg, a, b, stage_placement(w, act_bytes), w.budget, per_worker[i])
        except SizingError:
            return None

    # best[i][b]: (cost, stages) covering layers [0, b) with the first i workers
    best: list[list[tuple[float, tuple[StagePlan, ...]] | None]] = [[None] * (n + 1) for _ in range(len(workers) + 1)]
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
    return _place_experts(cfg, workers, done[1], per_worker, act_bytes) if wide else Plan(done[1])


def _candidate(w: WorkerCapacity, a: int, b: int, sizing: StageSizing, wide: bool) -> tuple[StagePlan, float]:
    """A stage of layers [a, b) on `w` and its cost: its reads' seconds (with wide experts only its spine's: the
    experts are read by every holder), and a tie-break that is least when spines follow memory."""
    read = sizing.spine_bytes_per_token + (0 if wide else sizing.expert_bytes_per_token)
    seconds = read / (max(w.disk_gbps, 1e-3) * GB)
    stage = StagePlan(w.name, w.address, a, b, sizing, seconds, w.worker_id, w.memory_bytes, w.host_memory_bytes,
                      w.disk_gbps, w.expert_speed)
    weight = sizing.layers + sizing.top + sizing.spine_bytes_per_token  # sum of spine^2 / memory
    return stage, seconds + 1e-2 * weight ** 2 / max(1, w.memory_bytes) / GB


def _place_experts(cfg: ModelConfig, workers: list[WorkerCapacity], stages: tuple[StagePlan, ...],
                   per_worker: list[SizingOptions], act_bytes: int) -> Plan:
    """Wide experts over the plan's stages and the workers left without layers that can hold the working set of
    an expert holder: shares by disk speed and cache, the stages sized again with them, the prediction."""
    index = {w.key: i for i, w in enumerate(workers)}
    holders = []
    for i, w in enumerate(workers):
        if w.key in {s.key for s in stages} or not per_worker[i].expert_layers:
            continue
        try:
            z = choose_holder(cfg, stage_placement(w, act_bytes), w.budget, per_worker[i])
        except SizingError:
            continue
        holders.append(StagePlan(w.name, w.address, 0, 0, z, 0.0, w.worker_id, w.memory_bytes, w.host_memory_bytes,
                                 w.disk_gbps, w.expert_speed))
    members = [*stages, *holders]
    caps = [workers[index[m.key]] for m in members]
    slot = expert_slot_bytes(cfg)
    held = [min(1.0, m.sizing.expert_cache // slot / (m.sizing.expert_layers * cfg.num_experts))
            if m.sizing.expert_layers else 0.0 for m in members]
    weights = cache_aware_weights([c.expert_speed if m.sizing.expert_layers else 0.0 for c, m in
                                   zip(caps, members, strict=True)], held)
    placement = ExpertPlacement.build([m.key for m in members], cfg.moe_layers, cfg.num_experts,
                                      lambda i, layer: weights[i] if caps[i].holds_experts(layer) else 0.0)
    sized = []
    tokens = min(m.sizing.forward_tokens for m in members)  # a holder serves calls of the stages' forwards
    for i, (m, c) in enumerate(zip(members, caps, strict=True)):
        layers = m.sizing.expert_layers
        share = placement.count(i) / (layers * cfg.num_experts) if layers else 0.0
        o = replace(per_worker[index[m.key]], expert_share=share, prefill_chunk=tokens)
        place = stage_placement(c, act_bytes)
        z = choose_holder(cfg, place, c.budget, o) if m.sizing.holder_only else choose(cfg, m.start, m.end, place,
                                                                                       c.budget, o)
        seconds = (z.expert_bytes_per_token / max(c.expert_speed, 1e-3) + z.spine_bytes_per_token
                   / max(c.disk_gbps, 1e-3)) / GB
        sized.append(replace(m, sizing=z, seconds_per_token=seconds))
    return Plan(tuple(sized[:len(stages)]), tuple(sized[len(stages):]), placement,
                _wide_seconds(cfg, placement, sized, caps))


def _wide_seconds(cfg: ModelConfig, placement: ExpertPlacement, members: list[StagePlan],
                  caps: list[WorkerCapacity]) -> float:
    """A token's time with every disk reading at once: per MoE layer the slowest holder's expected misses (a
    uniform router: each holder's cache keeps its share of what it computes), plus the calls' round trip and
    outputs on the network, plus the spine the stages stream one after another."""
    k, b, e = cfg.experts_per_token, cfg.bytes_per_expert, cfg.num_experts
    slot = expert_slot_bytes(cfg)
    miss = [1 - min(1.0, m.sizing.expert_cache // slot / placement.count(i)) if placement.count(i) else 0.0
            for i, m in enumerate(members)]
    owner = {layer: next(i for i, m in enumerate(members) if m.start <= layer < m.end) for layer in cfg.moe_layers}
    total = 0.0
    for layer in placement.layers:
        bounds = placement.bounds_of(layer)
        reads = [k * b * (bounds[i + 1] - bounds[i]) / e * miss[i] / (max(c.expert_speed, 1e-3) * GB)
                 for i, c in enumerate(caps)]
        remote = 1 - (bounds[owner[layer] + 1] - bounds[owner[layer]]) / e
        network = (EXPERT_CALL_RTT_S + k * cfg.expert_dim * 4 * remote / LINK_BYTES_PER_S) if remote > 0 else 0.0
        total += max(reads) + network
    return total + sum(m.sizing.spine_bytes_per_token / (max(c.disk_gbps, 1e-3) * GB)
                       for m, c in zip(members, caps, strict=True))


def _why_not(cfg: ModelConfig, workers: list[WorkerCapacity], opts: SizingOptions, act_bytes: int) -> str:
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
    held = [(w.name, w.memory_bytes, stage_placement(w, act_bytes), [i for a, b in w.layers for i in range(a, b)],
             w.has_top, _expert_layers(cfg, w)) for w in workers]
    small = too_small(cfg, held, opts)
    if small is not None:  # not even its smallest stage fits: more workers would not help it
        return small
    biggest = max(workers, key=lambda w: w.memory_bytes)
    try:  # the smallest useful stage on the largest worker: one layer with the embedding
        choose(cfg, 0, 1, stage_placement(biggest, act_bytes), biggest.budget, opts)
    except SizingError as e:
        return f"the cluster cannot hold the model's working set: on {biggest.name}, {e}"
    return (f"the workers' memory ({', '.join(f'{w.name} {w.memory_bytes / GB:.1f} GB' for w in workers)}) cannot "
            f"hold all {cfg.num_layers} layers with their working sets: add memory or workers")



PROMPT_LENGTHS = (1024, 4096, 16384, 65536)  # the prompts `plan` predicts a time to first token for


def distinct_experts(cfg: ModelConfig, tokens: int) -> float:
    """Experts of a layer that `tokens` tokens touch under a uniform router: E(1 - (1 - k/E)^T)."""
    e, k = cfg.num_experts, cfg.experts_per_token
    return e * (1 - (1 - k / e) ** tokens)


def forward_read_bytes(cfg: ModelConfig, tokens: int) -> float:
    """The expert bytes one forward of `tokens` prompt tokens reads, every MoE layer's touched experts (uniform
    router, no cache): what a prefill's progress counts (its time left)."""
    return len(cfg.moe_layers) * distinct_experts(cfg, tokens) * cfg.bytes_per_expert if cfg.moe_layers else tokens


def prefill_seconds(cfg: ModelConfig, plan: Plan, tokens: int, forward_tokens: int | None = None) -> float:
    """A prompt's time to its first token, from bytes and bandwidths: in forwards of the plan's size (or
    `forward_tokens`), each reading every MoE layer's experts its tokens touch (less what the caches keep) and
    streaming the spine that does not stay; with local experts the stages one after another, with wide experts
    every disk at once per layer plus the pairs' outputs over the network. Compute is left out (a Mac's GPU
    keeps up with its SSD; README, Apple silicon)."""
    step = forward_tokens or min(s.sizing.forward_tokens for s in plan.stages)
    total, done = 0.0, 0
    while done < tokens:
        n = min(step, tokens - done)
        total += _forward_seconds(cfg, plan, n)
        done += n
    return total


def _forward_seconds(cfg: ModelConfig, plan: Plan, tokens: int) -> float:
    b, touched = cfg.bytes_per_expert, distinct_experts(cfg, tokens)
    slot = expert_slot_bytes(cfg)
    members = plan.workers
    spine = sum(s.sizing.spine_bytes_per_token / (_speed(s) * GB) for s in plan.stages)
    if plan.experts is None:
        reads = 0.0
        for s in plan.stages:
            z = s.sizing
            layers = z.expert_layers or 0
            held = min(1.0, z.expert_cache // slot / (layers * cfg.num_experts)) if layers else 0.0
            reads += layers * touched * b * (1 - held) / (_speed(s, True) * GB)
        return reads + spine
    p = plan.experts
    held = [min(1.0, m.sizing.expert_cache // slot / p.count(i)) if p.count(i) else 0.0 for i, m in enumerate(members)]
    owner = {layer: next(i for i, m in enumerate(members) if m.start <= layer < m.end) for layer in cfg.moe_layers}
    per_layer = 0.0
    for layer in p.layers:
        bounds = p.bounds_of(layer)
        share = [(bounds[i + 1] - bounds[i]) / cfg.num_experts for i in range(len(members))]
        reads = max(touched * b * share[i] * (1 - held[i]) / (_speed(m, True) * GB) for i, m in enumerate(members))
        remote = 1 - share[owner[layer]]
        network = (EXPERT_CALL_RTT_S + tokens * cfg.experts_per_token * cfg.expert_dim * 4 * remote / LINK_BYTES_PER_S
                   if remote > 0 else 0.0)
        per_layer += max(reads, network)  # the outputs stream back while the holders read
    return per_layer + spine


def _speed(s: StagePlan, experts: bool = False) -> float:
    """A member's disk speed: its model disk's (the spine), or all its expert disks' (`experts`)."""
    return max((s.expert_gbps or s.disk_gbps) if experts else s.disk_gbps, 1e-3)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
