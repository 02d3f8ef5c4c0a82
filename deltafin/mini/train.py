"""Training k3-mini with the runtime's own model code: deltafin/models is pure torch and differentiable.

The parameters are the checkpoint's own tensors, by name, in fp32 (each MoE layer's routed experts as three
stacked dense matrices, [E, I, De] / [E, De, I] / [E, I, De]); every step builds the typed weights from them
with `layer_weights` / `top_weights` and runs `embed`, `attention`, `route`, `feed_forward` and `head`, so
the forward that is trained is the forward that serves (tests/deltafin/mini/test_train.py compares them).
Training starts from `deltafin synth --preset mini` (seeded, byte-identical everywhere) and packs the
corpus's token ids into windows of `seq` tokens.

The router is balanced as K3's is (aux-loss-free, `noaux_tc`): after each step every MoE layer's
`e_score_correction_bias` moves by `bias_rate` toward experts chosen less than the mean, with no gradient.
After `steps`, the experts are rounded to MXFP4 and frozen, and the spine trains on for `quantized_steps`
with them as they will be shipped (the model that is measured is the quantized one).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from deltafin.checkpoint.config import ModelConfig
from deltafin.kernels.quant import MXFP4Weight, dequantize_mxfp4, quantize_mxfp4
from deltafin.models.cache import new_sequence_cache
from deltafin.models.decoder import Span, attention, embed, feed_forward, head
from deltafin.models.moe import ExpertSource, route
from deltafin.models.weights import ExpertWeights, MoEWeights, layer_weights, top_weights

log = logging.getLogger(__name__)

EXPERT_MATRICES = ("w1", "w2", "w3")  # gate [I, De], down [De, I], up [I, De]


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    quantized_steps: int = 60
    batch: int = 128  # sequences per step (64K tokens)
    seq: int = 512  # tokens per sequence
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_rate: float = 1e-3  # K3's router balance: bias step per optimizer step
    seed: int = 0
    log_every: int = 20


def experts_name(layer: int, matrix: str) -> str:
    """The training-time name of layer `layer`'s stacked routed experts (not a checkpoint name)."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{matrix}"


