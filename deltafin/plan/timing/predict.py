"""A plan's time, predicted from its bytes, its disks' speeds, its links and its workers' measured compute (pure): a
decoded token and a prompt's first token, each split into what the disks, the links and the compute take.

- Disks: each forward reads every MoE layer's experts its tokens touch (a uniform router, less what the caches keep)
  and streams the spine that does not stay; with local experts the stages read one after another, with wide experts
  every holder reads its share of a layer at once (the slowest holder sets the layer's time).
- Links (plan/cluster/links.py): every stage's hop (a stage's residual state, (1 + blocks) x D values a token, relayed
by
  the coordinator or handed directly to the next stage, whichever is faster: plan/timing/hops.py; the first stage's
  token ids, the last's logits of the last position), and with wide experts each MoE layer's calls from
  the stage that owns it to the other holders, at once: a round trip and the rows of the tokens routed to each
  (out, and their sums back). States and rows cross at the wire's size (`Links.value_bytes`: fp32, or bf16 with
  `--wire bf16`); the logits stay fp32. A token waits for its calls after its reads; a prompt's calls divide the
  experts so that the holders whose rows and sums cross a link finish with the owner (`_wide_layers`).
- Compute (plan/cluster/compute.py, where the workers measured theirs; else none): each stage's spine, one layer after
  another, and each MoE layer's routed experts, which overlap their reads (the store hands each expert to the
  matmuls as it lands: a layer's experts take the longer of the two; wide, on every holder at once). A prompt's
  layer on a local stage also reads its experts ahead while its spine computes, as far as the slots ahead hold
  (the cache a prompt's forward borrowed leaves them: `_local_prompt`).
- A prompt goes in the fewest forwards of equal length of the plan's prompt forward (`forward_lengths`,
  `prompt_forward`: a stage lends its expert cache to a prompt's forward, sizing.py), a spilled one where the plan
  spills (its rows' blocks read and written on the disk besides: plan/memory/spill_cost.py). On several stages those
  forwards go through them at once (coordinator/cluster/pipelined.py): each after the first adds its slowest stage
  (`_period`), not the whole way.
`plan` prints the parts for a token and for PROMPT_LENGTHS; a prefill's progress counts its bytes with
`forward_read_bytes`.
"""

from __future__ import annotations

from deltafin.checkpoint.config import ModelConfig
from deltafin.plan.cluster.cluster_plan import GB, ClusterPlan, PlannedStage, Seconds
from deltafin.plan.cluster.compute import layer_flop, spine_seconds
from deltafin.plan.cluster.links import Links
from deltafin.plan.cluster.prompt_split import HolderSpeed, PromptSplit, streamed_finish
from deltafin.plan.memory.sizing import Placement, kept_while_lent, lends
from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS
from deltafin.plan.memory.spill_cost import spill_bytes
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.plan.timing.hops import hop_ways, hops_seconds

PROMPT_LENGTHS = (1024, 4096, 16384, 65536)  # the prompts `plan` predicts a time to first token for


def distinct_experts(cfg: ModelConfig, tokens: int, share: float = 1.0) -> float:
    """Experts of a layer that `tokens` tokens touch under a uniform router: E(1 - (1 - k/E)^T), each token's k
    the `share` of them its expert mode reads (StagePlan.expert_read_share)."""
    e, k = cfg.num_experts, cfg.experts_per_token * share
    return e * (1 - (1 - k / e) ** tokens)


def forward_read_bytes(cfg: ModelConfig, tokens: int) -> float:
    """The expert bytes one forward of `tokens` prompt tokens reads, every MoE layer's touched experts (uniform
    router, no cache): what a prefill's progress counts (its time left)."""
    return len(cfg.moe_layers) * distinct_experts(cfg, tokens) * cfg.bytes_per_expert if cfg.moe_layers else tokens


def token_seconds(cfg: ModelConfig, plan: ClusterPlan, act_bytes: int = 4) -> Seconds:
    """One decoded token's time (the disks' and the links', which do not overlap: a token's calls wait on its
    router, and its next layer on its calls)."""
    return _forward(cfg, plan, 1, act_bytes, overlap=False)


