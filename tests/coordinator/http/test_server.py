"""The OpenAI-compatible API, driven by the official `openai` client against a running server.

The server runs in the test's event loop on 127.0.0.1 over in-process stages of the `tiny` checkpoint.
Greedy outputs are checked against a plain argmax loop over the same stages (no Deltafin generation
code), logprobs against log-softmax of those logits, and the tool-call/reasoning plumbing against a
scripted backend whose "model" emits a known token sequence.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import aiohttp
import openai
import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.text.chat import ChatOptions, encode, render_text
from deltafin.text.tokenizer import K3Tokenizer
from tests.support.draft_heads import write_random_head
from tests.support.serving import ScriptedBackend, ServedApi, SlowPrefill, argmax_loop, script_ids, serve_api
from tests.support.serving import stop_ids as _stop_ids

MODEL = "tiny"


# ---- completions ---------------------------------------------------------------------------------------


async def test_completion_greedy_matches_argmax_loop_with_logprobs(server: ServedApi, pipeline, tok) -> None:
    prompt = "The experts stream from the disk"
    ids, rows = await asyncio.to_thread(argmax_loop, pipeline, tok.encode(prompt), 10, _stop_ids(tok))
    r = await server.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                 logprobs=3)
    choice = r.choices[0]
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.completion_tokens == len(ids)
    assert choice.text == tok.decode([i for i in ids if i not in tok.special_ids])
    assert choice.finish_reason == ("stop" if ids[-1] in _stop_ids(tok) else "length")
    lp = choice.logprobs
    kept = [i for i in ids if i not in _stop_ids(tok)]
    assert lp.tokens == [tok.token_bytes(i).decode("utf-8", errors="replace") for i in kept]
    for i, (token, row) in enumerate(zip(kept, rows, strict=False)):
        ref = torch.log_softmax(row, -1)
        assert math.isclose(lp.token_logprobs[i], float(ref[token]), abs_tol=1e-4)
        top = torch.topk(ref, 3)
        got = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert got == pytest.approx(top.values.tolist(), abs=1e-4)
    # streaming gives the same text, in pieces
    stream = await server.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    async for c in stream:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            pieces.append(ch.text)
            reasons.append(ch.finish_reason)
    assert "".join(pieces) == choice.text
    assert reasons[-1] == choice.finish_reason and usage.completion_tokens == len(ids)


async def test_completion_accepts_token_ids_and_echo(server: ServedApi, pipeline, tok) -> None:
    prompt_ids = tok.encode("ids in, text out")
    ids, _ = await asyncio.to_thread(argmax_loop, pipeline, prompt_ids, 5, _stop_ids(tok))
    r = await server.openai().completions.create(model=MODEL, prompt=prompt_ids, max_tokens=5, temperature=0,
                                                 echo=True)
    assert r.choices[0].text == "ids in, text out" + tok.decode([i for i in ids if i not in tok.special_ids])


async def test_stop_strings_cut_the_text_exactly(server: ServedApi) -> None:
    client = server.openai()
    no_eos = {"ignore_eos": True}  # a random model may end its message anywhere: the stop string must end it
    full = (await client.completions.create(model=MODEL, prompt="Tokens are bytes", max_tokens=24,
                                            temperature=0, extra_body=no_eos)).choices[0].text
    assert len(full) > 12
    stop = full[8:11]  # spans whatever token boundaries lie there
    expected = full[:full.index(stop)]
    r = await client.completions.create(model=MODEL, prompt="Tokens are bytes", max_tokens=24, temperature=0,
                                        stop=[stop, "\x00never"], extra_body=no_eos)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    stream = await client.completions.create(model=MODEL, prompt="Tokens are bytes", max_tokens=24, temperature=0,
                                             stop=stop, stream=True, extra_body=no_eos)
    pieces = [ch.text async for c in stream for ch in c.choices]
    assert "".join(pieces) == expected


async def test_max_tokens_and_stop_token(server: ServedApi, tok: K3Tokenizer) -> None:
    client = server.openai()
    r = await client.completions.create(model=MODEL, prompt="count", max_tokens=7, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (7, "length")
    eom = tok.specials["<|end_of_msg|>"]
    r = await client.completions.create(model=MODEL, prompt="count", max_tokens=7, temperature=0,
                                        logit_bias={str(eom): 100})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason, r.choices[0].text) == (1, "stop", "")


async def test_seeded_sampling_is_reproducible(server: ServedApi) -> None:
    client = server.openai()

    async def sample(seed: int) -> str:
        r = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                            top_p=0.95, seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text

    a, b, c = await sample(7), await sample(7), await sample(8)
    assert a == b
    assert a != c


# ---- chat ----------------------------------------------------------------------------------------------------


async def test_chat_greedy_matches_argmax_loop_stream_and_not(server: ServedApi, pipeline, tok) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"}]
    prompt = encode(tok, messages, ChatOptions(effort="low"))
    ids, rows = await asyncio.to_thread(argmax_loop, pipeline, prompt, 12, _stop_ids(tok))
    client = server.openai()
    r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                             reasoning_effort="low", logprobs=True, top_logprobs=2)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    msg = r.choices[0].message
    # no markers in the random output, so everything is still in the think channel
    text = tok.decode([i for i in ids if i not in tok.special_ids])
    assert msg.reasoning_content + msg.content == text  # type: ignore[attr-defined]
    got = [c.bytes for c in r.choices[0].logprobs.content]
    assert got == [list(tok.token_bytes(i)) for i in ids if i not in _stop_ids(tok)]
    assert r.choices[0].logprobs.content[0].logprob == pytest.approx(
        float(torch.log_softmax(rows[0], -1)[ids[0]]), abs=1e-4)
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                  reasoning_effort="low", stream=True,
                                                  stream_options={"include_usage": True})
    reasoning, content, usage, roles, reasons = "", "", None, [], []
    async for c in stream:
        usage = c.usage or usage
        for ch in c.choices:
            roles.append(ch.delta.role)
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
            reasons.append(ch.finish_reason)
    assert roles[0] == "assistant"
    assert (reasoning, content) == (msg.reasoning_content, msg.content)  # type: ignore[attr-defined]
    assert reasons[-1] == r.choices[0].finish_reason and usage.total_tokens == r.usage.total_tokens


async def test_chat_defaults_think_at_low_effort_for_the_serving_length(server: ServedApi, tok) -> None:
    """No reasoning_effort: the prompt is the template's with thinking_effort=low (not the template's max); no
    max_tokens: --default-max-tokens (1024 unless given), here capped by the context left."""
    from deltafin.text.chat import SERVING_MAX_TOKENS

    messages = [{"role": "user", "content": "Hi"}]
    client = server.openai()
    prompts, run = [], server.engine.run

    def spy(ids, *args, **kwargs):
        prompts.append(ids)
        return run(ids, *args, **kwargs)

    server.engine.run = spy  # type: ignore[method-assign]
    await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    low, top = encode(tok, messages, ChatOptions(effort="low")), encode(tok, messages, ChatOptions(effort="max"))
    assert prompts == [low] and low != top
    assert SERVING_MAX_TOKENS == 1024 and server.engine.default_max_tokens == SERVING_MAX_TOKENS
    r = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == min(SERVING_MAX_TOKENS, server.engine.max_context - r.usage.prompt_tokens)


async def test_chat_tool_calls_and_reasoning(tok: K3Tokenizer, tiny_dir: Path) -> None:
    args = {"city": "Zürich", "days": 2}
    assistant = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the weather.",
                 "tool_calls": [{"function": {"name": "get_weather", "arguments": args}}]}
    written = render_text([assistant], ChatOptions(add_generation_prompt=False, effort=None))
    body = written[len('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'):]
    script = script_ids(tok, body)
    backend = ScriptedBackend(tok.vocab_size, script)
    engine, runner, srv = await serve_api(backend, tok, load_config(tiny_dir))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    try:
        client = srv.openai()
        r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                                 tools=tools, max_tokens=200, temperature=0)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.content == "Let me check."
        assert msg.reasoning_content == "Need the weather."  # type: ignore[attr-defined]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("get_weather", args)]
        assert r.usage.completion_tokens == len(script)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=tools, max_tokens=200,
            temperature=0, stream=True)
        calls, reasons = [], []
        async for c in stream:
            for ch in c.choices:
                calls += ch.delta.tool_calls or []
                reasons.append(ch.finish_reason)
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (0, "get_weather", args)]
        assert reasons[-1] == "tool_calls"
        assert len(backend.released) == 2  # every session was released
    finally:
        await runner.cleanup()
        await engine.scheduler.close()


# ---- errors, limits, disconnects, metrics ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 2}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
    ({"reasoning_effort": "medium"}, "reasoning_effort"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"max_tokens": 600}, "messages"),  # past the 512-token context
])
async def test_chat_bad_requests_are_400_with_the_param(server: ServedApi, kwargs: dict, param: str) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        await server.openai().chat.completions.create(**request)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param  # type: ignore[index]
    assert e.value.body["message"]  # type: ignore[index]


async def test_any_model_name_is_served_and_answered_with_the_served_one_unless_strict(server: ServedApi) -> None:
    """Clients configured with their own model names (editors, agents) work: the response carries the served
    name. With --strict-model-name another name is 404 model_not_found."""
    ask = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "temperature": 0}
    theirs = await server.openai().chat.completions.create(model="gpt-9", **ask)
    ours = await server.openai().chat.completions.create(model=MODEL, **ask)
    assert theirs.model == MODEL and theirs.choices[0].message.content == ours.choices[0].message.content
    assert (await server.openai().models.retrieve("claude-sonnet")).id == MODEL
    server.engine.strict_model_name = True
    try:
        with pytest.raises(openai.NotFoundError) as e:
            await server.openai().chat.completions.create(model="gpt-9", **ask)
        assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            await server.openai().completions.create(model="gpt-9", prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await server.openai().models.retrieve("gpt-9")
        assert (await server.openai().chat.completions.create(model=MODEL, **ask)).model == MODEL
    finally:
        server.engine.strict_model_name = False


async def test_a_request_may_leave_the_model_out(server: ServedApi) -> None:
    """`model` left out: the served model answers (one server serves one model)."""
    async with aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "temperature": 0}
        async with s.post(server.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and (await r.json())["model"] == MODEL
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
        async with s.post(server.url + "/v1/messages", json=body) as r:
            assert r.status == 200 and (await r.json())["model"] == MODEL
        async with s.get(server.url + "/v1/models") as r:
            card = (await r.json())["data"][0]
            assert card["context_length"] == server.engine.max_context == card["max_model_len"]


async def test_unknown_path_and_bad_json(server: ServedApi) -> None:
    models = await server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/chat/completions", data=b"{nope") as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(server.url + "/v1/completions", json=[1, 2]) as r:
            assert r.status == 400
        async with s.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ""}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        async with s.get(server.url + "/v2/anything") as r:
            assert r.status == 404 and "error" in await r.json()
        async with s.post(server.url + "/v1/completions", data=b"x" * (2 << 20)) as r:
            assert r.status == 413 and "error" in await r.json()


async def _metric(url: str, name: str, labels: str = "") -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + (("{" + labels + "}") if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} not in /metrics")


async def test_queue_full_is_429_and_disconnect_cancels(server: ServedApi) -> None:
    body = {"model": MODEL, "prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        streams = []
        for _ in range(2):  # both active slots
            r = await s.post(server.url + "/v1/completions", json=body)
            await r.content.readline()  # generation has started
            streams.append(r)
        waiting = asyncio.ensure_future(s.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}))
        for _ in range(100):
            if server.engine.scheduler.stats.waiting == 1:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as e:  # queue depth 1 is taken too
            await server.openai().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
        for r in streams:  # the clients go away mid-stream
            r.close()
        queued = await waiting  # the queued request gets a slot and finishes
        assert queued.status == 200
        assert (await queued.text()).rstrip().endswith("data: [DONE]")
    for _ in range(200):
        if server.engine.scheduler.stats.active == 0 and server.engine.counters.cancelled == 2:
            break
        await asyncio.sleep(0.05)
    assert server.engine.counters.cancelled == 2
    assert server.engine.counters.generated_tokens < 2 * 400  # cancelled long before the end
    async with aiohttp.ClientSession() as s, s.get(server.url + "/health") as r:
        health = await r.json()
    assert health["status"] == "ok" and health["workers"][0]["sessions"] == 0  # caches freed
    assert await _metric(server.url, "deltafin_generations_total", 'outcome="cancelled"') == 2


async def test_metrics_count_tokens(server: ServedApi) -> None:
    r = await server.openai().completions.create(model=MODEL, prompt="metrics", max_tokens=5, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert await _metric(server.url, "deltafin_generated_tokens_total") == r.usage.completion_tokens == 5
    assert await _metric(server.url, "deltafin_prompt_tokens_total") == r.usage.prompt_tokens
    assert await _metric(server.url, "deltafin_http_requests_total",
                         'route="/v1/completions",status="200"') == 1
    assert await _metric(server.url, "deltafin_worker_sessions", 'worker="local-0"') == 0
    assert await _metric(server.url, "deltafin_decode_tokens_per_second") > 0


async def test_a_stream_waiting_for_its_first_token_says_how_far_its_prefill_is(tok, tiny_dir: Path,
                                                                                   monkeypatch) -> None:
    """A long prefill (minutes at K3's size) opens the stream and sends SSE comments with its progress, which
    clients skip; a failure after that arrives as an error event in the stream, not as a lost request."""
    from deltafin.coordinator.http import server as server_module

    monkeypatch.setattr(server_module, "HEARTBEAT_S", 0.05)

    script = tok.encode("a b c")
    backend = SlowPrefill(tok.vocab_size, script)
    engine, runner, srv = await serve_api(backend, tok, load_config(tiny_dir), max_active=1)
    prompt = list(range(100, 130))  # 30 tokens, in chunks of 7 (8 less the room kept for a decode step)
    try:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s, s.post(srv.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            lines = [line for line in (await r.text()).split("\n") if line]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        comments = lines[:first_data]
        assert comments and all(re.fullmatch(r": prefill \d+/30 tokens(, [\d.]+ MB of [\d.]+ MB read, about \d+ s "
                                             r"left)?", c) for c in comments), lines
        done = [int(c.split()[2].split("/")[0]) for c in comments]
        assert done == sorted(done) and done[-1] > 0  # it moves
        stream = await srv.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=3, stream=True,
                                                       extra_body={"ignore_eos": True})
        raw = "".join(c["text"] for line in lines[first_data:] if line != "data: [DONE]"
                      for c in json.loads(line[len("data: "):])["choices"])
        assert raw and "".join([c.choices[0].text async for c in stream if c.choices]) == raw  # comments skipped
        backend.fail = True
        async with aiohttp.ClientSession() as s, s.post(srv.url + "/v1/completions", json=body) as r:
            assert r.status == 200  # the stream had opened: the failure is an event in it
            text = await r.text()
        assert ": prefill" in text and "cluster_unavailable" in text and text.rstrip().endswith("data: [DONE]")
    finally:
        await runner.cleanup()
        await engine.scheduler.close()


async def test_speculative_per_request_same_text_and_counted(server: ServedApi) -> None:
    client = server.openai()
    body = {"ignore_eos": True}
    plain = await client.completions.create(model=MODEL, prompt="a b a b a b a b", max_tokens=20, temperature=0,
                                            extra_body=body)
    fast = await client.completions.create(model=MODEL, prompt="a b a b a b a b", max_tokens=20, temperature=0,
                                           extra_body={**body, "speculative": "ngram"})
    assert fast.choices[0].text == plain.choices[0].text
    assert await _metric(server.url, "deltafin_draft_tokens_total") == server.engine.counters.draft_tokens > 0
    assert await _metric(server.url, "deltafin_decode_forwards_total") == server.engine.counters.forwards
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"speculative": "eagle"})
    assert e.value.body["param"] == "speculative"  # type: ignore[index]


async def test_a_request_drafts_with_the_servers_head(server: ServedApi, tiny_dir, tmp_path) -> None:
    client, engine = server.openai(), server.engine
    body = {"ignore_eos": True}
    plain = await client.completions.create(model=MODEL, prompt="a b c d", max_tokens=16, temperature=0,
                                            extra_body=body)
    engine.model_dir, engine.draft_model = tiny_dir, None  # no head: the request is refused, saying why
    with pytest.raises(openai.APIStatusError) as e:
        await client.completions.create(model=MODEL, prompt="a b c d", max_tokens=2,
                                        extra_body={**body, "speculative": "draft"})
    assert e.value.status_code == 400 and "needs a draft head" in str(e.value.body)
    engine.draft_model = str(write_random_head(tmp_path / "draft", tiny_dir))
    before = engine.counters.draft_tokens
    try:
        drafted = await client.completions.create(model=MODEL, prompt="a b c d", max_tokens=16, temperature=0,
                                                  extra_body={**body, "speculative": "draft"})
    finally:
        engine.model_dir, engine.draft_model, engine._draft_head = None, None, None
    assert drafted.choices[0].text == plain.choices[0].text
    assert engine.counters.draft_tokens > before


async def test_the_readmes_client_examples_run_as_written(server: ServedApi) -> None:
    """The README's `openai`, `anthropic` and `ollama`/Responses examples, pointed at this server (its address for
    127.0.0.1:8000), print what the async clients get for the same requests (greedy: the same text; sampled:
    what the numbers must be)."""
    import contextlib
    import io

    import anthropic

    readme = (Path(__file__).parents[3] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "base_url=" in b]
    assert len(blocks) == 3

    def run(block: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(block.replace("http://127.0.0.1:8000", server.url), {})
        return out.getvalue()

    printed = [await asyncio.to_thread(run, b) for b in blocks]
    o = await server.openai().chat.completions.create(model="Kimi-K3", messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=64, temperature=0)
    assert printed[0] == f"{o.choices[0].message.reasoning_content} {o.choices[0].message.content}\n"
    # Anthropic's default temperature is 1: a sample, so its numbers are checked, not its text
    n = await anthropic.AsyncAnthropic(base_url=server.url, api_key="KEY", max_retries=0).messages.count_tokens(
        model="Kimi-K3", thinking={"type": "enabled", "budget_tokens": 2048},
        messages=[{"role": "user", "content": "Hi"}])
    m = re.fullmatch(r"\[.*\] Usage\(.*cache_read_input_tokens=(\d+).*input_tokens=(\d+).*output_tokens=(\d+).*\)\n",
                     printed[1], re.S)
    assert m, printed[1]
    assert int(m.group(1)) + int(m.group(2)) == n.input_tokens and 1 <= int(m.group(3)) <= 128
    assert printed[2].count("\n") >= 2  # Ollama's chat reply and the Responses API's output text, each printed


async def test_a_request_cannot_ask_for_an_expert_mode_the_server_was_not_started_with(server: ServedApi) -> None:
    """The server runs its --expert-mode (exact here): a request naming it is served, any other mode is a 400 on
    `expert_mode` (OpenAI's body, Ollama's options), and so is a mode that does not parse."""
    client = server.openai()
    ok = await client.completions.create(model=MODEL, prompt="a b", max_tokens=2, temperature=0,
                                         extra_body={"expert_mode": "EXACT"})
    assert ok.choices[0].text is not None
    for mode, says in (("top-p:0.8", "runs expert mode 'exact'"), ("top-p:2", "in (0, 1)")):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"expert_mode": mode})
        assert e.value.body["param"] == "expert_mode" and says in e.value.body["message"]  # type: ignore[index]
    body = {"model": MODEL, "prompt": "x", "stream": False, "options": {"expert_mode": "cached:0.05"}}
    async with aiohttp.ClientSession() as http, http.post(f"{server.url}/api/generate", json=body) as r:
        assert r.status == 400 and "cached:0.05" in await r.text()
