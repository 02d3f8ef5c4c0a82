"""Norms and activations shared by every layer (K3_SPEC §2, §5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltafin.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = w * (x_f32 * rsqrt(mean(x^2) + eps)).to(x.dtype); no weight: the normalized value in fp32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed
    return weight.to(x.dtype) * normed.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def situ(a: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU(a, u) = [b*tanh(a/b)*sigmoid(a)] * [bl*tanh(u/bl)]; bl <= 0 leaves u as is. fp32."""
    a, u = a.float(), u.float()
    gate = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    if linear_beta > 0:
        u = linear_beta * torch.tanh(u / linear_beta)
    return gate * u


def gated_activation(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The FFN nonlinearity: SiTU for K3, SwiGLU (silu(gate) * up) for Kimi Linear; returns x's dtype."""
    if cfg.hidden_act == "situ":
        return situ(gate, up, cfg.situ_beta, cfg.situ_linear_beta).to(gate.dtype)
    return F.silu(gate) * up
