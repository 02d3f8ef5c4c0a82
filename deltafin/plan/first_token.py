"""Time to a prompt's first token, predicted from a plan's bytes and disk speeds (pure): each forward reads every MoE
layer's experts its tokens touch (a uniform router, less what the caches keep) and streams the spine that does not
stay; compute is left out (a Mac's GPU keeps up with its SSD: README, Apple silicon). `plan` prints it for
PROMPT_LENGTHS, and a prefill's progress counts its bytes with `forward_read_bytes`.
"""

from __future__ import annotations

from deltafin.checkpoint.config import ModelConfig
from deltafin.plan.cluster_plan import EXPERT_CALL_RTT_S, GB, LINK_BYTES_PER_S, Plan, StagePlan
from deltafin.plan.sizing import expert_slot_bytes

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
