"""Wide experts in one process (tests/support/wide.py builds the workers with their own assignment code): the
result equals one process's for prompts, decode steps, batches, speculative forwards and prefixes, with holders
of unequal shares and holders without layers: bit for bit with one holder, to fp32 rounding with several (each
holder sums its share of a token: tests/support/wide.py's WIDE_CLOSE); calls split under a message cap answer what
the whole call does; holders check their calls; guesses reach the holders' disks; a new placement keeps stages and
sessions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltafin.errors import InvalidInput, NotHeld
from deltafin.plan.cluster.expert_placement import ExpertPlacement, ExpertRanges, Holder, HolderLink
from deltafin.plan.cluster.links import profile
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.wide import ExpertCall, ExpertHolder, call_pieces
from tests.support.wide import WideCluster, wide_close

IDS = torch.tensor([5, 100, 300, 7, 9, 700, 12, 44, 3, 1000, 2, 17])
def _run(pipe: LocalPipeline, steps: int = 4) -> list[torch.Tensor]:
    """Prefill logits of every position, then greedy steps' logits; and a batch of two sequences at once."""
    out = [pipe.forward([SeqInput("a", 0, ids=IDS)], all_logits=True)[0].logits]
    pos = len(IDS)
    for _ in range(steps):
        token = torch.tensor([int(out[-1][-1].argmax())])
        out.append(pipe.forward([SeqInput("a", pos, ids=token)])[0].logits)
        pos += 1
    both = pipe.forward([SeqInput("a", pos, ids=torch.tensor([3])), SeqInput("b", 0, ids=IDS[:7])],
                        all_logits=True)
    return [*out, *(o.logits for o in both)]


@pytest.fixture(scope="module")
def local(small_dir):
    pipe = LocalPipeline.load(small_dir, 1, device="cpu")
    try:
        yield _run(pipe)
    finally:
        pipe.close()


@pytest.mark.parametrize("stages, holders, weights", [(1, 0, None), (2, 0, [1.0, 3.0]), (3, 0, None),
                                                      (2, 2, [1.0, 1.0, 2.0, 0.5])])
def test_wide_equals_one_process(small_dir, local, stages, holders, weights):
    cluster = WideCluster(small_dir, stages, holders, weights)
    try:
        got = _run(cluster.pipeline)
        assert len(got) == len(local)
        for a, b in zip(got, local, strict=True):
            assert torch.equal(a, b) if stages + holders == 1 else wide_close(a, b)  # one holder: the same bits
        calls = {k: a.holder.served.calls for k, a in cluster.assigned.items()}
        if stages + holders > 1:
            assert all(n > 0 for k, n in calls.items() if cluster.expert_ranges.count(cluster.keys.index(k))), calls
    finally:
        cluster.close()


def test_each_holder_reads_only_its_share(small_dir):
    cluster = WideCluster(small_dir, 2, 1, [1.0, 1.0, 2.0])
    try:
        _run(cluster.pipeline)
        for i, key in enumerate(cluster.keys):
            stats = cluster.assigned[key].store.snapshot_stats()
            share = sum(len(cluster.expert_ranges.share(i, layer)) for layer in cluster.cfg.moe_layers)
            read = stats.over(cluster.cfg.moe_layers).expert_bytes
            # its cache holds all its share: each of its experts read once, but for guesses read twice (wasted)
            assert 0 < read <= share * cluster.cfg.bytes_per_expert + stats.wasted_bytes
            assert all(cluster.expert_ranges.share(i, layer) for layer, c in stats.by_layer.items() if c.expert_bytes)
    finally:
        cluster.close()


def test_speculative_forwards_and_prefixes_through_wide_stages(small_dir):
    """A speculative forward, a rewind to its second position, a kept prefix and a session resumed from it:
    the same logits through wide stages as through one process."""
    def steps(pipe: LocalPipeline) -> list[torch.Tensor]:
        out = [pipe.forward([SeqInput("s", 0, ids=IDS[:8], save_at=((8, "p8"),))], all_logits=True)[0].logits]
        out.append(pipe.forward([SeqInput("s", 8, ids=IDS[8:12], speculative=True)])[0].logits)
        out.append(pipe.forward([SeqInput("s", 10, ids=torch.tensor([9]))])[0].logits)
        out.append(pipe.forward([SeqInput("r", 8, ids=IDS[8:10], resume_from="p8")], all_logits=True)[0].logits)
        return out

    one = LocalPipeline.load(small_dir, 1, device="cpu")
    cluster = WideCluster(small_dir, 2, 1)
    try:
        for a, b in zip(steps(cluster.pipeline), steps(one), strict=True):
            assert wide_close(a, b)
    finally:
        cluster.close()
        one.close()


