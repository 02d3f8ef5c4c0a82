"""The placement of wide experts (pure): contiguous ranges in proportion to weights, every expert owned once,
holders without a layer's bytes get none of it, shares that give every disk the same reading time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltafin.plan.cluster.expert_placement import ExpertPlacement, ExpertRanges, Holder, cache_aware_weights, split


@given(st.integers(0, 2000), st.lists(st.floats(0, 100), min_size=1, max_size=9).filter(lambda w: sum(w) > 0))
def test_split_is_contiguous_complete_and_proportional(n, weights):
    b = split(0, n, weights)
    assert b[0] == 0 and b[-1] == n and all(x <= y for x, y in zip(b, b[1:], strict=False))
    total = sum(weights)
    for i, w in enumerate(weights):
        assert abs((b[i + 1] - b[i]) - n * w / total) < 1  # largest remainder: within one expert of exact
        if w == 0:
            assert b[i + 1] == b[i]


def test_split_examples_and_errors():
    assert split(0, 896, [1, 1, 1, 1]) == (0, 224, 448, 672, 896)
    assert split(0, 10, [1, 2]) == (0, 3, 10)  # 3.33 / 6.67: the larger remainder gets the spare expert
    assert split(100, 110, [1, 0, 1]) == (100, 105, 105, 110)
    for bad in ([], [0, 0], [-1, 2], [float("nan")]):
        with pytest.raises(ValueError):
            split(0, 10, bad)


@given(st.lists(st.tuples(st.floats(0.1, 10), st.floats(0, 0.3)), min_size=1, max_size=6))
def test_cache_aware_shares_give_every_disk_the_same_time(holders):
    bw, cache = [h[0] for h in holders], [h[1] for h in holders]
    shares = cache_aware_weights(bw, cache)
    if sum(cache) < 1:
        assert sum(shares) == pytest.approx(1.0)
        times = [(s - c) / b for s, c, b in zip(shares, cache, bw, strict=True)]  # what each reads / its speed
        assert max(times) == pytest.approx(min(times))
    assert all(s >= c for s, c in zip(shares, cache, strict=True))


def test_cache_aware_shares_when_the_caches_hold_everything():
    assert cache_aware_weights([1.0, 5.0], [0.6, 0.6]) == [0.6, 0.6]  # nothing is read: follow the caches
    assert cache_aware_weights([2.0, 1.0], [0.0, 0.0]) == pytest.approx([2 / 3, 1 / 3])


def test_placement_owners_shares_and_holders_without_a_layer():
    holds = {"a": {1, 2, 3}, "b": {1, 2, 3}, "c": {2, 3}}
    p = ExpertRanges.build(["a", "b", "c"], [1, 2, 3], 12, lambda i, layer: 1.0 if layer in holds["abc"[i]]
                              else 0.0)
    assert p.bounds_of(1) == (0, 6, 12, 12) and p.bounds_of(2) == (0, 4, 8, 12)
    assert p.share(2, 1) == range(12, 12) and p.layers_of(2) == (2, 3) and p.layers_of(0) == (1, 2, 3)
    for layer in p.layers:
        owners = [p.owner(layer, e) for e in range(12)]
        assert owners == sorted(owners) and all(e in p.share(owners[e], layer) for e in range(12))
    assert p.count(0) == 6 + 4 + 4 and p.fraction(2) == pytest.approx(8 / 36)
    assert p.describe(0) == "14/36" and ExpertRanges.build(["x"], [1, 2], 8, lambda i, _: 1).describe(0) == "8/8x2"
    with pytest.raises(KeyError):
        p.owner(0, 1)
    with pytest.raises(ValueError, match="no holder"):
        ExpertRanges.build(["a"], [1], 8, lambda i, _: 0.0)
    with pytest.raises(ValueError, match="one holder per key of its ranges"):
        ExpertPlacement(p, (Holder("a", "h:1"), Holder("c", "h:3"), Holder("b", "h:2")))
