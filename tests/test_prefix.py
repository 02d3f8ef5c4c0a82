"""Prefix cache: stages keep state after a request and resume new sessions from it exactly; the
coordinator's index finds the longest usable prefix and keeps every stage within its budget; a request
that resumes generates what it would have generated from scratch, in process, through the API and
through worker processes, and falls back to a full prefill when a stage lost the prefix."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltafin.checkpoint import open_checkpoint
from deltafin.config import load_config
from deltafin.coordinator.backend import LocalBackend
from deltafin.coordinator.engine import Engine
from deltafin.coordinator.generation import Finished
from deltafin.coordinator.prefix import PrefixIndex, StageShare
from deltafin.errors import InvalidInput, PrefixNotFound
from deltafin.pipeline import LocalPipeline
from deltafin.sizing import kda_state_bytes, mla_capacity, mla_row_bytes
from deltafin.stage import SeqInput, Stage, StageOptions
from deltafin.tokenizer import K3Tokenizer

CPU = torch.device("cpu")
PROMPT = [(7 * i) % 900 + 5 for i in range(300)]


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    return open_checkpoint(tiny_dir, load_config(tiny_dir))


def _ids(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs)


# ---- the stage's store ------------------------------------------------------------------------------------


def test_a_resumed_session_equals_one_that_went_on(ckpt):
    """Keep a session at 300 tokens (on release: moved, not copied); a new session resumed from it and fed
    the same next chunk gives the logits the original session gives for it, bit for bit (same tensors, same
    computation). And the kept state is the state at 300 tokens, whatever came after."""
    stage = Stage(ckpt, 0, 6, device=CPU)
    stage.forward([SeqInput("a", 0, ids=_ids(PROMPT))])
    stage.release("a", keep_as="p300")
    nxt = _ids([11, 12, 13, 14])
    resumed = stage.forward([SeqInput("b", 300, ids=nxt, resume_from="p300")])[0].logits
    stage.forward([SeqInput("ref", 0, ids=_ids(PROMPT))])
    want = stage.forward([SeqInput("ref", 300, ids=nxt)])[0].logits
    assert torch.equal(resumed, want)
    again = stage.forward([SeqInput("c", 300, ids=nxt, resume_from="p300")])[0].logits  # b went on; p300 did not
    assert torch.equal(again, want)
    assert stage.prefixes.stats.resumed == 2 and stage.sessions["b"].length == 304


def test_a_snapshot_of_a_live_session_is_not_disturbed_by_it(ckpt):
    """save_as shares the live session's tensors: the session then appends 200 more tokens into the same MLA
    buffer and replaces its KDA states, and a session resumed from the snapshot still sees exactly the
    state at the snapshot (equal to a fresh session fed the same chunks)."""
    stage = Stage(ckpt, 0, 6, device=CPU)
    stage.forward([SeqInput("live", 0, ids=_ids(PROMPT[:100]), save_as="p100")])
    for pos in range(100, 300, 50):
        stage.forward([SeqInput("live", pos, ids=_ids(PROMPT[pos:pos + 50]))])
    other = _ids([900, 901, 902])
    got = stage.forward([SeqInput("r", 100, ids=other, resume_from="p100")])[0].logits
    stage.forward([SeqInput("fresh", 0, ids=_ids(PROMPT[:100]))])
    want = stage.forward([SeqInput("fresh", 100, ids=other)])[0].logits
    assert torch.equal(got, want)


def test_missing_and_mismatched_prefixes_are_clear_errors(ckpt):
    stage = Stage(ckpt, 0, 6, device=CPU)
    with pytest.raises(PrefixNotFound, match="prefix 'nope' is not on stage"):
        stage.forward([SeqInput("x", 5, ids=_ids([1]), resume_from="nope")])
    stage.forward([SeqInput("a", 0, ids=_ids(PROMPT[:10]), save_as="p10")])
    with pytest.raises(InvalidInput, match="holds 10 tokens, not 9"):
        stage.forward([SeqInput("y", 9, ids=_ids([1]), resume_from="p10")])
    assert "x" not in stage.sessions and "y" not in stage.sessions
    assert stage.release("p10") and "p10" not in stage.prefixes.entries  # an id naming a prefix drops it


def test_the_store_keeps_within_its_budget_least_recently_used_first(ckpt):
    """The budget is three kept states of 40 tokens; a fourth evicts the least recently used one, a state
    larger than the whole budget is refused, and the bytes never pass the budget."""
    cfg = ckpt.config
    n_kda = sum(k.name == "KDA" for k in cfg.layer_kinds)
    n_mla = cfg.num_layers - n_kda
    one = n_kda * kda_state_bytes(cfg) + n_mla * mla_capacity(40) * mla_row_bytes(cfg, 4)
    stage = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(prefix_bytes=3 * one))
    for i, sid in enumerate("abcd"):
        stage.forward([SeqInput(sid, 0, ids=_ids(PROMPT[i:i + 40]))])
        if sid == "d":
            stage.prefixes.get("kept-a")  # a is now more recent than b
        stage.release(sid, keep_as=f"kept-{sid}")
        assert stage.prefixes.nbytes <= 3 * one
    assert list(stage.prefixes.entries) == ["kept-c", "kept-a", "kept-d"]
    assert stage.prefixes.nbytes == 3 * one and stage.prefixes.stats.evicted == 1
    small = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(prefix_bytes=one))
    small.forward([SeqInput("long", 0, ids=_ids(PROMPT))])  # 300 tokens: two MLA blocks, the budget holds one
    small.release("long", keep_as="kept-long")
    assert not small.prefixes.entries and small.prefixes.stats.refused == 1 and "long" not in small.sessions


# ---- the coordinator's index -------------------------------------------------------------------------------


def test_lookup_takes_the_longest_prefix_that_leaves_a_token_to_feed(tiny_dir):
    index = PrefixIndex(load_config(tiny_dir), [StageShare(3, 3, 10**9, 4)], block=64)
    a, _ = index.reserve([1, 2, 3])
    b, _ = index.reserve([1, 2, 3, 4, 5])
    c, _ = index.reserve([1, 2, 9, 9, 9, 9])
    assert index.reserve([1, 2, 3]) == (None, [])  # already kept
    assert index.lookup([1, 2, 3, 4, 5, 6]).prefix_id == b
    assert index.lookup([1, 2, 3, 4, 5]).prefix_id == a  # b is the whole prompt: nothing left to feed
    assert index.lookup([1, 2, 3, 4, 7]).prefix_id == a
    assert index.lookup([1, 2, 9, 9, 9, 9, 1]).prefix_id == c
    assert index.lookup([2, 2, 3, 4]) is None and index.lookup([1]) is None
    assert index.counters.hits == 4 and index.counters.tokens_saved == 5 + 3 + 3 + 6


def test_the_index_evicts_before_any_stage_would_have_to(tiny_dir):
    """Two stages of different shapes: every stage's share of the kept entries stays within its budget,
    computed here from the cache shapes directly (KDA: conv windows and state in fp32; MLA: 256-token blocks
    of 576... here r + rope latents), least recently used entries go first and are returned for release."""
    cfg = load_config(tiny_dir)
    kda = (3 * (cfg.conv_kernel - 1) * cfg.kda_dim + cfg.kda_heads * cfg.kda_head_dim ** 2) * 4
    row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    cost0 = lambda n: 2 * kda  # two KDA layers, no MLA
    cost1 = lambda n: kda + 2 * (-(-n // 256) * 256) * row
    shares = [StageShare(2, 0, 2 * cost0(0), 4), StageShare(1, 2, cost1(300) + cost1(10), 4)]
    index = PrefixIndex(cfg, shares)
    first, _ = index.reserve(list(range(10)))
    second, evicted = index.reserve(list(range(300)))
    assert evicted == [] and index.used(shares[1]) == cost1(10) + cost1(300)
    index.lookup(list(range(11)))  # first is now the most recent
    third, evicted = index.reserve(list(range(20)))
    assert evicted == [second]  # stage 1 could not hold three; stage 0 holds two at most anyway
    assert set(index.entries) == {first, third}
    for s, cost in zip(shares, (cost0, cost1), strict=True):
        assert index.used(s) == sum(cost(e.length) for e in index.entries.values()) <= s.budget
    assert index.reserve(list(range(2000))) == (None, [])  # larger than stage 1's whole budget


def test_an_entry_about_to_be_resumed_is_not_evicted(tiny_dir):
    """Room for one entry: while a request is about to resume from it, keeping another is refused rather
    than evicting it; once the resume is done, the next one evicts it."""
    index = PrefixIndex(load_config(tiny_dir), [StageShare(1, 0, 10**6, 4)])
    index.shares = [StageShare(1, 0, index.cost(index.shares[0], 10), 4)]
    a, _ = index.reserve(list(range(10)))
    hit = index.lookup(list(range(12)))
    index.pin(hit.prefix_id)
    assert index.reserve(list(range(20))) == (None, []) and list(index.entries) == [a]
    index.unpin(hit.prefix_id)
    b, evicted = index.reserve(list(range(20)))
    assert evicted == [a] and list(index.entries) == [b]


def test_with_room_for_one_state_the_next_turn_still_resumes(tiny_dir):
    """The stages keep one state at a time: the second turn resumes from the first turn's finished state
    (its own prompt-end state cannot be kept beside it) and the third resumes from the second's."""
    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)
    n_kda = sum(k.name == "KDA" for k in cfg.layer_kinds)
    one = n_kda * kda_state_bytes(cfg) + (cfg.num_layers - n_kda) * mla_capacity(1024) * mla_row_bytes(cfg, 4)

    async def run():
        pipe = LocalPipeline.load(tiny_dir, 1, device="cpu", options=StageOptions(prefix_bytes=one))
        engine = Engine(LocalBackend(pipe), tok, cfg, "t", prefix_cache=True)
        try:
            prompt, cached, lengths = list(PROMPT), [], []
            for new in ([], [40, 41, 42], [50, 51]):
                prompt += new
                ids, c = await _generate(engine, prompt)
                cached.append(c)
                lengths.append(len(prompt))
                prompt += ids  # the next turn sends the reply back
            return cached, lengths, len(engine.prefixes.entries)
        finally:
            await engine.close()

    cached, lengths, entries = asyncio.run(run())
    assert cached == [0, lengths[0] + 7, lengths[1] + 7] and entries == 1


