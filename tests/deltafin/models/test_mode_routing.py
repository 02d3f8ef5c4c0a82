"""The expert modes' routers against references computed here row by row."""

from __future__ import annotations

import torch

from deltafin.checkpoint.config import load_config
from deltafin.expert_modes import ExpertMode
from deltafin.kernels.linear import linear
from deltafin.models.mode_routing import held_bonus, low_bit_ids, mode_router, top_p
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


def _reference_light(idx: list[int], w: list[float], tail: float) -> set[int]:
    """A row's light slots: after the heaviest (in order, ties by slot) whose share of the row's weight reaches tail."""
    order = sorted(range(len(w)), key=lambda j: -w[j])
    total, acc, light = sum(w), 0.0, set()
    for j in order:
        if acc / total >= tail and w[j] > 0:
            light.add(j)
        acc += w[j]
    return light


def test_a_tail_reads_the_copy_of_light_experts_not_held_nor_heavy_elsewhere() -> None:
    g = torch.Generator().manual_seed(4)
    e_count = 64
    idx = torch.stack([torch.randperm(e_count, generator=g)[:8] for _ in range(40)])
    weights = torch.rand(40, 8, generator=g) ** 2
    weights[:5, 6:] = 0  # top-p's padding slots: no read, never a copy
    assert torch.equal(low_bit_ids(idx, weights, e_count, None), idx + e_count)  # every expert's copy
    held = torch.tensor([3, 10, 17])
    for tail in (0.3, 0.6):
        got = low_bit_ids(idx, weights, e_count, tail, held)
        light = [_reference_light(i, w, tail) for i, w in zip(idx.tolist(), weights.tolist(), strict=True)]
        heavy = {idx[r, j].item() for r in range(40) for j in range(8) if j not in light[r]}
        for r in range(40):
            for j in range(8):
                e = idx[r, j].item()
                copy = j in light[r] and e not in held.tolist() and e not in heavy
                assert got[r, j].item() == (e + e_count if copy else e)
        assert bool((got >= e_count).any()) and bool((got < e_count).any())


def test_the_mode_router_reads_a_tail_against_what_the_store_holds(tiny_dir) -> None:
    """held() names both forms (a copy as E + e): a tail reads as stored what is held as stored; cache-aware routing
    prefers an expert held in either form."""
    from deltafin.runtime.pipeline import LocalPipeline

    pipe = LocalPipeline.load(tiny_dir, 1, device="cpu")
    cfg, stage = pipe.stages[0].cfg, pipe.stages[0]
    layer, e_count = cfg.moe_layers[0], cfg.num_experts
    w = stage.spine.layer(layer).ffn
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    exact_idx, _ = route(cfg, w, x)
    none = mode_router(cfg, ExpertMode(low_bit="q3", low_tail=0.3), lambda layer: [])(layer, w, x)[0]
    assert bool((none >= e_count).any())
    every = sorted(set(exact_idx.flatten().tolist()))
    held_stored = mode_router(cfg, ExpertMode(low_bit="q3", low_tail=0.3), lambda layer: every)(layer, w, x)[0]
    assert torch.equal(held_stored, exact_idx)
    copies = [e + e_count for e in every]  # held as copies only: the light ones are read from them
    assert torch.equal(mode_router(cfg, ExpertMode(low_bit="q3", low_tail=0.3), lambda layer: copies)(layer, w, x)[0],
                       none)
    pipe.close()