def load_parameters(cfg: ModelConfig, model_dir: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in fp32 on `device`, keyed by name without the prefix; each MoE layer's
    experts dequantized and stacked (`experts_name`). Router biases do not train (requires_grad False)."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            raw.update({k.removeprefix(cfg.prefix): f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    params: dict[str, torch.Tensor] = {}
    for layer in cfg.moe_layers:
        for m in EXPERT_MATRICES:
            stacked = []
            for e in range(cfg.num_experts):
                base = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{m}."
                packed, scales = raw.pop(base + "weight_packed"), raw.pop(base + "weight_scale")
                stacked.append(dequantize_mxfp4(MXFP4Weight(packed, scales)))
            params[experts_name(layer, m)] = torch.stack(stacked)
    params.update({k: v.float() for k, v in raw.items()})
    out = {}
    for name, t in params.items():
        trains = not name.endswith("e_score_correction_bias")
        out[name] = t.to(device).contiguous().requires_grad_(trains)
    return out


def as_is(t: torch.Tensor, role: str) -> torch.Tensor:
    return t  # every parameter is fp32 on the device already: each role takes it as it is


def layer_tensors(params: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}."
    return {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}


def forward(cfg: ModelConfig, params: dict[str, torch.Tensor], ids: torch.Tensor,
            loads: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Logits [B*T, vocab] for ids [B, T], B sequences from empty caches, through the runtime's layer code.
    `loads`, if given, receives each MoE layer's count of tokens per expert."""
    b, t = ids.shape
    top = top_weights(cfg, params, as_is, first=True, last=True)
    state = embed(top, ids.reshape(-1), torch.float32)
    caches = [new_sequence_cache(cfg, range(cfg.num_layers), ids.device, torch.float32, tokens=t)
              for _ in range(b)]
    spans = [Span(i * t, t, c) for i, c in enumerate(caches)]
    for layer in range(cfg.num_layers):
        w = layer_weights(cfg, layer, layer_tensors(params, layer), as_is)
        after, x = attention(cfg, layer, w, state, spans)
        routing = None
        if isinstance(w.ffn, MoEWeights):
            routing = route(cfg, w.ffn, x)
            if loads is not None:
                loads.append(torch.bincount(routing[0].reshape(-1), minlength=cfg.num_experts))
        state = feed_forward(cfg, layer, w, after, x, expert_source(params), routing=routing)
    return head(cfg, top, state)


def expert_source(params: dict[str, torch.Tensor]) -> ExpertSource:
    def experts(layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        w1, w2, w3 = (params[experts_name(layer, m)] for m in EXPERT_MATRICES)
        for e in ids:
            yield e, ExpertWeights(w1[e], w2[e], w3[e])
    return experts


def batches(tokens: np.ndarray, batch: int, seq: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch, seq + 1] windows at seeded random offsets of the packed token stream."""
    rng = np.random.Generator(np.random.PCG64(seed))
    span = len(tokens) - seq - 1
    while True:
        starts = rng.integers(0, span, size=batch)
        yield torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int64))


def learning_rate(tc: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to min_lr at `steps`; the quantized phase stays at min_lr."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    if step >= tc.steps:
        return tc.min_lr
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def _optimizer(params: dict[str, torch.Tensor], tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only (not on norms, biases, decay rates, conv kernels, AttnRes vectors)."""
    trainable = [(k, p) for k, p in params.items() if p.requires_grad]
    decays = [p for k, p in trainable if p.dim() >= 2 and not acts_as_vector(k)]
    rest = [p for k, p in trainable if not (p.dim() >= 2 and not acts_as_vector(k))]
    return torch.optim.AdamW([{"params": decays, "weight_decay": tc.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)


def acts_as_vector(name: str) -> bool:
    """Tensors stored as matrices that act as vectors: conv kernels [P, 1, K], AttnRes projections [1, D]."""
    return name.endswith(("conv1d.weight", "_res_proj.weight"))


def quantize_experts(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> None:
    """Round every routed expert to MXFP4 (what the checkpoint stores) and freeze it."""
    for layer in cfg.moe_layers:
        for m in EXPERT_MATRICES:
            w = params[experts_name(layer, m)]
            rounded = torch.stack([dequantize_mxfp4(quantize_mxfp4(w[e].detach().cpu())) for e in range(len(w))])
            params[experts_name(layer, m)] = rounded.to(w.device).requires_grad_(False)


def balance_router(cfg: ModelConfig, params: dict[str, torch.Tensor], loads: list[torch.Tensor], rate: float) -> None:
    """K3's aux-loss-free balance: each bias moves by `rate` toward the mean load (sign of the gap)."""
    for layer, load in zip(cfg.moe_layers, loads, strict=True):
        bias = params[f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"]
        load = load.float()
        bias.data.add_(rate * torch.sign(load.mean() - load))


def loss_of(cfg: ModelConfig, params: dict[str, torch.Tensor], window: torch.Tensor,
            loads: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Mean next-token cross entropy (nats) over a [B, T+1] window."""
    logits = forward(cfg, params, window[:, :-1], loads)
    return F.cross_entropy(logits, window[:, 1:].reshape(-1))


def train(cfg: ModelConfig, params: dict[str, torch.Tensor], tokens: np.ndarray, tc: TrainConfig,
          device: torch.device) -> list[dict]:
    """Train `params` in place; returns the log (one record per `log_every` steps)."""
    torch.manual_seed(tc.seed)
    opt = _optimizer(params, tc)
    history, seen, t0 = [], 0, time.perf_counter()
    windows = batches(tokens, tc.batch, tc.seq, tc.seed)
    for step in range(tc.steps + tc.quantized_steps):
        window = next(windows)
        if step == tc.steps and tc.quantized_steps:
            quantize_experts(cfg, params)
            opt = _optimizer(params, tc)
        for group in opt.param_groups:
            group["lr"] = learning_rate(tc, step)
        loads: list[torch.Tensor] = []
        loss = loss_of(cfg, params, window.to(device), loads)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.requires_grad], tc.clip)
        opt.step()
        balance_router(cfg, params, loads, tc.bias_rate)
        seen += window[:, :-1].numel()
        if step % tc.log_every == 0 or step == tc.steps + tc.quantized_steps - 1:
            record = {"step": step, "loss": round(loss.item(), 4), "lr": learning_rate(tc, step),
                      "tokens": seen, "seconds": round(time.perf_counter() - t0, 1),
                      "max_load_share": round(max(float(x.max()) / float(x.sum()) for x in loads), 4)}
            history.append(record)
            log.info("step %(step)d loss %(loss).4f lr %(lr).2e tokens %(tokens)d %(seconds).1fs", record)
    return history