# ---- requests ----------------------------------------------------------------------------------------------


async def _generate(engine: Engine, prompt: list[int], n: int = 8) -> tuple[list[int], int]:
    ids, cached = [], -1
    async for e in engine.run(prompt, None, max_tokens=n, ignore_eos=True):
        if isinstance(e, Finished):
            cached = e.usage.cached_tokens
        else:
            ids.append(e.token_id)
    return ids, cached


def _turns() -> list[list[int]]:
    """A conversation's prompts: each the previous one, what was generated, and a new message."""
    return [PROMPT, PROMPT + [21, 22, 23] + list(range(400, 460)), PROMPT + [21, 22, 23] + list(range(400, 460))
            + [30, 31] + list(range(600, 700))]


def test_greedy_output_is_the_same_with_and_without_the_cache(tiny_dir):
    """Three requests, each extending the last: with the cache they resume (at the previous prompt's end)
    and generate exactly the tokens they generate without it. The resumed runs split the prompt at other
    points, so logits differ by fp32 rounding only: compared within 1e-4 (measured ~1e-6)."""
    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)

    async def run(cache: bool):
        engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 2, device="cpu")), tok, cfg, "t",
                        prefix_cache=cache)
        try:
            return [await _generate(engine, p) for p in _turns()], engine
        finally:
            await engine.close()

    with_cache, engine = asyncio.run(run(True))
    without, _ = asyncio.run(run(False))
    assert [ids for ids, _ in with_cache] == [ids for ids, _ in without]
    turns = _turns()
    assert [c for _, c in with_cache] == [0, len(turns[0]), len(turns[1])]
    assert [c for _, c in without] == [0, 0, 0]
    assert engine.prefixes.counters.hits == 2 and engine.prefixes.counters.tokens_saved == len(turns[0]) + len(
        turns[1])


