"""Gated FFN activations (K3_SPEC §5), shared by the reference path and fused kernels.

SiTU(a, u) = [b*tanh(a/b)*sigmoid(a)] * [bl*tanh(u/bl)] (bl <= 0 leaves u), computed in fp32;
SwiGLU(a, u) = silu(a) * u (Kimi Linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GatedActivation:
    kind: str  # "situ" | "silu"
    beta: float = 4.0
    linear_beta: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate, up) in gate's dtype."""
        if self.kind == "situ":
            return situ(gate, up, self.beta, self.linear_beta).to(gate.dtype)
        return F.silu(gate) * up


def situ(a: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    a, u = a.float(), u.float()
    gate = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    if linear_beta > 0:
        u = linear_beta * torch.tanh(u / linear_beta)
    return gate * u