def pass_seconds(cfg: ModelConfig, plan: ClusterPlan, tokens: int, act_bytes: int = 4) -> float:
    """A decode step that verifies `tokens - 1` drafts: one forward of `tokens` tokens, reading the union of their
    experts (less what the caches keep), the spine streamed once, the hops and the compute (what drafting weighs
    its expected accepted tokens against: text/drafting.py)."""
    return _forward(cfg, plan, tokens, act_bytes, overlap=False).total


def verify_table(cfg: ModelConfig, plan: ClusterPlan, act_bytes: int = 4) -> tuple[float, ...]:
    """`pass_seconds` for 1 .. SPECULATIVE_TOKENS tokens (a step without drafts, then with 1 .. 8)."""
    return tuple(pass_seconds(cfg, plan, n, act_bytes) for n in range(1, SPECULATIVE_TOKENS + 1))


def prefill_seconds(cfg: ModelConfig, plan: ClusterPlan, tokens: int, forward_tokens: int | None = None,
                    act_bytes: int = 4) -> Seconds:
    """A prompt's time to its first token: in the fewest forwards of the plan's prompt size (or `forward_tokens`),
    of equal length (coordinator/engine/token_loop.py cuts them so), each reading every MoE layer's experts its
    tokens touch (less what the caches keep, none where the forward borrows them) and streaming the spine that
    does not stay, while its states cross the links."""
    step = forward_tokens or prompt_forward(plan)
    disk = link = total = compute = 0.0
    for k, n in enumerate(forward_lengths(tokens, step)):
        s = _forward(cfg, plan, n, act_bytes, overlap=True)
        disk, link, compute = disk + s.disk, link + s.link, compute + s.compute
        total += s.total if k == 0 or len(plan.stages) == 1 else _period(cfg, plan, n, act_bytes)
    return Seconds(disk, link, total, compute)


def _period(cfg: ModelConfig, plan: ClusterPlan, tokens: int, act_bytes: int) -> float:
    """What one more forward of a prompt adds where the stages take its forwards at once (coordinator/cluster/
    pipelined.py): its slowest stage, or the links' hops, or (wide) the holders' reads of every stage's layers,
    which all its forwards share, whichever is longest."""
    busy = _stage_busy(cfg, plan, tokens, act_bytes)
    shared = 0.0 if plan.experts is None else sum(r for r, _, _, _ in _wide_layers(cfg, plan, plan.links, tokens,
                                                                                     True))
    return max(*busy, shared, hops_seconds(cfg, plan, tokens, act_bytes))


def _stage_busy(cfg: ModelConfig, plan: ClusterPlan, tokens: int, act_bytes: int) -> list[float]:
    """Each stage's part of a prompt's forward of `tokens`: its layers (with wide experts, each MoE layer's time on
    every holder, counted to the stage that owns it), its streamed spine and its spill."""
    out = []
    layers = [] if plan.experts is None else list(zip(plan.experts.layers, _wide_layers(cfg, plan, plan.links,
                                                                                          tokens, True), strict=True))
    for s in plan.stages:
        own = s.plan.spine_bytes_per_token / (_speed(s) * GB) + _spill_seconds(cfg, s, tokens, act_bytes)
        if plan.experts is None:
            r, c = _local_reads(cfg, s, tokens), _expert_compute(cfg, s, tokens, s.plan.expert_layers or 0)
            out.append(own + _local_prompt(cfg, s, tokens, r, c, act_bytes))
        else:
            moe = sum(t[3] for layer, t in layers if s.start <= layer < s.end)
            out.append(own + moe + _spine_compute(cfg, s, tokens) - _spine_compute(cfg, s, tokens, moe=True))
    return out


def prompt_forward(plan: ClusterPlan) -> int:
    """The most tokens a prompt's forward carries through every stage (its expert cache lent where the plan lends
    it: sizing.py `_lend_cache`)."""
    return min(s.plan.longest_forward for s in plan.stages)


