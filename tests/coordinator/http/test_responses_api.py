"""OpenAI's Responses API, driven by the official `openai` client's `responses.create` against a running server
over in-process stages of `tiny`: greedy text equals the chat completions route's for the same conversation,
streamed and not; reasoning items, function calls and their round trip against a scripted backend; what it cannot
do is a 400 naming the parameter."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from deltafin.checkpoint.config import load_config
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.chat import ChatOptions, render_text
from deltafin.text.tokenizer import K3Tokenizer
from tests.support.serving import ScriptedBackend, script_ids, serve, served_pipeline

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"}]


@pytest.fixture
async def client(pipeline: LocalPipeline, tok: K3Tokenizer, tiny_dir: Path):
    async with served_pipeline(pipeline, tok, load_config(tiny_dir), model=MODEL, max_context=512) as (_, url):
        yield openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def test_text_and_reasoning_equal_the_chat_route_streamed_and_not(client: openai.AsyncOpenAI) -> None:
    for effort, chat_effort in (("none", "none"), ("low", "low"), ("medium", "high")):
        o = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                 reasoning_effort=chat_effort)
        text = o.choices[0].message.content
        thought = getattr(o.choices[0].message, "reasoning_content", None) or ""
        r = await client.responses.create(model=MODEL, instructions="Be brief.", input="What is a token?",
                                          max_output_tokens=10, temperature=0, reasoning={"effort": effort})
        assert r.output_text == text and r.usage.input_tokens == o.usage.prompt_tokens
        assert r.usage.output_tokens == o.usage.completion_tokens
        reasoning = [i for i in r.output if i.type == "reasoning"]
        assert "".join(c.text for i in reasoning for c in i.content) == thought
        assert r.status == ("incomplete" if o.choices[0].finish_reason == "length" else "completed")
        stream = await client.responses.create(model=MODEL, input=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "What is a token?"}],
                                               max_output_tokens=10, temperature=0, reasoning={"effort": effort},
                                               stream=True)
        events = [e async for e in stream]
        assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                            "response.incomplete")
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        assert events[-1].response.output_text == text
        assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_what_it_cannot_do_is_a_400_naming_the_parameter(client: openai.AsyncOpenAI) -> None:
    cases = [({"previous_response_id": "resp_1"}, "previous_response_id"),
             ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
             ({"tools": [{"type": "web_search"}]}, "tools"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "input[0].content")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(**{"model": MODEL, "input": "hi", **extra})
        assert e.value.body["param"] == param, extra  # type: ignore[index]


async def test_function_calls_and_their_results(tok, tiny_dir: Path) -> None:
    args = {"city": "Zürich"}
    assistant = {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
                 "tool_calls": [{"function": {"name": "get_weather", "arguments": args}}]}
    written = render_text([assistant], ChatOptions(add_generation_prompt=False, effort=None))
    script = written[len('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'):]
    backend = ScriptedBackend(tok.vocab_size, script_ids(tok, script))
    engine, runner, url = await serve(backend, tok, load_config(tiny_dir), MODEL)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "name": "get_weather", "description": "The weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    try:
        r = await client.responses.create(model=MODEL, input="weather?", tools=tools, max_output_tokens=200)
        kinds = [i.type for i in r.output]
        assert kinds == ["reasoning", "function_call"], kinds
        call = r.output[1]
        assert (call.name, json.loads(call.arguments)) == ("get_weather", args)
        stream = await client.responses.create(model=MODEL, input="weather?", tools=tools, max_output_tokens=200,
                                               stream=True)
        events = [e async for e in stream]
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and json.loads(done[0].arguments) == args
        follow = await client.responses.create(model=MODEL, tools=tools, max_output_tokens=5, input=[
            {"role": "user", "content": "weather?"}, r.output[0].model_dump(), call.model_dump(),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert follow.status in ("completed", "incomplete")
    finally:
        await runner.cleanup()
        await engine.scheduler.close()
