"""Anthropic's Messages API, driven by the official `anthropic` client against a running server.

The server runs in the test's event loop on 127.0.0.1 over in-process stages of the `tiny` checkpoint (as
test_server.py's). Greedy text is checked against the OpenAI route for the same conversation and against a
plain argmax loop over the same stages; thinking, tool_use and stop reasons against a scripted backend whose
"model" emits a known token sequence; prompts of tool results against deltafin.text.chat.encode of the
equivalent OpenAI-style messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.http import anthropic_api as am
from deltafin.coordinator.http.request import ApiError
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.chat import ChatOptions, encode, render_text
from deltafin.text.tokenizer import K3Tokenizer
from tests.support.serving import (
    ScriptedBackend,
    ServedApi,
    SlowPrefill,
    argmax_loop,
    script_ids,
    serve_api,
    stop_ids,
)

MODEL = "tiny"
SYSTEM = "Be brief."
TURNS = [{"role": "user", "content": "What is a token?"}, {"role": "assistant", "content": "A piece of text."},
         {"role": "user", "content": "And a byte?"}]
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": TOOLS[0]["input_schema"]}}]
ARGS = {"city": "Zürich", "days": 2}
GREEDY = {"extra_body": {"temperature": 0}}  # the client no longer has sampling arguments; the API still takes them


async def _scripted(tok: K3Tokenizer, tiny_dir: Path, text: str, **kw):
    backend = ScriptedBackend(tok.vocab_size, script_ids(tok, text))
    return (backend, *await serve_api(backend, tok, load_config(tiny_dir), **kw))


async def _raw_events(url: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict | str]]:
    """A stream's SSE as sent: (event name, data) and (":", comment) in order."""
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/messages", json=body, headers=headers) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    out: list[tuple[str, dict | str]] = []
    for frame in text.split("\n\n"):
        if frame.startswith(": "):
            out.append((":", frame[2:]))
        elif frame:
            name, data = frame.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), frame
            out.append((name[len("event: "):], json.loads(data[len("data: "):])))
            assert out[-1][0] == out[-1][1]["type"]
    return out


def _types(kinds: list[str]) -> str:
    """Event types with runs of deltas shown once: message_start ping content_block_start delta+ ..."""
    return re.sub(r"(content_block_delta )+", "content_block_delta+ ", " ".join(kinds) + " ").strip()


# ---- greedy text: the OpenAI route and an argmax loop ------------------------------------------------------


async def test_greedy_text_equals_the_openai_route_and_an_argmax_loop_stream_and_not(server: ServedApi, pipeline,
                                                                                     tok) -> None:
    chat = [{"role": "system", "content": SYSTEM}, *TURNS]
    prompt = encode(tok, chat, ChatOptions(thinking=False, effort=None))  # no `thinking`: none, as Anthropic's
    ids, _ = await asyncio.to_thread(argmax_loop, pipeline, prompt, 12, stop_ids(tok))
    text = tok.decode([i for i in ids if i not in tok.special_ids])
    assert text  # the comparison below is about some text
    ask = {"model": "claude-sonnet-4-5", "system": SYSTEM, "messages": TURNS, "max_tokens": 12}
    r = await server.anthropic().messages.create(**ask, **GREEDY)
    assert (r.type, r.role, r.model) == ("message", "assistant", MODEL) and r.id.startswith("msg_")
    assert [(b.type, b.text) for b in r.content] == [("text", text)]
    assert r.stop_reason == ("end_turn" if ids[-1] in stop_ids(tok) else "max_tokens") and r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.cache_read_input_tokens,
            r.usage.cache_creation_input_tokens) == (len(prompt), len(ids), 0, 0)
    o = await server.openai().chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0,
                                                      reasoning_effort="none")
    assert o.choices[0].message.content == text and o.usage.prompt_tokens == len(prompt)

    raw = await _raw_events(server.url, {**ask, "stream": True, "temperature": 0})
    assert _types([k for k, _ in raw]) == ("message_start ping content_block_start content_block_delta+ "
                                           "content_block_stop message_delta message_stop")
    start, delta = raw[0][1], raw[-2][1]
    assert start["message"]["content"] == [] and start["message"]["usage"]["input_tokens"] == len(prompt)
    assert raw[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for k, d in raw if k == "content_block_delta") == text
    assert delta["delta"] == {"stop_reason": r.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(ids)
    stream = await server.anthropic().messages.create(**ask, stream=True, **GREEDY)  # the client skips the ping
    events = [e async for e in stream]
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text


async def test_thinking_enabled_is_the_openai_routes_reasoning_at_the_mapped_effort(server: ServedApi) -> None:
    ask = {"model": MODEL, "system": SYSTEM, "messages": TURNS, "max_tokens": 8, **GREEDY}
    r = await server.anthropic().messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 2048})
    o = await server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *TURNS], max_tokens=8, temperature=0,
        reasoning_effort="low")
    reasoning = o.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    assert reasoning  # no markers in the random output: it stays in the think channel
    assert [(b.type, b.thinking, b.signature) for b in r.content] == [("thinking", reasoning, "")]
    assert r.usage.input_tokens == o.usage.prompt_tokens