def test_a_long_prompt_keeps_state_at_block_boundaries(tiny_dir):
    """Prompt chunks of 60 tokens (a 64-token forward limit, room for 4 decode steps) and blocks of 128:
    the 300-token prompt keeps its state after the chunk that crosses 128 (at 180) and at its end. A prompt
    that shares only its first 200 tokens resumes at 180 and generates what it generates from scratch."""
    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)
    other = PROMPT[:200] + list(range(800, 850))

    async def run(cache: bool):
        options = StageOptions(memory_bytes=4 * 10**9, max_forward_tokens=64)
        engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 2, device="cpu", options=options)), tok, cfg, "t",
                        prefix_cache=cache)
        if cache:
            engine.prefixes.block = 128
        try:
            first = await _generate(engine, PROMPT)
            kept = sorted(e.length for e in engine.prefixes.entries.values()) if cache else []
            return first, await _generate(engine, other), kept
        finally:
            await engine.close()

    (a, cached_a), (b, cached_b), kept = asyncio.run(run(True))
    (a0, _), (b0, _), _ = asyncio.run(run(False))
    assert kept == [180, 300, 307]  # the block, the prompt's end, the finished request (300 + 8 - 1)
    assert (cached_a, cached_b) == (0, 180)
    assert (a, b) == (a0, b0)


