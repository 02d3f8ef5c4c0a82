"""The coordinator's prefix index: the longest usable prefix, eviction before any stage would have to, an
entry about to be resumed is kept; a request that resumes generates what it would have generated from
scratch, in process and through worker processes, and falls back to a full prefill when a stage lost it."""

from __future__ import annotations

import asyncio
import json
import time

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine import prefix_index
from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.events import Finished
from deltafin.coordinator.engine.generation import Generation
from deltafin.coordinator.engine.prefix_index import (
    PrefixIndex,
    StageShare,
    ids_along,
    inside_forward,
    keep_points,
    prefix_id,
)
from deltafin.models.pieces import mla_capacity
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.memory.stage_parts import kda_state_bytes, mla_row_bytes
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_options import StageOptions
from deltafin.text.tokenizer import K3Tokenizer

PROMPT = [(7 * i) % 900 + 5 for i in range(300)]


# ---- the coordinator's index -------------------------------------------------------------------------------


def test_ids_are_the_hash_of_the_exact_tokens_and_matches_take_the_longest(tiny_dir):
    index = PrefixIndex(load_config(tiny_dir), [StageShare(3, 3, 10**9, 4)])
    a, _ = index.reserve([1, 2, 3])
    b, _ = index.reserve([1, 2, 3, 4, 5])
    c, _ = index.reserve([1, 2, 9, 9, 9, 9])
    assert (a, b, c) == (prefix_id([1, 2, 3]), prefix_id([1, 2, 3, 4, 5]), prefix_id([1, 2, 9, 9, 9, 9]))
    assert len({a, b, c, prefix_id([1, 2, 3, 4]), prefix_id([3, 2, 1])}) == 5
    assert ids_along([1, 2, 3, 4, 5], [5, 3]) == {3: a, 5: b}  # one pass, the same ids
    assert index.reserve([1, 2, 3]) == (None, [])  # already kept
    assert [e.prefix_id for e in index.matches([1, 2, 3, 4, 5, 6])] == [b, a]
    assert [e.prefix_id for e in index.matches([1, 2, 3, 4, 5])] == [b, a]  # the whole prompt too (its logits)
    assert [e.prefix_id for e in index.matches([1, 2, 3, 4, 7])] == [a]
    assert index.matches([2, 2, 3, 4]) == [] and index.matches([1]) == []


def test_keep_points_are_boundaries_grid_and_the_end_past_the_resume():
    assert keep_points(300, [40, 120, 300, 400], 128, 0) == [40, 120, 128, 256, 300]
    assert keep_points(300, [40, 120], 128, 120) == [128, 256, 300]
    assert keep_points(300, [], 10**9, 0) == [300]
    # inside one forward ending at 200, at most two of them: explicit boundaries first, the earliest first
    assert inside_forward([40, 120, 128, 200], [40, 120], 200, 2) == [40, 120]
    assert inside_forward([40, 120, 128, 200], [120], 200, 2) == [40, 120]  # then grid points, earliest
    assert inside_forward([40, 120, 128, 200], [], 200, 1) == [40]


def test_shared_prefixes_are_evicted_last(tiny_dir):
    """Room for two entries: an entry resumed twice (a system prompt many conversations share) outlives a newer
    one resumed never; with disk budgets the capacity is the disk's."""
    cfg = load_config(tiny_dir)
    index = PrefixIndex(cfg, [StageShare(1, 0, 10**6, 4)])
    one = index.cost(index.shares[0], 10)
    index.reshape([StageShare(1, 0, 2 * one, 4)])
    shared, _ = index.reserve(list(range(10)))
    for _ in range(2):
        index.hit(index.entries[shared], whole=False)
    newer, _ = index.reserve(list(range(20, 30)))
    index.hit(index.entries[newer], whole=False)  # now the most recent, but resumed once
    third, evicted = index.reserve(list(range(40, 50)))
    assert evicted == [newer] and set(index.entries) == {shared, third}
    assert index.counters.hits == 3
    disk = PrefixIndex(cfg, [StageShare(1, 0, one, 4, disk=5 * one)])
    kept = [disk.reserve(list(range(100 * i, 100 * i + 10)))[0] for i in range(6)]
    assert all(kept) and len(disk.entries) == 5  # five on the disk's budget, not one on memory's


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
    index.hit(index.matches(list(range(11)))[0], whole=False)  # first is now the most recent
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
    hit = index.matches(list(range(12)))[0]
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
                                  options=StageOptions(sizing=SizingInput(prefix_cache_bytes=one)))
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
    async for e in engine.run(prompt, None, Generation(n, ignore_eos=True)):
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


