"""A prompt's division of a layer's experts among the holders (plan/cluster/prompt_split.py, pure; which experts go
where: runtime/wide.py prompt_owners): against a brute-force schedule (each expert to
the holder that would finish it first: optimal for equal items), whole experts summing to those touched, each
holder's own range kept where it has room, and holders that do not hold the layer or cannot read left out."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deltafin.plan.cluster.links import Link, profile
from deltafin.plan.cluster.prompt_split import HolderSpeed, PromptSplit, balanced_counts, streamed_finish
from deltafin.runtime.wide import prompt_owners


def _greedy(total: int, per: list[float], fixed: list[float]) -> float:
    """The least time every holder is done by, item by item to whoever finishes it first (optimal: the items are
    equal, so a schedule is only how many each holder takes)."""
    counts = [0] * len(per)
    for _ in range(total):
        able = [j for j in range(len(per)) if math.isfinite(per[j])]
        i = min(able, key=lambda j: fixed[j] + (counts[j] + 1) * per[j])
        counts[i] += 1
    return max(fixed[i] + counts[i] * per[i] for i in range(len(per)) if counts[i])


def _finish(counts: list[int], per: list[float], fixed: list[float]) -> float:
    return max(fixed[i] + n * per[i] for i, n in enumerate(counts) if n)


def test_balanced_counts_is_within_one_item_of_the_best_schedule():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 5)
        per = [rng.uniform(0.01, 0.2) for _ in range(n)]
        fixed = [0.0 if i == 0 else rng.choice([0.0, rng.uniform(0, 5), rng.uniform(5, 100)]) for i in range(n)]
        total = rng.randint(1, 900)
        counts = balanced_counts(total, per, fixed)
        assert sum(counts) == total and min(counts) >= 0
        assert _finish(counts, per, fixed) <= _greedy(total, per, fixed) + max(per) + 1e-9


def test_balanced_counts_by_hand():
    assert balanced_counts(896, [0.07, 0.07], [0.0, 0.0]) == [448, 448]  # equal disks, free links: the placement's
    assert balanced_counts(896, [0.07, 0.07], [0.0, 14.0]) == [548, 348]  # 14 s of crossings: 100 experts move
    assert balanced_counts(10, [1.0, 1.0], [0.0, 100.0]) == [10, 0]  # a link slower than all the reads: none there
    assert balanced_counts(9, [1.0, 0.5], [0.0, 0.0]) == [3, 6]  # a disk twice as fast takes twice as many
    assert balanced_counts(5, [1.0, math.inf], [0.0, 0.0]) == [5, 0]  # a holder that cannot read takes none
    assert balanced_counts(0, [1.0, 1.0], [0.0, 1.0]) == [0, 0]
    with pytest.raises(ValueError):
        balanced_counts(3, [math.inf], [0.0])


def test_a_holder_s_time_is_its_reads_or_its_compute_whichever_is_longer():
    fast_disk = HolderSpeed(read_bps=1e9, expert_one_s=0.002, expert_token_s=0.001)
    assert fast_disk.per_expert(10**6, pairs_per_expert=1) == pytest.approx(0.002)  # one token: the weights' pass
    assert fast_disk.per_expert(10**6, pairs_per_expert=50) == pytest.approx(0.05)  # a prompt's tokens
    assert HolderSpeed(read_bps=1e8).per_expert(10**6, 50) == pytest.approx(0.01)  # compute not known: the read
    assert HolderSpeed(read_bps=0.0).per_expert(10**6, 1) == math.inf


def _split(link: Link) -> PromptSplit:
    # two holders reading 1 MB experts at 100 MB/s (10 ms each); the stage is holder 0
    return PromptSplit((HolderSpeed(1e8), HolderSpeed(1e8)), (None, link), experts_per_token=4,
                       bytes_per_expert=10**6, row_bytes=1000)


def test_owners_keep_each_holder_s_own_range_where_it_has_room_and_move_the_rest():
    bounds = (0, 32, 64)
    ids = torch.tensor([3, 40, 40, 5, 63, 33, 34, 35, 36, 37, 38, 39, 10, 41])  # a forward's pairs
    distinct = torch.unique(ids)
    # free links: the 13 touched split 7 / 6 (the earlier holder first on a tie); holder 1 had 10 of them and keeps
    # its 6 lowest
    free_owners = prompt_owners(_split(profile(0.0, 10**9)), bounds, ids, tokens=4)
    free = dict(zip(ids.tolist(), free_owners.tolist(), strict=True))
    assert [e for e in sorted(free) if free[e] == 1] == [33, 34, 35, 36, 37, 38]
    # 100 rows each way at 1 KB over 1 MB/s: 0.2 s of crossings, 20 experts' reads: holder 1 keeps none of its 10
    slow = prompt_owners(_split(profile(0.0, 8)), bounds, ids, tokens=100)
    assert slow.tolist() == [0] * len(ids)
    # 50 ms of crossings: holder 1 takes 5 fewer than holder 0, of the 13 touched: 4 (its lowest ids), holder 0 9
    some = prompt_owners(_split(profile(0.0, 32)), bounds, ids, tokens=100)
    by_expert = dict(zip(ids.tolist(), some.tolist(), strict=True))
    assert len(by_expert) == len(distinct)  # one holder an expert, however many pairs
    assert [e for e in sorted(by_expert) if by_expert[e] == 1] == [33, 34, 35, 36]
    assert sum(1 for h in by_expert.values() if h == 0) == 9


def test_a_holder_without_the_layer_takes_none():
    split = _split(profile(0.0, 10**9))
    assert split.counts(10, tokens=4, holds=[True, False]) == [10, 0]
    assert prompt_owners(split, (0, 64, 64), torch.tensor([1, 2, 60]), tokens=100).tolist() == [0, 0, 0]


def test_sums_streamed_back_overlap_the_work_by_when_rows_are_done():
    """A row's sum goes once its last pair is done: with one pair a token each row is done as its expert is, so the
    crossing hides under the work (the longer of the two); with 16 pairs all on this holder most rows are done near
    the end (x^16), so most of the crossing still follows it; never more than the two in a row."""
    assert streamed_finish(10.0, 4.0, pairs=1, share=1.0) == pytest.approx(10.0)
    assert streamed_finish(4.0, 10.0, pairs=1, share=1.0) == pytest.approx(10.0)
    x = (10 / 80) ** (1 / 15)  # where 10 x + 5 (1 - x^16) peaks
    assert streamed_finish(10.0, 5.0, pairs=16, share=1.0, steps=4096) == pytest.approx(10 * x + 5 * (1 - x ** 16),
                                                                                         rel=1e-4)
    for pairs, share in ((16, 0.5), (16, 0.05), (4, 0.3)):
        t = streamed_finish(10.0, 5.0, pairs, share)
        assert 10.0 <= t <= 15.0
    # a holder with a small share sees few pairs a row: its rows are done earlier, more of the crossing hides
    assert streamed_finish(10.0, 5.0, 16, 0.05) < streamed_finish(10.0, 5.0, 16, 0.5) < streamed_finish(10.0, 5.0,
                                                                                                      16, 1.0)
    assert streamed_finish(0.0, 5.0, 16, 0.5) == 5.0 and streamed_finish(3.0, 0.0, 16, 0.5) == 3.0