async def test_thinking_budgets_map_to_k3_efforts_in_the_prompt(server: ServedApi, tok) -> None:
    messages = [{"role": "user", "content": "hi"}]
    client = server.anthropic()
    for thinking, options in [(None, ChatOptions(thinking=False, effort=None)),
                              ({"type": "disabled"}, ChatOptions(thinking=False, effort=None)),
                              ({"type": "enabled", "budget_tokens": 1024}, ChatOptions(effort="low")),
                              ({"type": "enabled", "budget_tokens": 8000}, ChatOptions(effort="high")),
                              ({"type": "enabled", "budget_tokens": 32000}, ChatOptions(effort="max")),
                              ({"type": "adaptive"}, ChatOptions(effort="low"))]:
        extra = {"thinking": thinking} if thinking else {}
        n = await client.messages.count_tokens(model=MODEL, messages=messages, extra_body=extra)
        assert n.input_tokens == len(encode(tok, messages, options)), thinking
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    for effort, options in [("medium", ChatOptions(effort="high")), ("xhigh", ChatOptions(effort="max"))]:
        ask = {"model": MODEL, "messages": messages, "thinking": {"type": "adaptive"},
               "output_config": {"effort": effort, "format": {"type": "json_schema", "schema": schema}}}
        prompts = server.spy()
        await client.messages.create(**ask, max_tokens=1)
        fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
        assert prompts == [encode(tok, messages, dataclasses.replace(options, response_format=fmt))], effort
        assert "response_format=json_schema" in tok.decode(prompts[0]) and '"answer"' in tok.decode(prompts[0])


# ---- stop reasons (a scripted model) ------------------------------------------------------------------------


async def test_stop_sequences_cut_the_text_and_max_tokens_counts(tok, tiny_dir: Path) -> None:
    backend, engine, runner, srv = await _scripted(tok, tiny_dir, "The answer is 42, surely.<|end_of_msg|>")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "?"}], **GREEDY}
    try:
        client = srv.anthropic()
        r = await client.messages.create(**ask, max_tokens=50, stop_sequences=["42", "never"])
        assert [b.text for b in r.content] == ["The answer is "]
        assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "42")
        stream = await client.messages.create(**ask, max_tokens=50, stop_sequences=["42"], stream=True)
        events = [e async for e in stream]
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "The answer is "
        assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", "42")
        r = await client.messages.create(**ask, max_tokens=3)
        assert (r.stop_reason, r.usage.output_tokens) == ("max_tokens", 3)
        assert r.content[0].text == tok.decode(script_ids(tok, "The answer is")[:3])
        r = await client.messages.create(**ask, max_tokens=50)
        assert (r.stop_reason, r.content[0].text) == ("end_turn", "The answer is 42, surely.")
        assert r.usage.output_tokens == len(script_ids(tok, "The answer is 42, surely.")) + 1  # and the stop token
    finally:
        await runner.cleanup()
        await engine.scheduler.close()


# ---- thinking and tool_use blocks, tool_result round trip --------------------------------------------------


def _tool_script() -> str:
    assistant = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the weather.",
                 "tool_calls": [{"function": {"name": "get_weather", "arguments": ARGS}}]}
    written = render_text([assistant], ChatOptions(add_generation_prompt=False, effort=None))
    return written[len('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'):]


