"""Ollama's API, driven by the official `ollama` client against a running server over in-process stages of
`tiny` (as test_server.py's): greedy text equals the OpenAI route's for the same conversation, streamed and not;
generate equals a chat of one user message (raw: a plain completion); the model routes describe the served
model; tool calls and thinking against a scripted backend; bad requests are 400 with Ollama's {"error"}."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import ollama
import openai
import pytest

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.http import ollama_api as ol
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.chat import ChatOptions, render_text
from deltafin.text.tokenizer import K3Tokenizer
from tests.support.serving import ScriptedBackend, script_ids, serve, served_pipeline

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"}]
GREEDY = {"temperature": 0, "num_predict": 10}


@pytest.fixture
async def url(pipeline: LocalPipeline, tok: K3Tokenizer, tiny_dir: Path):
    async with served_pipeline(pipeline, tok, load_config(tiny_dir), model=MODEL, max_context=512) as (engine, url):
        engine.model_dir = tiny_dir  # (open_engine's engines know it)
        yield url


def _clients(url: str) -> tuple[ollama.AsyncClient, openai.AsyncOpenAI]:
    return (ollama.AsyncClient(host=url, timeout=120),
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120))


async def test_chat_is_the_openai_routes_text_streamed_and_not(url: str) -> None:
    client, oai = _clients(url)
    for think, effort in ((False, "none"), (True, "low"), ("medium", "high")):
        o = await oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                              reasoning_effort=effort)
        want = (o.choices[0].message.content, getattr(o.choices[0].message, "reasoning_content", None) or "")
        r = await client.chat(model=MODEL, messages=CHAT, options=GREEDY, think=think)
        assert (r.message.content, r.message.thinking or "") == want, think
        assert r.done and r.done_reason == o.choices[0].finish_reason
        assert (r.prompt_eval_count, r.eval_count) == (o.usage.prompt_tokens, o.usage.completion_tokens)
        parts = [p async for p in await client.chat(model=MODEL, messages=CHAT, options=GREEDY, think=think,
                                                     stream=True)]
        assert "".join(p.message.content for p in parts) == want[0]
        assert "".join(p.message.thinking or "" for p in parts) == want[1]
        assert parts[-1].done and not any(p.done for p in parts[:-1])
    async with aiohttp.ClientSession() as s:  # no model (the client always names one)
        body = {"messages": CHAT, "options": {"temperature": 0, "num_predict": 3}, "think": False, "stream": False}
        async with s.post(url + "/api/chat", json=body) as r:
            answer = await r.json()
    assert (answer["model"], answer["eval_count"]) == (MODEL, 3)


async def test_generate_is_a_chat_of_one_message_and_raw_a_plain_completion(url: str) -> None:
    client, oai = _clients(url)
    r = await client.generate(model=MODEL, prompt="What is a token?", system="Be brief.", options=GREEDY, think=False)
    o = await oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                          reasoning_effort="none")
    assert r.response == o.choices[0].message.content and r.done
    raw = await client.generate(model=MODEL, prompt="tokens are bytes", raw=True, options=GREEDY)
    c = await oai.completions.create(model=MODEL, prompt="tokens are bytes", max_tokens=10, temperature=0)
    assert raw.response == c.choices[0].text
    streamed = [p async for p in await client.generate(model=MODEL, prompt="tokens are bytes", raw=True,
                                                        options=GREEDY, stream=True)]
    assert "".join(p.response for p in streamed) == c.choices[0].text


async def test_the_model_routes_describe_the_served_model(url: str) -> None:
    client, _ = _clients(url)
    (model,) = (await client.list()).models
    assert model.model == MODEL and model.size > 100_000 and model.digest and model.details.family == "kimi_k3"
    shown = await client.show(MODEL)
    assert shown.modelinfo["kimi_k3.context_length"] == 512 and "thinking" in shown.capabilities
    (running,) = (await client.ps()).models
    assert running.model == MODEL
    async with aiohttp.ClientSession() as s, s.get(url + "/api/version") as r:
        assert (await r.json())["version"] == ol.VERSION


async def test_bad_requests_are_400_with_ollamas_error(url: str) -> None:
    client, _ = _clients(url)
    cases = [({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
             ({"messages": CHAT, "options": {"temperature": "hot"}}, "options.temperature"),
             ({"messages": CHAT, "options": {"num_ctx": 100000}}, "num_ctx"),
             ({"messages": CHAT, "think": "very"}, "think"),
             ({"messages": []}, "messages")]
    async with aiohttp.ClientSession() as s:
        for body, says in cases:
            async with s.post(url + "/api/chat", json={"model": MODEL, **body}) as r:
                assert r.status == 400 and says in (await r.json())["error"], body
    with pytest.raises(ollama.ResponseError) as e:
        await client.chat(model=MODEL, messages=[{"role": "user", "content": "x" * 5000}], options={"num_predict": 1})
    assert e.value.status_code == 400 and "context limit" in e.value.error


async def test_tool_calls_and_thinking(tok, tiny_dir: Path) -> None:
    args = {"city": "Zürich", "days": 2}
    assistant = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the weather.",
                 "tool_calls": [{"function": {"name": "get_weather", "arguments": args}}]}
    written = render_text([assistant], ChatOptions(add_generation_prompt=False, effort=None))
    script = written[len('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'):]
    backend = ScriptedBackend(tok.vocab_size, script_ids(tok, script))
    engine, runner, url = await serve(backend, tok, load_config(tiny_dir), MODEL)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        client, _ = _clients(url)
        r = await client.chat(model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=tools,
                              options={"num_predict": 200})
        assert (r.message.thinking, r.message.content) == ("Need the weather.", "Let me check.")
        (call,) = r.message.tool_calls
        assert (call.function.name, dict(call.function.arguments)) == ("get_weather", args)
        # the call and its result go back: rendered as the chat format renders the OpenAI-shaped conversation
        follow = [{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": "Let me check.", "thinking": "Need the weather.",
                   "tool_calls": [{"function": {"name": "get_weather", "arguments": args}}]},
                  {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
        again = await client.chat(model=MODEL, messages=follow, tools=tools, options={"num_predict": 5})
        assert again.done
    finally:
        await runner.cleanup()
        await engine.scheduler.close()