def test_a_new_placement_keeps_stages_sessions_and_stores(small_dir):
    """A holder leaves: the same layers and options keep their Stage (its session continues) and its store;
    the lost holder's experts are computed by the others, with the same result."""
    one = LocalPipeline.load(small_dir, 1, device="cpu")
    cluster = WideCluster(small_dir, 2, 1)
    try:
        want = one.forward([SeqInput("a", 0, ids=IDS)])[0].logits
        assert wide_close(cluster.pipeline.forward([SeqInput("a", 0, ids=IDS)])[0].logits, want)
        stages = [a.stage for a in cluster.assigned.values()]
        stores = [a.store for a in cluster.assigned.values()]
        keys = cluster.keys[:2]
        placement = ExpertRanges.build(keys, cluster.cfg.moe_layers, cluster.cfg.num_experts, lambda i, _: 1.0)
        gone = cluster.assigned.pop(cluster.keys[2])
        cluster.keys = keys
        cluster.ranges = cluster.ranges[:2]
        cluster.assign(ExpertPlacement(placement, tuple(Holder(k, f"local:{k}", k) for k in keys)))
        gone.close()
        assert [a.stage for a in cluster.assigned.values()] == stages[:2]  # the same objects: nothing reloaded
        assert [a.store for a in cluster.assigned.values()] == stores[:2]
        step = torch.tensor([int(want[-1].argmax())])
        assert wide_close(cluster.pipeline.forward([SeqInput("a", len(IDS), ids=step)])[0].logits,
                      one.forward([SeqInput("a", len(IDS), ids=step)])[0].logits)
    finally:
        cluster.close()
        one.close()


def test_a_prompt_s_calls_follow_the_links_and_a_token_s_the_placement(small_dir, local):
    """The plan's holder speeds and links reach the stages: over a link where a 12-token prompt's rows would take
    half a second each way against well under a millisecond of reads, a prompt's calls leave every expert with the
    stage that owns the layer (no call crosses), while a decoded token's follow the placement; the logits stay one
    process's (to the wide rounding)."""
    cluster = WideCluster(small_dir, 2, 0)
    try:
        holders = tuple(dataclasses.replace(h, expert_gbps=1.0) for h in cluster.placement.holders)
        slow = HolderLink("w0", "w1", profile(4.0, 0.2))  # 25 KB/s
        cluster.assign(dataclasses.replace(cluster.placement, holders=holders, links=(slow,)))
        pipe = cluster.pipeline
        prompt = pipe.forward([SeqInput("a", 0, ids=IDS)], all_logits=True)[0].logits
        assert wide_close(prompt, local[0])
        assert [a.holder.served.calls for a in cluster.assigned.values()] == [0, 0]
        token = torch.tensor([int(prompt[-1].argmax())])
        assert wide_close(pipe.forward([SeqInput("a", len(IDS), ids=token)])[0].logits, local[1])
        assert all(a.holder.served.calls > 0 for a in cluster.assigned.values())
    finally:
        cluster.close()


def test_guesses_reach_the_holders_disks(small_dir):
    cluster = WideCluster(small_dir, 2, 2, cache_bytes=0)
    try:
        _run(cluster.pipeline, steps=8)
        issued = {k: a.store.snapshot_stats().prefetch_issued for k, a in cluster.assigned.items()}
        hits = {k: a.store.snapshot_stats().prefetch_hits for k, a in cluster.assigned.items()}
        for key in cluster.keys[2:]:  # holders without layers read ahead only because stages told them
            assert issued[key] > 0 and hits[key] > 0, (issued, hits)
    finally:
        cluster.close()


def test_a_holder_answers_each_token_s_weighted_sum_and_split_calls_add_up_to_it(small_dir):
    """A call's answer is one row a token: its pairs' weighted outputs summed (against each expert run alone and
    the sum in float64); cut under a message cap into pieces of whole experts, the pieces' sums add up to it."""
    cluster = WideCluster(small_dir, 1)
    try:
        holder = cluster.assigned["w0"].holder
        cfg = cluster.cfg
        g = torch.Generator().manual_seed(3)
        z = torch.randn(40, cfg.expert_dim, generator=g)
        idx = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.experts_per_token] for _ in range(40)])
        weights = torch.rand(40 * cfg.experts_per_token, generator=g)
        rows = torch.arange(40).repeat_interleave(cfg.experts_per_token)
        call = ExpertCall(cfg.moe_layers[0], z, rows, idx.reshape(-1), weights)
        whole = holder.run(call)
        pairs = torch.stack([holder.run(ExpertCall(call.layer, z[r:r + 1], torch.zeros(1, dtype=torch.long),
                                                   call.experts[p:p + 1], torch.ones(1)))[0]
                             for p, r in enumerate(rows.tolist())])  # each pair alone, unweighted
        want = torch.zeros(40, cfg.expert_dim, dtype=torch.float64).index_add_(0, rows, pairs.double()
                                                                              * weights.double()[:, None])
        assert whole.shape == (40, cfg.expert_dim) and torch.allclose(whole.double(), want, rtol=1e-5, atol=1e-6)
        cap = 2 * 60 * cfg.expert_dim * 4  # 60 pairs a piece, rows and sums
        pieces = call_pieces(call, cap)
        assert len(pieces) > 3
        out = torch.zeros_like(whole)
        experts = [set(piece.experts.tolist()) for _, piece in pieces]
        assert sum(map(len, experts)) == len(set().union(*experts))  # whole experts: none in two pieces
        for tokens, piece in pieces:
            assert 2 * piece.pairs * cfg.expert_dim * 4 <= cap and bool((piece.rows[1:] >= piece.rows[:-1]).all())
            out[tokens] += holder.run(piece)
        assert torch.allclose(out, whole, rtol=1e-5, atol=1e-6)
    finally:
        cluster.close()