async def test_thinking_text_and_tool_use_blocks_stream_and_not(tok, tiny_dir: Path) -> None:
    backend, engine, runner, srv = await _scripted(tok, tiny_dir, _tool_script())
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
           "max_tokens": 200, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    try:
        r = await srv.anthropic().messages.create(**ask)
        assert [b.type for b in r.content] == ["thinking", "text", "tool_use"]
        assert (r.content[0].thinking, r.content[1].text) == ("Need the weather.", "Let me check.")
        call = r.content[2]
        assert (call.name, call.input) == ("get_weather", ARGS) and call.id.startswith("toolu_")
        assert (r.stop_reason, r.usage.output_tokens) == ("tool_use", len(script_ids(tok, _tool_script())))
        raw = await _raw_events(srv.url, {**ask, "stream": True})
        assert _types([k for k, _ in raw]) == ("message_start ping " + "content_block_start content_block_delta+ "
                                               "content_block_stop " * 3 + "message_delta message_stop")
        deltas = " ".join(f'{d["index"]}:{d["delta"]["type"]}' for k, d in raw if k == "content_block_delta")
        assert re.fullmatch(r"(0:thinking_delta )+0:signature_delta (1:text_delta )+2:input_json_delta", deltas)
        assert json.loads(raw[-4][1]["delta"]["partial_json"]) == ARGS
        starts = [d["content_block"] for k, d in raw if k == "content_block_start"]
        assert starts[2] == {"type": "tool_use", "id": starts[2]["id"], "name": "get_weather", "input": {}}
        async with srv.anthropic().messages.stream(**ask) as stream:  # the client's accumulator
            final = await stream.get_final_message()
        assert [b.model_dump(exclude={"id"}) for b in final.content] == [
            b.model_dump(exclude={"id"}) for b in r.content]
        assert final.stop_reason == "tool_use" and final.usage.output_tokens == r.usage.output_tokens
        assert len(backend.released) == 3  # every session was released
    finally:
        await runner.cleanup()
        await engine.scheduler.close()


async def test_a_tool_result_turn_renders_as_the_equivalent_openai_messages(tok, tiny_dir: Path) -> None:
    backend, engine, runner, srv = await _scripted(tok, tiny_dir, "It is sunny.<|end_of_msg|>")
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "Need the weather.", "signature": "sig"},
                   {"type": "text", "text": "Let me check."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGS},
                   {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Bern"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}],
                    "is_error": True},
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                   {"type": "text", "text": "Thanks!"}]}]
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the weather.",
             "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                              "arguments": ARGS}},
                            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather",
                                                                              "arguments": {"city": "Bern"}}}]},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: rain"},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
            {"role": "user", "content": "Thanks!"}]
    expected = encode(tok, chat, ChatOptions(effort="low", tools=OPENAI_TOOLS))
    assert 'role="tool" tool="get_weather" index="2"<|sep|>Error: rain' in tok.decode(expected)
    prompts = srv.spy()
    try:
        ask = {"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 20,
               "thinking": {"type": "enabled", "budget_tokens": 4096}}
        r = await srv.anthropic().messages.create(**ask)
        assert prompts == [expected]
        assert (r.usage.input_tokens, r.stop_reason) == (len(expected), "end_turn")
        assert [b.thinking for b in r.content if b.type == "thinking"] == ["It is sunny."]  # still the think channel
        n = await srv.anthropic().messages.count_tokens(model=MODEL, messages=history, tools=TOOLS,
                                                     thinking={"type": "enabled", "budget_tokens": 4096})
        assert n.input_tokens == len(expected)
        o = await srv.openai().chat.completions.create(model=MODEL, messages=chat, tools=OPENAI_TOOLS,
                                                       max_tokens=20, reasoning_effort="low")
        assert prompts[-1] == expected and o.usage.prompt_tokens == len(expected)
    finally:
        await runner.cleanup()
        await engine.scheduler.close()