def test_a_stage_that_lost_the_prefix_means_a_full_prefill(tiny_dir):
    """Drop every kept prefix on the second of two stages behind the index's back: the next request asks to
    resume, is told the prefix is gone, prefills from token 0 and generates what it would have."""
    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)

    async def run():
        pipe = LocalPipeline.load(tiny_dir, 2, device="cpu")
        engine = Engine(LocalBackend(pipe), tok, cfg, "t", prefix_cache=True)
        try:
            first = await _generate(engine, _turns()[0])
            pipe.stages[1].prefixes.clear()
            second = await _generate(engine, _turns()[1])
            return first, second, engine.prefixes.counters, len(pipe.stages[0].sessions)
        finally:
            await engine.close()

    async def reference():
        engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 2, device="cpu")), tok, cfg, "t")
        try:
            return await _generate(engine, _turns()[1])
        finally:
            await engine.close()

    first, (ids, cached), counters, open_sessions = asyncio.run(run())
    assert cached == 0 and counters.missing == 1 and counters.hits == 0
    assert ids == asyncio.run(reference())[0]
    assert open_sessions == 0  # the half-resumed session was released before starting over


def test_through_worker_processes_each_stage_keeps_its_part(tiny_dir):
    """Two workers: the conversation resumes across the cluster (each worker keeps its layers' part under the
    same id) and generates what single-machine mode without a cache generates. Then one worker drops its
    part behind the index's back: the request is told (ABORTED over gRPC), prefills from token 0, still
    generates the same tokens."""
    from cluster_util import workers

    from deltafin.coordinator.cluster import ClusterSpec
    from deltafin.coordinator.recovery import connect_cluster

    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)
    turns = _turns()

    async def reference():
        engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 1, device="cpu")), tok, cfg, "t")
        try:
            return [await _generate(engine, p) for p in turns]
        finally:
            await engine.close()

    async def cluster(addresses: list[str]):
        backend, _ = await connect_cluster(ClusterSpec(tiny_dir, addresses=addresses, discover=False),
                                           show_progress=False)
        engine = Engine(backend, tok, cfg, "t", prefix_cache=True)
        try:
            out = [await _generate(engine, p) for p in turns[:2]]
            kept = [s["prefixes"] for s in await backend.stats()]
            await backend.stages[1].release(list(engine.prefixes.entries))  # worker 1 forgets every prefix
            out.append(await _generate(engine, turns[2]))
            return out, kept, engine.prefixes.counters
        finally:
            await engine.close()

    want = asyncio.run(reference())
    with workers(tiny_dir, 2) as procs:
        got, kept, counters = asyncio.run(cluster([p.address for p in procs]))
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert [c for _, c in got] == [0, len(turns[0]), 0]
    assert kept[0] == kept[1] >= 3  # the same entries on both workers
    assert counters.missing == 1