def forward_lengths(tokens: int, most: int) -> list[int]:
    """A prompt of `tokens` tokens in the fewest forwards of at most `most`, of equal length (the first ones a token
    longer where it does not divide): every forward reads the experts its tokens touch, so equal ones keep the
    longest forward's compute down at the same reads."""
    count = -(-tokens // max(1, most))
    base, extra = divmod(tokens, max(1, count))
    return [base + (i < extra) for i in range(count)]


def _forward(cfg: ModelConfig, plan: ClusterPlan, tokens: int, act_bytes: int, overlap: bool) -> Seconds:
    links = plan.links
    hops = hops_seconds(cfg, plan, tokens, act_bytes)
    spine = sum(s.plan.spine_bytes_per_token / (_speed(s) * GB) for s in plan.stages)
    spine_compute = sum(_spine_compute(cfg, s, tokens) for s in plan.stages)
    if plan.experts is None:
        reads = compute = busy = 0.0
        for s in plan.stages:
            r, c = _local_reads(cfg, s, tokens), _expert_compute(cfg, s, tokens, s.plan.expert_layers or 0)
            b = (_local_prompt(cfg, s, tokens, r, c, act_bytes) if overlap
                 else max(r, c) + _spine_compute(cfg, s, tokens))
            spilled = _spill_seconds(cfg, s, tokens, act_bytes)
            reads, compute, busy = reads + r + spilled, compute + c, busy + b + spilled
        return Seconds(reads + spine, hops, busy + spine + hops, compute + spine_compute)
    reads_sum = calls_sum = compute_sum = total = 0.0
    ahead = overlap and tokens * cfg.experts_per_token > cfg.num_experts  # a prompt's: its layers' reads go first
    for reads, compute, calls, prompt in _wide_layers(cfg, plan, links, tokens, ahead):
        reads_sum, calls_sum, compute_sum = reads_sum + reads, calls_sum + calls, compute_sum + compute
        total += prompt if overlap else max(reads, compute) + calls
    rest = 0.0 if not ahead else sum(_spine_compute(cfg, s, tokens, moe=True) for s in plan.stages)
    return Seconds(reads_sum + spine, calls_sum + hops, total + spine + spine_compute - rest + hops,
                   compute_sum + spine_compute)


def _local_prompt(cfg: ModelConfig, s: PlannedStage, tokens: int, reads: float, compute: float,
                  act_bytes: int) -> float:
    """A stage's forward of a prompt, layer by layer: its spine computes, then its routed experts, their reads
    overlapping their compute (the store hands each expert to the matmuls as it lands). A MoE layer's reads start
    while its spine computes, as far as the slots read ahead hold: two layers' k guesses, and the cache slots a
    prompt's forward that borrowed the cache left it (sizing.py kept_while_lent; runtime/stage.py)."""
    z = s.plan
    layers = z.expert_layers or 0
    kept = kept_while_lent(cfg, z, Placement(z.device, act_bytes), tokens) if (
        tokens > z.forward_tokens and lends(cfg, z)) else 0
    ahead = ((2 * cfg.experts_per_token + kept // expert_slot_bytes(cfg)) * cfg.bytes_per_expert
             / (_speed(s, True) * GB))
    busy = 0.0
    for layer in range(s.start, s.end):
        spine = 0.0 if s.compute is None else spine_seconds(cfg, s.compute, layer, layer + 1, tokens, z.spine)
        if cfg.is_moe(layer) and layers:
            read, experts = reads / layers, compute / layers
            busy += spine + max(read - min(spine, read, ahead), experts)
        else:
            busy += spine
    return busy


def _spill_seconds(cfg: ModelConfig, s: PlannedStage, tokens: int, act_bytes: int) -> float:
    """A spilled forward's reads and writes of its rows' blocks (plan/memory/spill_cost.py), on the stage's disk, after
    its own reads (counted whole: the next piece's blocks are read while this one computes only partly)."""
    z = s.plan
    if not z.spill_tokens or tokens <= z.prompt_tokens:
        return 0.0
    return spill_bytes(cfg, z.start, z.end, tokens, act_bytes) / (_speed(s) * GB)


def _spine_compute(cfg: ModelConfig, s: PlannedStage, tokens: int, moe: bool = False) -> float:
    """A stage's spine compute for a forward of `tokens` (`moe`: its MoE layers' only, without the head)."""
    if s.compute is None:
        return 0.0
    if not moe:
        return spine_seconds(cfg, s.compute, s.start, s.end, tokens, s.plan.spine)
    return sum(_layer_spine(cfg, s, i, tokens) for i in range(s.start, s.end) if cfg.is_moe(i))


def _layer_spine(cfg: ModelConfig, s: PlannedStage, layer: int, tokens: int) -> float:
    """One layer's spine compute on `s`'s worker (not the head)."""
    assert s.compute is not None
    return s.compute.spine_seconds(layer_flop(cfg, layer), tokens, s.plan.spine)


def _expert_compute(cfg: ModelConfig, s: PlannedStage, tokens: int, layers: float) -> float:
    """`layers` MoE layers' routed experts of a forward of `tokens` on `s`'s worker."""
    if s.compute is None or not layers:
        return 0.0
    share = s.plan.expert_read_share
    touched = distinct_experts(cfg, tokens, share) if tokens > 1 else cfg.experts_per_token * share
    return layers * s.compute.expert_seconds(touched, tokens * cfg.experts_per_token * share)


def _local_reads(cfg: ModelConfig, s: PlannedStage, tokens: int) -> float:
    z, slot = s.plan, expert_slot_bytes(cfg)
    layers = z.expert_layers or 0
    cache = 0 if tokens > z.forward_tokens else z.expert_cache  # a longer forward borrowed the cache
    held = min(1.0, cache // slot / (layers * cfg.num_experts)) if layers else 0.0
    touched = distinct_experts(cfg, tokens, z.expert_read_share)
    return layers * touched * cfg.bytes_per_expert * (1 - held) / (_speed(s, True) * GB)


def _wide_layers(cfg: ModelConfig, plan: ClusterPlan, links: Links, tokens: int,
                 ahead: bool = False) -> list[tuple[float, float, float, float]]:
    """Per MoE layer: (the slowest holder's reads, the slowest holder's compute, the owner's calls to the other
    holders, all at once; the layer's time in a prompt). A prompt's calls divide the experts so that every holder
    finishes together (plan/cluster/prompt_split.py): the owner's share takes the longer of its reads and compute,
    another holder's its rows' crossing, then the longer of its reads and compute with its sums crossing back as their
    rows
    are done (`streamed_finish`). `ahead` (a
    prompt's): the layer's time starts with its spine's compute on the owner, while every holder reads its share
    ahead into the slots its cache gives them (runtime/read_ahead.py)."""
    members, p = plan.workers, plan.experts
    assert p is not None
    share = members[0].plan.expert_read_share  # the cluster's expert mode (every stage's)
    slot, k, e = expert_slot_bytes(cfg), cfg.experts_per_token * share, cfg.num_experts
    touched = distinct_experts(cfg, tokens, share) if tokens > 1 else k  # a token reads its k experts
    held = [min(1.0, m.plan.expert_cache // slot / p.count(i)) if p.count(i) else 0.0 for i, m in enumerate(members)]
    owner = {layer: next(i for i, m in enumerate(members) if m.start <= layer < m.end) for layer in cfg.moe_layers}
    speeds = tuple(_speed(m, True) * GB for m in members)
    holders = tuple(HolderSpeed(speeds[i], m.compute.expert_one_s if m.compute else 0.0,
                                m.compute.expert_token_s if m.compute else 0.0) for i, m in enumerate(members))
    out = []
    for layer in p.layers:
        bounds, o = p.bounds_of(layer), owner[layer]
        share = [(bounds[i + 1] - bounds[i]) / e for i in range(len(members))]
        if tokens * k > e:  # a prompt's calls divide the experts they touch as the stage does (prompt_split.py)
            flows = sum(1 for i, x in enumerate(share) if x > 0 and i != o)  # on one medium they share it
            split = PromptSplit(holders, tuple(None if i == o else links.sharing(links.between(members[o].key, m.key),
                                                                                 flows)
                                               for i, m in enumerate(members)),
                                k, cfg.bytes_per_expert, cfg.expert_dim * links.value_bytes)
            counts = split.counts(round(touched), tokens, [x > 0 for x in share])
            share = [c / max(1.0, touched) for c in counts]
        reads = [touched * cfg.bytes_per_expert * share[i] * (1 - held[i]) / speeds[i] for i in range(len(members))]
        compute = [m.compute.expert_seconds(touched * share[i], tokens * k * share[i])
                   if m.compute is not None and share[i] > 0 else 0.0 for i, m in enumerate(members)]
        rows = [tokens * (1 - (1 - share[i]) ** k) * cfg.expert_dim * links.value_bytes for i in range(len(members))]
        called = [i for i in range(len(members)) if i != o and share[i] > 0]
        link = {i: links.between(members[o].key, members[i].key) for i in called}
        calls = links.together([(link[i], rows[i], rows[i]) for i in called])
        spine = _layer_spine(cfg, members[o], layer, tokens) if ahead and members[o].compute is not None else 0.0
        early = [min(spine, reads[i], (m.plan.expert_cache // slot + 2 * k) * cfg.bytes_per_expert / speeds[i])
                 for i, m in enumerate(members)]
        left = [reads[i] - early[i] for i in range(len(members))]
        prompt = spine + max([max(left[o], compute[o])] + [  # rows out, then the work with its sums streamed back
            link[i].seconds(rows[i], 0) + streamed_finish(max(left[i], compute[i]), rows[i] / link[i].down_bps, k,
                                                          share[i]) for i in called])
        out.append((max(reads), max(compute), calls, prompt))
    return out


def _speed(s: PlannedStage, experts: bool = False) -> float:
    """A member's disk speed: its model disk's (the spine), or all its expert disks' (`experts`)."""
    return max((s.expert_gbps or s.disk_gbps) if experts else s.disk_gbps, 1e-3)


def plan_summary(cfg: ModelConfig, plan: ClusterPlan, prompts: list[int], act_bytes: int = 4) -> dict:
    """The plan as `plan --json` prints it: the mode and why, each worker's part, the links (measured or assumed),
    each worker's measured compute, and the predictions (a token; the first token of PROMPT_LENGTHS and of `prompts`),
    disks, links and compute apart."""
    names = dict(plan.links.names) or {s.key: s.worker for s in plan.workers}
    link = lambda v: {"rtt_ms": round(v.rtt_s * 1e3, 3), "up_mbit_s": round(v.up_bps * 8 / 1e6, 1),
                      "down_mbit_s": round(v.down_bps * 8 / 1e6, 1), "address": v.address}
    seconds = lambda s: {"total_s": round(s.total, 3), "disk_s": round(s.disk, 3), "link_s": round(s.link, 3),
                         "compute_s": round(s.compute, 3)}
    compute = lambda c: None if c is None else {
        "expert_one_ms": round(c.expert_one_s * 1e3, 4), "expert_token_ms": round(c.expert_token_s * 1e3, 4),
        "spine_gflop_s_one": {f: round(v / 1e9, 2) for f, v in c.spine_one.items()},
        "spine_gflop_s_batched": {f: round(v / 1e9, 2) for f, v in c.spine_many.items()}}
    return {"experts": "wide" if plan.wide else "local", "why": plan.mode_why, "context": plan.context,
            "workers": [{"name": s.worker, "address": s.address, "layers": [s.start, s.end], "spine": s.plan.spine,
                         "resident_layers": len(s.plan.resident_layers),
                         "expert_cache_gb": round(s.plan.expert_cache / GB, 3),
                         "expert_gb_per_token": round(s.plan.expert_bytes_per_token / GB, 3),
                         "compute": compute(s.compute)} for s in plan.workers],
            "links": {"measured": plan.links.measured, "assumed": link(plan.links.assumed),
                      "coordinator": {names.get(k, k): link(v) for k, v in plan.links.to_workers.items()},
                      "between": {f"{names.get(a, a)} -> {names.get(b, b)}": link(v)
                                  for (a, b), v in plan.links.pairs.items()},
                      "shared_mbit_s": round(plan.links.shared_bps * 8 / 1e6, 1) or None},
            "token": seconds(plan.token) if plan.token is not None else None,
            "first_token": {str(n): seconds(s) for n, s in plan.first_token},
            "verify_pass_s": {str(k): round(s, 4) for k, s in enumerate(plan.verify)},
            "prompts": {str(n): seconds(prefill_seconds(cfg, plan, n, act_bytes=act_bytes)) for n in prompts},
            "hops": hop_ways(cfg, plan, act_bytes)}