async def test_tool_choice_any_and_a_named_tool_are_k3s_required(server: ServedApi, tok) -> None:
    two = [*TOOLS, {"name": "get_time", "input_schema": {"type": "object"}}]
    openai_two = [*OPENAI_TOOLS, {"type": "function", "function": {"name": "get_time",
                                                                   "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    off = ChatOptions(thinking=False, effort=None)
    cases = [({"type": "auto"}, ChatOptions(thinking=False, effort=None, tools=openai_two)),
             ({"type": "any"}, ChatOptions(thinking=False, effort=None, tools=openai_two, tool_choice="required")),
             ({"type": "none"}, ChatOptions(thinking=False, effort=None, tools=openai_two, tool_choice="none")),
             ({"type": "tool", "name": "get_time"},
              ChatOptions(thinking=False, effort=None, tools=openai_two[1:], tool_choice="required"))]
    for choice, options in cases:
        n = await server.anthropic().messages.count_tokens(model=MODEL, messages=messages, tools=two,
                                                           tool_choice=choice)
        assert n.input_tokens == len(encode(tok, messages, options)) != len(encode(tok, messages, off)), choice


# ---- usage: the prefix cache ------------------------------------------------------------------------------


async def test_a_second_turn_reads_the_first_turns_prefix_from_the_cache(tok, tiny_dir: Path) -> None:
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")  # its own stages: no prefix kept by another test
    backend = LocalBackend(pipe)
    engine, runner, srv = await serve_api(backend, tok, load_config(tiny_dir), prefix_cache=True, max_context=512)
    client = srv.anthropic()
    try:
        first = {"model": MODEL, "system": SYSTEM, "messages": TURNS[:1], "max_tokens": 6, **GREEDY}
        r = await client.messages.create(**first)
        n1 = (await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=TURNS[:1])).input_tokens
        # the whole prompt is kept (its message ends and its end): written to the cache, none read
        u = r.usage
        assert (u.input_tokens, u.cache_creation_input_tokens, u.cache_read_input_tokens) == (0, n1, 0)
        reply = "".join(b.text for b in r.content)
        turns = [TURNS[0], {"role": "assistant", "content": reply or "."}, TURNS[2]]
        second = {**first, "messages": turns}
        n2 = (await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=turns)).input_tokens
        r = await client.messages.create(**second)
        cached = r.usage.cache_read_input_tokens
        assert n1 - 1 <= cached < n2 and r.usage.input_tokens + r.usage.cache_creation_input_tokens + cached == n2
        async with client.messages.stream(**second) as stream:  # message_delta carries the cache read
            final = await stream.get_final_message()
        assert final.usage.cache_read_input_tokens == n2  # the same request again: its whole prompt
        assert final.usage.input_tokens == final.usage.cache_creation_input_tokens == 0
    finally:
        await runner.cleanup()
        await engine.close()


# ---- errors, auth, model names ------------------------------------------------------------------------------


@pytest.mark.parametrize("change,says", [
    ({"max_tokens": anthropic.omit}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "video"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text model"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]}, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
     "answers no tool_use"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 600}, "context limit"),  # past the 512-token context
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"tool_choice": {"type": "any"}}, "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     "disable_parallel_tool_use"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"stop_sequences": [""]}, "stop_sequences"),
])
async def test_bad_requests_are_400_invalid_request_error(server: ServedApi, change: dict, says: str) -> None:
    sampling = {k: change.pop(k) for k in ("temperature", "top_p") if k in change}
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **change}
    with pytest.raises(anthropic.BadRequestError) as e:
        await server.anthropic().messages.create(**ask, extra_body=sampling)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"  # type: ignore[index]
    error = e.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and says in error["message"], error


