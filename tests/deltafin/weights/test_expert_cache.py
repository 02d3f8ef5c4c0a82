"""Expert cache: pure tests of the budget and the eviction policies (no I/O)."""

from __future__ import annotations

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
