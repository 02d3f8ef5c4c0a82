"""Attention Residuals (K3_SPEC §2): the residual state a stage hands to the next, and the depth mixer.

Per token, the state entering layer l is P [D] (the running sum of the current block) and B [n, D]
(the banked block sums, b0 = the embedding), n = ceil(l / S). Without AttnRes (Kimi Linear) it is
just P, the ordinary residual stream, with n = 0.

Shapes: N = tokens (packed over sequences), n = banked blocks, D = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltafin.models.common import rms_norm

ATTN_RES_EPS = 1e-5


@dataclass(frozen=True)
class ResidualState:
    P: torch.Tensor  # [N, D]
    B: torch.Tensor  # [N, n, D]

    @property
    def num_tokens(self) -> int:
        return self.P.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.B.shape[1]

    @staticmethod
    def nbytes_per_token(num_blocks: int, hidden: int, element_size: int) -> int:
        """Exact wire/memory size per token: (1 + n) * D * dtype size."""
        return (1 + num_blocks) * hidden * element_size

    @classmethod
    def start(cls, embeddings: torch.Tensor) -> ResidualState:
        n, d = embeddings.shape
        return cls(embeddings, embeddings.new_empty(n, 0, d))

    def split(self, lengths: list[int]) -> list[ResidualState]:
        return [ResidualState(p, b) for p, b in zip(self.P.split(lengths), self.B.split(lengths), strict=True)]

    def with_room(self, blocks: int) -> ResidualState:
        """A copy of the state whose B sits in a buffer with room for `blocks` blocks, so that a layer banks one
        in place (`wider`): a long forward's state, held once rather than once into and once out of a layer."""
        n, d = self.P.shape[0], self.P.shape[1]
        room = self.B.new_empty(n, max(blocks, self.num_blocks), d)
        room[:, :self.num_blocks] = self.B
        return ResidualState(self.P.clone(), room[:, :self.num_blocks])

    @classmethod
    def cat(cls, states: list[ResidualState]) -> ResidualState:
        if len(states) == 1:
            return states[0]
        return cls(torch.cat([s.P for s in states]), torch.cat([s.B for s in states]))


def wider(B: torch.Tensor, blocks: int) -> torch.Tensor:
    """B [N, n, D] as `blocks` blocks: in the room of its buffer (ResidualState.with_room: a view, the new blocks
    for the caller to write), else a new tensor with B copied into its first n."""
    n, d = B.shape[1], B.shape[2]
    if blocks <= n:
        return B[:, :blocks]
    if B.stride() == (B.stride(0), d, 1) and B.stride(0) >= blocks * d:
        return B.as_strided((B.shape[0], blocks, d), B.stride(), B.storage_offset())
    out = B.new_empty(B.shape[0], blocks, d)
    out[:, :n] = B
    return out


def attn_res_mix(B: torch.Tensor, P: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Softmax-over-depth mix of [B, P]: scores from the RMS-normalized values, the sum of the raw ones.

    score = res_norm.weight * res_proj.weight[0] (fp32 [D]). Returns [N, D] in P's dtype.
    """
    if B.shape[1] == 0:
        return P
    V = torch.cat([B, P.unsqueeze(1)], dim=1).float()  # [N, n+1, D]
    s = (rms_norm(V, None, ATTN_RES_EPS) * score).sum(-1)  # [N, n+1]
    p = torch.softmax(s, dim=-1)
    return (p.unsqueeze(-1) * V).sum(1).to(P.dtype)