async def test_errors_on_messages_paths_are_anthropic_shaped_and_openais_stay_openai(server: ServedApi) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/messages", data=b"{nope") as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(server.url + "/v1/messages/nothing", json={}) as r:
            assert (r.status, await r.json()) == (404, {"type": "error", "error": {
                "type": "not_found_error", "message": "Not Found"}})
        async with s.post(server.url + "/v1/messages", data=b"x" * (2 << 20)) as r:
            assert r.status == 413 and (await r.json())["error"]["type"] == "request_too_large"
        async with s.post(server.url + "/v1/chat/completions", data=b"{nope") as r:
            assert r.status == 400 and set((await r.json())["error"]) == {"message", "type", "param", "code"}
    assert am.error_body(ApiError(429, "busy", type="rate_limit_error")) == (
        529, {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    assert am.error_body(ApiError(503, "a worker failed", type="server_error"))[1]["error"]["type"] == "api_error"


async def test_x_api_key_or_bearer_and_a_wrong_key_is_authentication_error(pipeline, tok, tiny_dir: Path) -> None:
    backend = LocalBackend(pipeline)
    engine, runner, srv = await serve_api(backend, tok, load_config(tiny_dir), api_key="s3cret")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **GREEDY}
    try:
        r = await srv.anthropic("s3cret").messages.create(**ask)  # x-api-key
        assert r.usage.output_tokens >= 1
        bearer = anthropic.AsyncAnthropic(base_url=srv.url, auth_token="s3cret", max_retries=0, timeout=60)
        assert (await bearer.messages.create(**ask)).content == r.content
        assert (await srv.openai("s3cret").models.list()).data[0].id == MODEL
        with pytest.raises(anthropic.AuthenticationError) as e:
            await srv.anthropic("wrong").messages.create(**ask)
        assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        with pytest.raises(anthropic.AuthenticationError):
            await srv.anthropic("wrong").messages.count_tokens(model=MODEL, messages=ask["messages"])
        with pytest.raises(openai.AuthenticationError) as o:
            await srv.openai("wrong").models.list()
        assert o.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        async with aiohttp.ClientSession() as s, s.get(srv.url + "/health") as h:
            assert h.status == 200
    finally:
        await runner.cleanup()
        await engine.scheduler.close()
        backend.executor.shutdown(wait=True)


async def test_any_model_name_answers_with_the_served_one_unless_strict(server: ServedApi) -> None:
    ask = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **GREEDY}
    assert (await server.anthropic().messages.create(model="claude-opus-4-1", **ask)).model == MODEL
    server.engine.strict_model_name = True
    try:
        with pytest.raises(anthropic.NotFoundError) as e:
            await server.anthropic().messages.create(model="claude-opus-4-1", **ask)
        assert e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        assert "claude-opus-4-1" in e.value.body["error"]["message"]  # type: ignore[index]
        with pytest.raises(anthropic.NotFoundError):
            await server.anthropic().messages.count_tokens(model="claude-opus-4-1", messages=ask["messages"])
        assert (await server.anthropic().messages.create(model=MODEL, **ask)).model == MODEL
    finally:
        server.engine.strict_model_name = False


async def test_a_full_queue_is_529_overloaded_error(tok, tiny_dir: Path) -> None:
    class Held(ScriptedBackend):
        gate = asyncio.Event()

        async def forward(self, batch, all_logits=False, progress=None):
            await self.gate.wait()
            return await super().forward(batch, all_logits)

    backend = Held(tok.vocab_size, script_ids(tok, "Done.<|end_of_msg|>"))
    engine, runner, srv = await serve_api(backend, tok, load_config(tiny_dir), max_active=1, queue_depth=0)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    try:
        running = asyncio.ensure_future(srv.anthropic().messages.create(**ask))
        for _ in range(100):
            if engine.scheduler.stats.active == 1:
                break
            await asyncio.sleep(0.02)
        for stream in (False, True):  # a stream that cannot start is a status too, not an event
            with pytest.raises(anthropic.OverloadedError) as e:
                await srv.anthropic().messages.create(**ask, stream=stream)
            assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"  # type: ignore
        backend.gate.set()
        assert [b.text for b in (await running).content] == ["Done."]
    finally:
        backend.gate.set()
        await runner.cleanup()
        await engine.scheduler.close()


# ---- a long prefill: pings, and a failure as an error event ------------------------------------------------


async def test_a_stream_waiting_for_its_first_token_pings_and_fails_as_an_error_event(tok, tiny_dir: Path,
                                                                                      monkeypatch) -> None:
    from deltafin.coordinator.http import server as server_module

    monkeypatch.setattr(server_module, "HEARTBEAT_S", 0.05)

    backend = SlowPrefill(tok.vocab_size, script_ids(tok, "Hello there.<|end_of_msg|>"))
    engine, runner, srv = await serve_api(backend, tok, load_config(tiny_dir), max_active=1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 40}], "max_tokens": 20,
            "stream": True}
    try:
        raw = await _raw_events(srv.url, body)
        kinds = [k for k, _ in raw]
        first_block = kinds.index("content_block_start")
        assert kinds[:2] == ["message_start", "ping"]
        waiting = kinds[2:first_block]
        assert waiting and waiting == [":", "ping"] * (len(waiting) // 2)  # a comment and a ping per heartbeat
        assert all(re.fullmatch(r"prefill \d+/\d+ tokens.*", c) for k, c in raw[2:first_block] if k == ":")
        assert "".join(d["delta"]["text"] for k, d in raw if k == "content_block_delta") == "Hello there."
        backend.fail = True
        raw = await _raw_events(srv.url, body)
        assert raw[-1] == ("error", {"type": "error", "error": {
            "type": "api_error", "message": "the workers that answer cannot run the model"}})
        with pytest.raises(anthropic.APIStatusError) as e:  # the client raises the error event
            async for _ in await srv.anthropic().messages.create(**{k: v for k, v in body.items() if k != "stream"},
                                                               stream=True):
                pass
        assert e.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    finally:
        await runner.cleanup()
        await engine.scheduler.close()
