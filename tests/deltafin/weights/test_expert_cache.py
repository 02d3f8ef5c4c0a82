"""Expert cache: pure tests of the budget and the eviction policies (no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafin.weights.expert_cache import LFU, LRU, ExpertCache, PinnedLRU, make_policy, simulate


def _cache(policy, budget=4):
    evicted = []
    cache = ExpertCache(budget, policy, on_evict=lambda k, e: evicted.append(k))
    return cache, evicted


def test_lru_evicts_least_recently_used():
    cache, evicted = _cache(LRU())
    for k in "abcd":
        cache.put(k, k, 1)
    cache.get("a")  # a is now the most recent
    cache.put("e", "e", 1)
    assert evicted == ["b"] and set(cache.entries) == {"a", "c", "d", "e"}


def test_lfu_evicts_least_frequently_used():
    cache, evicted = _cache(LFU())
    for k in "abcd":
        cache.put(k, k, 1)
    for _ in range(3):
        cache.get("a"), cache.get("b"), cache.get("d")
    cache.put("e", "e", 1)
    assert evicted == ["c"]
    cache.put("f", "f", 1)  # e was touched once, the others four times
    assert evicted == ["c", "e"]


def test_pinned_tier_keeps_the_most_frequent():
    cache, evicted = _cache(PinnedLRU(capacity_pinned=2))
    for k in "abcd":
        cache.put(k, k, 1)
    for _ in range(5):
        cache.get("a"), cache.get("b")  # a, b are the frequent ones...
    cache.get("c"), cache.get("d")  # ...though c, d were used last
    cache.put("e", "e", 1)
    cache.put("f", "f", 1)
    assert evicted == ["c", "d"]  # LRU among the unpinned; a and b stay


def test_entries_in_use_are_never_evicted_and_budget_holds():
    cache, evicted = _cache(LRU(), budget=10)
    assert cache.put("a", 1, 4, pinned=True) and cache.put("b", 2, 4)
    assert cache.put("c", 3, 4)  # evicts b, not the pinned a
    assert evicted == ["b"]
    assert not cache.put("d", 4, 7)  # cannot fit without evicting a
    assert cache.used == 8 and set(cache.entries) == {"a", "c"}
    assert not cache.put("huge", 5, 11)
    cache.unpin("a")
    assert cache.put("d", 4, 7) and cache.used <= 10


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu", "pinned"]),
       ops=st.lists(st.tuples(st.sampled_from(["put", "get", "pin", "unpin"]), st.integers(0, 15),
                              st.integers(1, 6)), max_size=120))
def test_budget_is_never_exceeded(policy, ops):
    cache = ExpertCache(12, make_policy(policy, 6))
    pins: dict[int, int] = {}
    for op, key, size in ops:
        if op == "put":
            if pins.get(key):
                continue  # replacing an entry in use is not something the store does
            cache.put(key, key, size)
        elif op == "get":
            cache.get(key)
        elif op == "pin" and key in cache.entries:
            cache.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif op == "unpin" and pins.get(key):
            cache.unpin(key)
            pins[key] -= 1
        assert cache.used == sum(e.nbytes for e in cache.entries.values()) <= cache.budget
        assert all(k in cache.entries for k, n in pins.items() if n)  # pinned entries survive


def test_simulated_hit_rates_order_as_expected():
    # a skewed trace: 4 hot experts used every step, then a cold one; room for 5
    trace = [[("L", h) for h in range(4)] + [("L", 100 + i)] for i in range(200)]
    assert simulate("lfu", 5, trace) > 0.79 and simulate("pinned", 5, trace) > 0.79
    # three hot keys each step, then a scan of five one-off keys; room for 5: the scans flush LRU
    scans = [[("L", h) for h in range(3)] + [("S", 5 * i + j) for j in range(5)] for i in range(100)]
    assert simulate("lru", 5, scans) == 0.0
    assert simulate("lfu", 5, scans) > 0.35
    assert simulate("pinned", 5, scans) > 0.2  # pins half the budget: two of the three hot keys


def test_a_warmed_entry_takes_only_free_room_and_ranks_as_remembered_use():
    """Seeded (warmed at start, hottest first): never evicts to get in; LFU keeps it above an expert used once
    since the start and below one used twice; LRU and the pinned tier's LRU evict the coldest warmed first."""
    cache, evicted = _cache(LFU(), budget=3)
    assert cache.put("hot", 0, 1, seed=2.0) and cache.put("warm", 0, 1, seed=1.5)
    cache.put("once", 0, 1)
    assert not cache.put("cold", 0, 1, seed=1.1) and evicted == [] and set(cache.entries) == {"hot", "warm", "once"}
    cache.put("new", 0, 1)  # evicts the expert used once, not the warmed ones
    assert evicted == ["once"]
    cache.get("new")  # used twice now: above the warmed ones but the hottest (a tie, which recency breaks)
    cache.put("newer", 0, 1)
    assert evicted == ["once", "warm"]
    for policy in (LRU(), PinnedLRU(capacity_pinned=0)):
        cache, evicted = _cache(policy, budget=3)
        for key, weight in (("hot", 2.0), ("warm", 1.5), ("cold", 1.1)):
            assert cache.put(key, 0, 1, seed=weight)
        cache.put("a", 0, 1)
        cache.put("b", 0, 1)
        assert evicted == ["cold", "warm"]


def _belady_hits(capacity: int, trace: list[list[tuple[int, int]]]) -> int:
    """Hits of the optimal offline policy (evict what is next needed furthest ahead): an independent reference."""
    keys = [k for step in trace for k in step]
    held: set = set()
    hits = 0
    for i, key in enumerate(keys):
        if key in held:
            hits += 1
            continue
        if len(held) >= capacity:
            later = {k: next((j for j in range(i + 1, len(keys)) if keys[j] == k), len(keys)) for k in held}
            held.remove(max(later, key=later.get))
        held.add(key)
    return hits


def test_least_stale_keeps_the_layers_ahead_where_lru_thrashes() -> None:
    """Every token uses the same expert in each of 3 layers, the cache holds 2: LRU evicts the next layer's each
    time (no hit); least-stale evicts the layer just used, and hits as often as the optimal policy."""
    trace = [[(layer, 7)] for _ in range(20) for layer in range(3)]
    lookups = len(trace)
    assert simulate("lru", 2, trace) == 0.0
    assert simulate("least-stale", 2, trace) * lookups == pytest.approx(_belady_hits(2, trace))
    assert simulate("least-stale", 2, trace) > 0.45  # the optimum: every other lookup, once warm


def test_least_stale_evicts_the_stalest_first() -> None:
    """Stalest first (its layer has been visited since without it), then the one whose layer comes round last."""
    cache: ExpertCache = ExpertCache(4, make_policy("least-stale", 4))
    for key in [(0, 1), (1, 1), (2, 1), (0, 2)]:  # a token through layers 0-2, the next one at layer 0 ...
        cache.put(key, None, 1)
    assert cache.get((1, 1)) is not None  # ... and layer 1
    # (0, 1): layer 0 passed it over; (1, 1) and (0, 2): just used, layer 1's comes round last; (2, 1): next
    assert cache.policy.victims() == [(0, 1), (1, 1), (0, 2), (2, 1)]
    assert make_policy("lru", 4).__class__ is LRU
