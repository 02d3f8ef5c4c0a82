"""The coordinator's prefix index: the longest usable prefix, eviction before any stage would have to, an
entry about to be resumed is kept; a request that resumes generates what it would have generated from
scratch, in process and through worker processes, and falls back to a full prefill when a stage lost it."""

from __future__ import annotations

import asyncio

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.prefix_index import PrefixIndex, StageShare
from deltafin.coordinator.engine.token_loop import Finished
from deltafin.models.cache import mla_capacity
from deltafin.plan.sizing import SizingOptions, kda_state_bytes, mla_row_bytes
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_options import StageOptions
from deltafin.text.tokenizer import K3Tokenizer

PROMPT = [(7 * i) % 900 + 5 for i in range(300)]


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
        pipe = LocalPipeline.load(tiny_dir, 1, device="cpu",
                                  options=StageOptions(sizing=SizingOptions(prefix_cache_bytes=one)))
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
        options = StageOptions(memory_bytes=4 * 10**9, sizing=SizingOptions(prefill_chunk=64))
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
    from deltafin.coordinator.cluster.recovery import connect_cluster
    from deltafin.coordinator.cluster.workers import ClusterSpec
    from tests.support.cluster import workers

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


def test_a_restarted_engine_resumes_a_prefix_kept_on_disk(tiny_dir, tmp_path):
    """Stages and engine gone (a restart), then started again on the same prefix folder: the new index is
    empty, the first stage finds the kept prefix on its disk by its tokens, the request resumes from it
    (counted as cached tokens) and generates what a cold start does."""
    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)
    options = StageOptions(prefix_dir=str(tmp_path))

    async def run(prompt: list[int], cache: bool = True):
        engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 2, device="cpu", options=options)), tok, cfg,
                        "t", prefix_cache=cache)
        try:
            return await _generate(engine, prompt), engine.prefixes.counters if cache else None
        finally:
            await engine.close()

    (first, cached), _ = asyncio.run(run(_turns()[0]))
    assert cached == 0
    (second, cached), counters = asyncio.run(run(_turns()[1]))  # a new process: nothing in memory
    assert cached == len(PROMPT) and counters.hits == 1 and counters.lookups == 1  # the first turn's prompt
    (cold, _), _ = asyncio.run(run(_turns()[1], cache=False))
    assert second == cold
