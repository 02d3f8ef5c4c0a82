"""Attention residuals: the mix over earlier blocks is a softmax over depth."""

from __future__ import annotations

import torch

from deltafin.models.attn_res import ResidualState, attn_res_mix


def test_attn_res_mix_is_a_softmax_over_depth():
    g = torch.Generator().manual_seed(6)
    B, P, score = torch.randn(4, 3, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
    V = torch.cat([B, P[:, None]], 1)
    s = ((V / V.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()) * score).sum(-1)
    want = (torch.softmax(s, -1)[..., None] * V).sum(1)
    assert torch.allclose(attn_res_mix(B, P, score), want, atol=1e-6)  # fp32, O(1) values, another sum order
    assert torch.equal(attn_res_mix(B[:, :0], P, score), P)  # nothing banked: the stream itself
    assert ResidualState.nbytes_per_token(8, 7168, 2) == 9 * 7168 * 2
