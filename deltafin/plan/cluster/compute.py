"""A worker's compute, as the plan prices it (pure): what a forward's matmuls take on a worker whose speed was
measured (runtime/compute_probe.py, announced with its description), beside what its disks and links take.

- The spine: every token goes through each of a stage's layers' matrices once, 2 FLOP a weight (the router's
  too); the embedding is a lookup, the head runs on the last position of a forward only. At the measured rate of
  the matmuls in the stage's spine format. (Attention's own arithmetic, quadratic only in MLA's 24 layers, and
  the KDA recurrence are left out: under 5 % of a 4K prompt's FLOP at K3's width.)
- The routed experts: each expert a forward touches costs a fixed time (its weights go through the matmuls once:
  a decoded token's whole cost) and each token routed to it a little more (a prompt's tokens share the weights).
  Wide experts: each holder computes its share of every MoE layer's, at once.
Where a worker's speed is not known (an older worker), its compute is left out, and the plan says so.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from deltafin.checkpoint.config import ModelConfig
from deltafin.formats import spine_formats
from deltafin.formats.mxfp4 import MXFP4


@dataclass(frozen=True)
class ComputeSpeed:
    """A worker's measured compute. A routed expert: its time for one token (`expert_one_s`: its weights through
    the matmuls once) and a token's share of a batch's (`expert_token_s`). The spine's matmuls in each format:
    FLOP/s for one token (`spine_one`: bound by reading the weights) and for a prompt's many (`spine_many`). And
    how uncertain the reading is (`spread`: the relative spread of its timings; 0 where not said)."""

    expert_one_s: float
    expert_token_s: float
    spine_one: Mapping[str, float]
    spine_many: Mapping[str, float]
    spread: float = 0.0

    def expert_seconds(self, experts: float, pairs: float) -> float:
        """`experts` distinct experts computing `pairs` (token, expert) pairs in all: each expert at least its
        one-token time, the batch at least its tokens' share."""
        return max(experts * self.expert_one_s, pairs * self.expert_token_s)

    def spine_seconds(self, flop_per_token: float, tokens: int, spine: str) -> float:
        """`tokens` through matrices of `flop_per_token` in format `spine`: at least one pass over the weights,
        at least the tokens' FLOP at the batched rate."""
        one, many = self.spine_one.get(spine, 0.0), self.spine_many.get(spine, 0.0)
        return max(flop_per_token / one if one > 0 else 0.0, tokens * flop_per_token / many if many > 0 else 0.0)

    def describe(self) -> str:
        rates = ", ".join(f"{fmt} {self.spine_one.get(fmt, 0) / 1e9:.0f}/{self.spine_many.get(fmt, 0) / 1e9:.0f}"
                          for fmt in (f.name for f in spine_formats()) if fmt in self.spine_many)
        spread = f" (±{self.spread / 2:.0%})" if self.spread > 0 else ""
        return (f"an expert {self.expert_one_s * 1e3:.2f} ms for a token, {self.expert_token_s * 1e3:.3f} ms a "
                f"token in a batch; spine GFLOP/s one token/batched: {rates}{spread}")


@functools.cache  # (a config is frozen; the predictions ask for each layer of it again and again)
def layer_flop(cfg: ModelConfig, layer: int) -> float:
    """FLOP a token takes through a layer's spine matrices (2 a weight; vectors and norms left out)."""
    return 2.0 * sum(s.numel for s in cfg.layer_tensor_specs(layer) if len(s.shape) == 2 and min(s.shape) > 1)


def head_flop(cfg: ModelConfig) -> float:
    return 2.0 * cfg.vocab_size * cfg.hidden_size


def spine_seconds(cfg: ModelConfig, speed: ComputeSpeed, start: int, end: int, tokens: int, spine: str) -> float:
    """A forward of `tokens` through the spine of layers [start, end) in format `spine`: every token through every
    layer, and the head on the last position where the stage ends the model."""
    layers = sum(layer_flop(cfg, i) for i in range(start, end))
    head = speed.spine_seconds(head_flop(cfg), 1, spine) if end == cfg.num_layers else 0.0
    return speed.spine_seconds(layers, tokens, spine) + head


def weight_bytes() -> dict[str, float]:
    """Bytes a weight takes in each spine format as the matmuls read it (formats' `bytes_per_weight`)."""
    return {f.name: f.bytes_per_weight for f in spine_formats()}


def assumed_gpu(cfg: ModelConfig, memory_gbps: float, tflops: float) -> ComputeSpeed:
    """A GPU's compute where none was measured (docs/full-scale.md's Mac projections; docs/PERF.md: an M1 Max reads
    ~400 GB/s of unified memory and computes ~10 TFLOP/s): one token's matmuls read each weight once at memory speed,
    a batch's run at the FLOP rate."""
    bw, flops = memory_gbps * 1e9, tflops * 1e12
    return ComputeSpeed(expert_one_s=cfg.bytes_per_expert / bw,
                        expert_token_s=2 * cfg.bytes_per_expert / MXFP4.bytes_per_weight / flops,
                        spine_one={f: 2 * bw / b for f, b in weight_bytes().items()},
                        spine_many=dict.fromkeys(weight_bytes(), flops))
