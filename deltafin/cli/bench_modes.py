"""`deltafin bench --quality --expert-mode MODE|all`: what each expert mode (deltafin/expert_modes.py) costs in
quality and saves in expert reads, against exact, on the same held-out tokens.

Quality, as for the spine formats (cli/bench_quality.py): the mode's next-token perplexity over exact's
(`perplexity_ratio`), the mean KL divergence of its next-token distribution from exact's (`kl`, nats) and how often
both put the same token first (`top1_agreement`). Reads: every token's routed experts, layer after layer in decode
order, replayed through an expert cache of `cache_share` of all the model's experts (the default policy);
`expert_bytes_ratio` is the mode's expert bytes read a token over exact's (a low-bit copy's read costs its bytes, at
this model's geometry), `experts_per_token` what its MoE layers ask for before any cache, `copy_share` the share of
those that are a low-bit copy's, and `by_share` the bytes' ratio at the shares the plans give K3 (one 64 GB Mac,
four).
A mode whose routing does not depend on the cache runs each sequence in forwards of PIECE_TOKENS rows (a row's
routing is what decode's would be); a cache-aware one runs token by token, holding what the replay's cache holds, so
that what it finds held is what a decode would find, over at most DECODE_POSITIONS positions unless --tokens says.
Exact's own routing trace also compares the cache policies at those shares (`policy_hit_rates`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.cli.bench_quality import add_pair, cut, figures, new_sums
from deltafin.errors import DeltafinError
from deltafin.expert_modes import EXACT, ExpertMode, parse
from deltafin.formats import low_bit_format, stored_spine
from deltafin.models.mode_routing import mode_router
from deltafin.models.moe import route
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.models.weights import MoEWeights
from deltafin.options import CACHE_POLICIES
from deltafin.plan.memory.sizing_options import SizingOptions, low_bit_ratio, mode_presets
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights.expert_cache import ExpertCache, make_policy, simulate

ONE_MAC_SHARE = 0.008  # of K3's experts, what one 64 GB Mac's plan caches (12 GB of 1.45 TB)
FOUR_MACS_SHARE = 0.04  # ... and four 64 GB Macs' caches together
SHARES = (ONE_MAC_SHARE, FOUR_MACS_SHARE)
POLICY_SHARES = (*SHARES, 0.125, 0.25)  # where exact's trace compares the cache policies
DECODE_POSITIONS = 4096  # a cache-aware mode's positions (token by token) unless --tokens says
Trace = list[list[tuple[int, int]]]  # one list of (layer, expert) per MoE layer a token passes, in decode order


def modes_asked(text: str) -> list[str]:
    """`--expert-mode` for the bench: "all" (every preset) or one mode, each in its one spelling."""
    if text.strip().lower() == "all":
        return [m for m in mode_presets() if m != EXACT]
    mode = parse(text)
    if mode.low_bit is not None:
        low_bit_format(mode.low_bit)  # a format's name is checked here, before any text is read
    if mode.exact:
        raise DeltafinError("--quality --expert-mode: name a mode other than exact (it is what modes are measured "
                            "against), or all")
    return [mode.name]


class RoutingTap:
    """A stage's router in `mode` that records what each MoE layer chose for each row (the experts with weight);
    for a cache-aware mode its cache is the replay's, kept live as tokens pass (one row a forward)."""

    def __init__(self, cfg: ModelConfig, mode: ExpertMode, capacity: int, policy: str):
        self.cfg, self.live = cfg, not mode.reproducible
        self.cache: ExpertCache = ExpertCache(capacity, make_policy(policy, capacity))
        self.inner = mode_router(cfg, mode, self.held)
        self.calls: list[tuple[int, list[list[int]]]] = []
        self.trace: Trace = []

    def held(self, layer: int) -> list[int]:
        return [e for (lay, e) in self.cache.entries if lay == layer]

    def __call__(self, layer: int, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx, weights = self.inner(layer, w, x) if self.inner is not None else route(self.cfg, w, x)
        rows = [sorted({int(e) for e, wt in zip(i, v, strict=True) if wt != 0})
                for i, v in zip(idx.tolist(), weights.tolist(), strict=True)]
        self.calls.append((layer, rows))
        if self.live:
            for e in rows[0]:
                if self.cache.get((layer, e)) is None:
                    self.cache.put((layer, e), None, 1)
        return idx, weights

    def forward_done(self) -> None:
        """The forward's routing, token by token (each token's layers in order), onto the trace."""
        for r in range(len(self.calls[0][1]) if self.calls else 0):
            self.trace.extend([(layer, e) for e in rows[r]] for layer, rows in self.calls)
        self.calls.clear()


def _run(model: str | Path, device: str, mode: ExpertMode, sequences: list[list[int]], capacity: int,
         policy: str, spine: str | None = None) -> tuple[list[torch.Tensor], Trace]:
    """Every position's fp32 logits of each sequence in `mode` (its spine in `spine`, else as stored), and the
    routing trace."""
    options = StageOptions(expert_mode=mode.name, sizing=SizingOptions(spine=spine or stored_spine()))
    pipe = LocalPipeline.load(model, 1, device=device, options=options)
    tap = RoutingTap(pipe.stages[0].cfg, mode, capacity, policy)
    pipe.stages[0].router = tap
    step = 1 if tap.live else PIECE_TOKENS  # token by token where the cache steers the routing
    out = []
    try:
        for i, seq in enumerate(sequences):
            ids, rows = torch.tensor(seq, dtype=torch.long), []
            for s in range(0, len(seq), step):
                rows.append(pipe.forward([SeqInput(f"m-{i}", s, ids=ids[s:s + step])], all_logits=True)[0]
                            .logits.float().cpu())
                tap.forward_done()
            pipe.release(f"m-{i}")
            out.append(torch.cat(rows))
    finally:
        pipe.close()
    return out, tap.trace


def _reads(trace: Trace, capacity: int, policy: str, cfg: ModelConfig, low_ratio: float = 1.0) -> float:
    """Expert bytes read over the trace through a cache of `capacity` experts (either form an entry), in experts as
    stored: a low-bit copy's miss (id E + e) costs `low_ratio` of one."""
    cache: ExpertCache = ExpertCache(capacity, make_policy(policy, capacity))
    read = 0.0
    for step in trace:
        for key in step:
            if cache.get(key) is None:
                cache.put(key, None, 1)
                read += low_ratio if key[1] >= cfg.num_experts else 1.0
    return read


def mode_quality(model: str | Path, modes: list[str], sequences: list[list[int]], device: str = "cpu",
                 tokens: int | None = None, cache_share: float = ONE_MAC_SHARE, policy: str = "lfu",
                 spine: str | None = None) -> dict[str, Any]:
    """JSON-ready: every mode's figures against exact (see the module docstring); the modes with their spine in
    `spine` (exact's always as stored: what both together cost)."""
    from deltafin.checkpoint.config import load_config  # (light: the model's config alone)

    cfg = load_config(model)
    all_experts = len(cfg.moe_layers) * cfg.num_experts
    if not all_experts:
        raise DeltafinError(f"{model} has no routed experts: expert modes change nothing")
    capacity = max(1, round(cache_share * all_experts))
    exact: dict[int | None, tuple[list[torch.Tensor], Trace, list[list[int]]]] = {}
    result: dict[str, Any] = {"bench": "expert-modes", "model": str(model), "spine": spine or stored_spine(),
                              "cache_share": cache_share,
                              "cache_experts": capacity, "policy": policy, "modes": {}}
    for name in modes:
        mode = parse(name)
        positions = tokens if mode.reproducible or tokens is not None else DECODE_POSITIONS
        if positions not in exact:
            part = cut(sequences, positions)
            exact[positions] = (*_run(model, device, ExpertMode(), part, capacity, policy), part)
        ref, ref_trace, part = exact[positions]
        logits, trace = _run(model, device, mode, part, capacity, policy, spine)
        sums = new_sums()
        for a, b, seq in zip(ref, logits, part, strict=True):
            add_pair(sums, a, b, torch.tensor(seq, dtype=torch.long))
        result["modes"][mode.name] = _mode_figures(model, sums, trace, ref_trace, capacity, policy, cfg,
                                                   low_bit_ratio(cfg, mode.low_bit))
    longest = max(exact, key=lambda n: math.inf if n is None else n)
    ref_trace = exact[longest][1]
    result["exact"] = {"tokens": len(ref_trace) // max(1, len(cfg.moe_layers)),
                       "experts_per_token": _per_token(ref_trace, len(cfg.moe_layers))}
    result["policy_hit_rates"] = {f"{s:g}": {p: round(simulate(p, max(1, round(s * all_experts)), ref_trace), 4)
                                             for p in CACHE_POLICIES} for s in sorted({*POLICY_SHARES, cache_share})}
    return result


def _per_token(trace: Trace, moe_layers: int) -> float:
    return round(sum(len(step) for step in trace) / max(1, len(trace) // max(1, moe_layers)), 3)


def _mode_figures(model: str | Path, sums: dict, trace: Trace, ref_trace: Trace, capacity: int, policy: str,
                  cfg: ModelConfig, low_ratio: float) -> dict[str, Any]:
    f = figures(model, sums)
    all_experts = len(cfg.moe_layers) * cfg.num_experts

    def ratio(slots: int) -> float:
        return round(_reads(trace, slots, policy, cfg, low_ratio) / max(1e-9, _reads(ref_trace, slots, policy, cfg)),
                     4)

    lookups = [key for step in trace for key in step]
    return {"tokens": f["tokens"], "perplexity": f["perplexity"], "perplexity_exact": f["perplexity_stored"],
            "perplexity_ratio": round(f["perplexity"] / f["perplexity_stored"], 4), "kl": f["kl_vs_stored"],
            "top1_agreement": f["top1_agreement"], "expert_bytes_ratio": ratio(capacity),
            "experts_per_token": _per_token(trace, len(cfg.moe_layers)),
            "copy_share": round(sum(key[1] >= cfg.num_experts for key in lookups) / max(1, len(lookups)), 4),
            "by_share": {f"{s:g}": ratio(max(1, round(s * all_experts))) for s in SHARES}}


def frontier_rows(result: dict[str, Any]) -> list[str]:
    """The docs' table (docs/expert-modes.md) from a `mode_quality` result: a markdown row a mode, fewest reads
    first."""
    modes = sorted(result["modes"].items(), key=lambda kv: kv[1]["expert_bytes_ratio"])
    return [f"| {name} | {m['expert_bytes_ratio']:.3f} | {m['perplexity_ratio']:.4f} | {m['kl']:.4f} | "
            f"{m['top1_agreement']:.4f} |" for name, m in modes]


def policy_rows(result: dict[str, Any]) -> list[str]:
    """The docs' cache-policy table from a `mode_quality` result: a row a cache share."""
    return [f"| {float(share):.1%} | " + " | ".join(f"{rates[p]:.4f}" for p in CACHE_POLICIES) + " |"
            for share, rates in result["policy_hit_rates"].items()]