@pytest.mark.parametrize("bf16", [False, True])
def test_a_holder_streams_each_row_once_as_it_is_done_with_the_bits_of_the_whole(small_dir, bf16):
    """`stream`: every row of the call in exactly one part, in parts of about the size asked, each row sent once its
    last pair is done, the first part before the holder's last expert; put together, the bits `run` answers."""
    cluster = WideCluster(small_dir, 1)
    try:
        holder: ExpertHolder = cluster.assigned["w0"].holder
        cfg = cluster.cfg
        g = torch.Generator().manual_seed(4)
        n = 60
        z = torch.randn(n, cfg.expert_dim, generator=g)
        idx = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.experts_per_token] for _ in range(n)])
        call = ExpertCall(cfg.moe_layers[1], z, torch.arange(n).repeat_interleave(cfg.experts_per_token),
                          idx.reshape(-1), torch.rand(n * cfg.experts_per_token, generator=g), bf16=bf16)
        whole = holder.run(call)
        events: list[str] = []
        store = holder.store
        experts = store.experts

        def counted(layer, ids):  # the store hands each expert over: count them as they go
            for e, weights in experts(layer, ids):
                events.append("expert")
                yield e, weights

        store.experts = counted
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            holder.stream(call, lambda rows, sums: (events.append("part"), parts.append((rows, sums))),
                          part_bytes=8 * cfg.expert_dim * 4)
        finally:
            store.experts = experts
        sent = torch.cat([rows for rows, _ in parts])
        assert sorted(sent.tolist()) == list(range(n))  # each row once
        assert len(parts) > 2 and all(bool((r[1:] > r[:-1]).all()) for r, _ in parts)
        assert events.index("part") < len(events) - 1 - events[::-1].index("expert")  # sent before the last expert
        got = torch.empty_like(whole)
        for rows, sums in parts:
            assert sums.dtype == (torch.bfloat16 if bf16 else torch.float32)
            got[rows] = sums
        assert torch.equal(got, whole)
    finally:
        cluster.close()


def test_a_holder_checks_its_calls(small_dir):
    cluster = WideCluster(small_dir, 1)
    try:
        cfg = cluster.cfg
        holder: ExpertHolder = cluster.assigned["w0"].holder
        good = ExpertCall(cfg.moe_layers[0], torch.zeros(2, cfg.expert_dim), torch.tensor([0, 1]),
                          torch.tensor([3, 4]), torch.tensor([0.5, 0.25]))
        assert holder.run(good).shape == (2, cfg.expert_dim)
        for bad, error, words in [
            (dataclasses.replace(good, z=torch.zeros(2, 7)), InvalidInput, "float32 or bfloat16"),
            (dataclasses.replace(good, z=good.z.double()), InvalidInput, "float32 or bfloat16"),
            (dataclasses.replace(good, rows=torch.tensor([0, 2])), InvalidInput, "rows must be in"),
            (dataclasses.replace(good, experts=torch.tensor([0, cfg.num_experts])), InvalidInput, "expert ids"),
            (dataclasses.replace(good, rows=torch.tensor([0])), InvalidInput, "as many rows"),
            (dataclasses.replace(good, weights=torch.tensor([0.5])), InvalidInput, "as many rows"),
            (dataclasses.replace(good, weights=good.weights.double()), InvalidInput, "weights must be finite"),
            (dataclasses.replace(good, weights=torch.tensor([0.5, float("inf")])), InvalidInput, "finite"),
            (dataclasses.replace(good, rows=torch.tensor([1, 0])), InvalidInput, "must not decrease"),
            (dataclasses.replace(good, z=torch.full((2, cfg.expert_dim), float("nan"))), InvalidInput, "NaN"),
            (dataclasses.replace(good, layer=0), NotHeld, "not served here"),
        ]:
            with pytest.raises(error, match=words):
                holder.run(bad)
    finally:
        cluster.close()
