"""Norms and the activation choice shared by every layer (K3_SPEC §2, §5)."""

from __future__ import annotations

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.kernels.activations import GatedActivation


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


def activation(cfg: ModelConfig) -> GatedActivation:
    """The FFN nonlinearity: SiTU for K3, SwiGLU (silu(gate) * up) for Kimi Linear."""
    return GatedActivation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