def test_a_long_prompt_keeps_state_on_the_grid_inside_its_forwards(tiny_dir, monkeypatch):
    """Prompt chunks of 60 tokens (a 64-token forward limit, room for 4 decode steps) and a grid of 128: the
    300-token prompt keeps its state at 128 and 256, each taken inside the forward it falls in (not at a
    forward's end), and at its end. A prompt that shares only its first 200 tokens resumes at 128 and generates
    what it generates from scratch."""
    monkeypatch.setattr(prefix_index, "prefix_grid", lambda *args: 128)
    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)
    other = PROMPT[:200] + list(range(800, 850))

    async def run(cache: bool):
        options = StageOptions(memory_bytes=4 * 10**9, sizing=SizingInput(prefill_chunk=64))
        engine = Engine(LocalBackend(LocalPipeline.load(tiny_dir, 2, device="cpu", options=options)), tok, cfg, "t",
                        prefix_cache=cache)
        try:
            first = await _generate(engine, PROMPT)
            kept = sorted(e.length for e in engine.prefixes.entries.values()) if cache else []
            return first, await _generate(engine, other), kept
        finally:
            await engine.close()

    (a, cached_a), (b, cached_b), kept = asyncio.run(run(True))
    (a0, _), (b0, _), _ = asyncio.run(run(False))
    assert kept == [128, 256, 300, 307]  # the grid, the prompt's end, the finished request (300 + 8 - 1)
    assert (cached_a, cached_b) == (0, 128)
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
    part behind the index's back: the request is told before it starts (HeldPrefixes), prefills from token 0,
    still generates the same tokens."""
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
            kept = [s.prefixes for s in await backend.stats()]
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
    assert counters.missing == 2  # both kept prompts the third turn begins with: found gone before it started


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


# ---- shared system prompts, retries, restarts ---------------------------------------------------------------

SYSTEM = "You are a careful assistant. " * 40


def _chat(tok, user: str) -> tuple[list[int], list[int]]:
    from deltafin.text.chat import ChatOptions, encode_with_boundaries

    return encode_with_boundaries(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                                  ChatOptions(thinking=False))


async def _chat_generate(engine: Engine, prompt: tuple[list[int], list[int]], n: int = 6):
    ids, usage = [], None
    async for e in engine.run(prompt[0], None, Generation(n, ignore_eos=True), boundaries=prompt[1]):
        if isinstance(e, Finished):
            usage = e.usage
        else:
            ids.append(e.token_id)
    return ids, usage


def _fed(pipe: LocalPipeline) -> int:
    return pipe.stages[0].timings.tokens


def test_a_shared_system_prompt_a_retry_and_a_restart_resume(tiny_dir, tmp_path):
    """Conversation A (system prompt + "Hello"), then B (the same system prompt + another question): B resumes
    at the system prompt's end. A again, unchanged: resumes whole, feeding no prompt token (its kept logits give
    the first token). After a restart of stages and engine on the same prefix folder: B and A resume the same
    way. Every reply is what the engine without a cache generates."""
    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)
    a, b = _chat(tok, "Hello"), _chat(tok, "Tell me about rivers")
    system_end = a[1][0]
    assert system_end == b[1][0] and a[0][:system_end] == b[0][:system_end] and a[0] != b[0]

    async def run(prompts, cache: bool = True):
        pipe = LocalPipeline.load(tiny_dir, 2, device="cpu", options=StageOptions(prefix_dir=str(tmp_path)))
        engine = Engine(LocalBackend(pipe), tok, cfg, "t", prefix_cache=cache)
        try:
            out = []
            for p in prompts:
                before = _fed(pipe)
                ids, usage = await _chat_generate(engine, p)
                out.append((ids, usage, _fed(pipe) - before))
            return out, engine.prefixes.counters if cache else None
        finally:
            await engine.close()

    reference, _ = asyncio.run(run([a, b], cache=False))
    (first, second, again), counters = asyncio.run(run([a, b, a]))
    assert [first[0], second[0], again[0]] == [reference[0][0], reference[1][0], reference[0][0]]
    assert [first[1].cached_tokens, second[1].cached_tokens, again[1].cached_tokens] == [0, system_end, len(a[0])]
    assert again[2] == 5  # the 5 generated tokens after the first, fed back: no prompt token
    assert first[1].cache_created_tokens == len(a[0])  # kept at its messages' ends and its end
    assert counters.whole == 1 and counters.hits == 2
    (b_after, a_after), counters = asyncio.run(run([b, a]))  # a new process: nothing in memory
    assert [b_after[0], a_after[0]] == [reference[1][0], reference[0][0]]
    assert [b_after[1].cached_tokens, a_after[1].cached_tokens] == [len(b[0]), len(a[0])]
    assert a_after[2] == 5 and counters.whole == 2


def test_a_kept_state_whose_parts_are_not_on_every_stage_is_not_used(tiny_dir):
    """The second stage drops one entry behind the index's back: a request that would resume there is told
    before it starts (held_prefixes), resumes from the next-longest point every stage holds, and generates what
    it would have."""
    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)
    a = _chat(tok, "Hello")

    async def run(drop: bool):
        pipe = LocalPipeline.load(tiny_dir, 2, device="cpu")
        engine = Engine(LocalBackend(pipe), tok, cfg, "t", prefix_cache=True)
        try:
            await _chat_generate(engine, a)
            if drop:
                pipe.stages[1].prefixes.drop(prefix_index.prefix_id(a[0]))  # the whole prompt's state
            return await _chat_generate(engine, a), engine.prefixes.counters
        finally:
            await engine.close()

    (ids, usage), counters = asyncio.run(run(drop=True))
    (want, _), _ = asyncio.run(run(drop=False))
    assert ids == want and usage.cached_tokens == a[1][-1] < len(a[0])  # the user message's end
    assert counters.missing == 1 and counters.whole == 0


def test_serve_resumes_shared_prompts_after_restarts_of_either_side(tiny_dir):
    """`serve` on two worker processes, OpenAI's and Anthropic's clients, greedy: the second conversation with a
    shared system prompt resumes at least the system prompt, the identical request all of its prompt; both
    again after the server restarts (its index rebuilt from what the stages hold) and after the second worker
    restarts on its prefix folder (its stage reloads what it kept). Every reply is the reply of a server whose
    stages keep no prefix (--prefix-cache-gb 0)."""
    import anthropic
    import openai

    from tests.support.cluster import ServerProcess, WorkerProcess, http_get, workers

    system = "You are a careful assistant who answers in one line. " * 30
    questions = ["Hello", "Tell me about rivers"]

    def ask_openai(url: str, question: str) -> tuple[str, int, int]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    def ask_anthropic(url: str, question: str) -> tuple[str, int, int]:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
        r = client.messages.create(model="tiny", max_tokens=6, extra_body={"temperature": 0}, system=system,
                                   messages=[{"role": "user", "content": question}])
        u = r.usage
        return ("".join(b.text for b in r.content), u.input_tokens + u.cache_creation_input_tokens
                + u.cache_read_input_tokens, u.cache_read_input_tokens)

    def rounds(url: str) -> list[tuple[str, int, int]]:
        return [ask(url, q) for ask in (ask_openai, ask_anthropic) for q in (*questions, questions[0])]

    def serve(w0, w1, *extra):
        return ServerProcess(tiny_dir, "--worker", w0.address, "--worker", w1.address, "--worker-timeout", "3",
                             "--rejoin-interval", "1", *extra, serve_args=("--served-model-name", "tiny"))

    def check(got, want, fresh: bool) -> None:
        assert [text for text, _, _ in got] == [text for text, _, _ in want]
        for i, (_, prompt, cached) in enumerate(got):
            second, again = i % 3 == 1, i % 3 == 2
            if again or not fresh:  # the same request again, or any request once both were kept
                assert cached == prompt, (i, got)
            elif second:
                assert prompt - 100 < cached < prompt, (i, got)  # the system prompt (~1,100 tokens), not the question
            else:
                assert cached == 0, (i, got)  # (OpenAI's prompt differs from Anthropic's: K3's thinking message)

    with workers(tiny_dir, 2) as (w0, w1):
        reference = serve(w0, w1, "--prefix-cache-gb", "0")
        try:
            want = rounds(reference.url)
        finally:
            assert reference.stop() == 0
        server = serve(w0, w1)
        try:
            check(rounds(server.url), want, fresh=True)
        finally:
            assert server.stop() == 0
        server = serve(w0, w1)  # a new coordinator: an empty index
        restarted = None
        try:
            check(rounds(server.url), want, fresh=False)
            port = w1.address.rsplit(":", 1)[1]
            w1.stop()
            restarted = WorkerProcess(tiny_dir, "w1", "--port", port, "--prefix-dir", w1.prefix_dir)
            restarted.wait_ready()
            deadline = time.monotonic() + 60
            while json.loads(http_get(server.url + "/health")[1])["workers"].__len__() < 2:
                assert time.monotonic() < deadline, "the restarted worker did not rejoin"
                time.sleep(0.5)
            check(rounds(server.url), want, fresh=False)
        finally:
            if restarted is not None:
                restarted.stop()
            assert server.stop() == 0
