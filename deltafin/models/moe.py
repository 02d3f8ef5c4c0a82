"""Router, latent MoE with routed + shared experts, and the dense MLP (K3_SPEC §5).

The routed experts are not weights of the layer: the caller supplies them through an `ExpertSource`
once the router has chosen, which is where the stage streams them from disk. Experts may arrive in
any order; each output lands in its (token, slot) cell and the weighted sum runs over slots in a fixed
order, so results do not depend on arrival order.
Shapes: N tokens, D hidden, De expert width (latent for K3), E experts, k active per token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from deltafin.config import ModelConfig
from deltafin.kernels.linear import gate_up, linear
from deltafin.models.common import activation, rms_norm
from deltafin.models.weights import DenseMLPWeights, ExpertWeights, MoEWeights


class ExpertSource(Protocol):
    def __call__(self, layer: int, ids: list[int]) -> Iterable[tuple[int, ExpertWeights]]:
        """Yield (expert id, weights) for every id, in any order."""
        ...


class FusedExperts(Protocol):
    def __call__(self, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[n, k] * Expert_{idx[n, k]}(z[n]) -> [N, De] fp32, all of the layer's experts at once
        (a backend that runs them elsewhere, e.g. MLX)."""
        ...


def route(cfg: ModelConfig, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router: top-k of (score + bias) selects; the unbiased scores weigh. -> idx [N,k], weights [N,k] fp32."""
    scores = torch.sigmoid(linear(x.float(), w.router).float())  # [N, E], fp32 (exact with a bf16 router)
    idx = torch.topk(scores + w.bias, cfg.experts_per_token, dim=-1).indices
    weights = scores.gather(1, idx)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * cfg.routed_scaling_factor


def expert_ffn(cfg: ModelConfig, e: ExpertWeights, z: torch.Tensor) -> torch.Tensor:
    return linear(gate_up(z, e.w1, e.w3, activation(cfg)), e.w2)


def dense_mlp(cfg: ModelConfig, w: DenseMLPWeights, x: torch.Tensor) -> torch.Tensor:
    return linear(gate_up(x, w.gate, w.up, activation(cfg)), w.down)


def moe_forward(cfg: ModelConfig, layer: int, w: MoEWeights, x: torch.Tensor, experts: ExpertSource,
                routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                fused: FusedExperts | None = None) -> torch.Tensor:
    """Latent MoE: route on x, run the chosen experts on z = down(x), combine, norm, up, add shared(x)."""
    idx, weights = routing if routing is not None else route(cfg, w, x)
    z = linear(x, w.latent_down) if w.latent_down is not None else x
    if fused is not None:
        y = fused(layer, z, idx, weights)
    else:
        n_tok, k = idx.shape
        outs = torch.zeros(n_tok, k, cfg.expert_dim, dtype=torch.float32, device=x.device)
        chosen = idx.cpu()  # the experts are needed on the host anyway: one transfer, not a sync per expert
        ids = sorted(set(chosen.flatten().tolist()))
        for e, weights_e in experts(layer, ids):
            tok, slot = ((i.to(x.device, non_blocking=True) for i in (chosen == e).nonzero(as_tuple=True))
                         if x.device.type != "cpu" else (chosen == e).nonzero(as_tuple=True))
            outs[tok, slot] = expert_ffn(cfg, weights_e, z[tok]).float()
        y = (outs * weights.unsqueeze(-1)).sum(1)  # fixed slot order
    if w.latent_up is not None:
        if w.latent_norm is not None:
            y = rms_norm(y, w.latent_norm, cfg.rms_norm_eps)
        y = linear(y.to(x.dtype), w.latent_up)
    y = y.to(x.dtype)
    if w.shared is not None:
        y = y + dense_mlp(cfg, w.shared, x)
    return y
