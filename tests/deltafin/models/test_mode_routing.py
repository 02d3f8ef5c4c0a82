"""The expert modes' routers against references computed here row by row."""

from __future__ import annotations

import torch

from deltafin.checkpoint.config import load_config
from deltafin.expert_modes import ExpertMode
from deltafin.kernels.linear import linear
from deltafin.models.mode_routing import held_bonus, mode_router, top_p
from deltafin.models.moe import moe_forward, route, routed_sum


def _reference_top_p(idx: list[int], w: list[float], p: float, k_min: int) -> dict[int, float]:
    """The fewest experts, heaviest first, whose weight reaches p of the row's, at least k_min; weights scaled back."""
    order = sorted(range(len(w)), key=lambda j: -w[j])
    total, kept, acc = sum(w), [], 0.0
    for j in order:
        if len(kept) >= k_min and acc / total >= p:
            break
        kept.append(j)
        acc += w[j]
    scale = total / sum(w[j] for j in kept)
    return {idx[j]: w[j] * scale for j in kept}


def test_top_p_keeps_the_fewest_reaching_p_and_pads_with_zero_weight() -> None:
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(50)])
    weights = torch.rand(50, 8, generator=g) ** 3
    for p, k_min in ((0.5, 1), (0.7, 2), (0.9, 1)):
        got_idx, got_w = top_p(idx, weights, p, k_min)
        assert got_idx.shape == got_w.shape and got_idx.shape[1] <= 8
        for r in range(50):
            want = _reference_top_p(idx[r].tolist(), weights[r].tolist(), p, k_min)
            got = {int(e): float(v) for e, v in zip(got_idx[r], got_w[r], strict=True) if v != 0}
            assert got.keys() == want.keys()
            for e in want:
                assert abs(got[e] - want[e]) < 1e-5 * want[e] + 1e-7  # fp32 sums in a different order
            pads = [int(e) for e, v in zip(got_idx[r], got_w[r], strict=True) if v == 0]
            assert all(e == int(got_idx[r, 0]) for e in pads)  # no read of its own


def test_a_top_p_layer_is_exact_over_the_kept_experts(tiny_dir) -> None:
    """The MoE output with top-p equals the exact layer's math run over the kept experts alone (the weight-0 pads
    add exact zeros)."""
    from deltafin.runtime.pipeline import LocalPipeline

    pipe = LocalPipeline.load(tiny_dir, 1, device="cpu")
    stage = pipe.stages[0]
    cfg = stage.cfg
    layer = cfg.moe_layers[0]
    w = stage.spine.layer(layer).ffn
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    router = mode_router(cfg, ExpertMode(0.6))
    idx, weights = router(layer, w, x)
    z = linear(x, w.latent_down) if w.latent_down is not None else x
    ref = routed_sum(cfg, layer, z, *_compact(idx, weights), stage.experts.experts)
    got = routed_sum(cfg, layer, z, idx, weights, stage.experts.experts)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert not torch.equal(moe_forward(cfg, layer, w, x, stage.experts.experts, router=router),
                           moe_forward(cfg, layer, w, x, stage.experts.experts))
    pipe.close()


def _compact(idx: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept experts only, rows padded with their first at weight 0 to the widest: an independent layout."""
    rows = [[(int(e), float(v)) for e, v in zip(i, w, strict=True) if v != 0]
            for i, w in zip(idx, weights, strict=True)]
    width = max(len(r) for r in rows)
    i = torch.tensor([[e for e, _ in r] + [r[0][0]] * (width - len(r)) for r in rows])
    w = torch.tensor([[v for _, v in r] + [0.0] * (width - len(r)) for r in rows])
    return i, w


def test_cache_aware_routing_prefers_a_held_expert_within_the_margin_only(tiny_dir) -> None:
    cfg = load_config(tiny_dir)
    e, k = cfg.num_experts, cfg.experts_per_token
    scores = torch.linspace(0.9, 0.1, e)  # expert j's score, falling
    # a router whose sigmoid gives `scores` for x = one-hot rows: logit(scores) as its weight
    w = type("W", (), {"router": torch.logit(scores).unsqueeze(1), "bias": torch.zeros(e)})()
    x = torch.ones(1, 1)
    exact_idx, _ = route(cfg, w, x)
    assert sorted(exact_idx[0].tolist()) == list(range(k))
    gap = float(scores[k - 1] - scores[k])  # the last chosen over the first left out
    near = held_bonus(e, {k}, gap * 1.5, torch.device("cpu"))
    far = held_bonus(e, {k + 2}, gap * 1.5, torch.device("cpu"))
    assert k in route(cfg, w, x, near)[0][0].tolist()  # within the margin: the held one is chosen
    assert sorted(route(cfg, w, x, far)[0][0].tolist()) == list(range(k))  # beyond it: exact
    assert held_bonus(e, set(), 0.1, torch.device("cpu")) is None
    held_router = mode_router(cfg, ExpertMode(None, gap * 1.5), lambda layer: {k})
    idx, weights = held_router(0, w, x)
    assert k in idx[0].tolist() and (k - 1) not in idx[0].tolist()
    if cfg.renormalize:
        assert torch.allclose(weights.sum(-1), torch.full((1,), cfg.routed_scaling_factor))
