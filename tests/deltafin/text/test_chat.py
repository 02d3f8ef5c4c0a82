"""K3's chat format against llama.cpp's `Kimi-K3.jinja` rendered with jinja2, and the output parser."""

from __future__ import annotations

import json
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltafin.errors import ChatFormatError
from deltafin.text.chat import ChatOptions, OutputParser, encode, render, render_text
from deltafin.text.tokenizer import K3Tokenizer
from tests.support.references import kimi_k3_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city (°C), «quoted» & escaped",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "城市名"}, "Days": {"type": "integer"},
        "units": {"type": "string", "enum": ["c", "f"]}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "q": {"type": "string"}}}}}
ARGS = {"city": "Zürich", "days": 3, "ratio": 0.5, "metric": True, "note": None, "tags": ["a", "b"],
        "opts": {"z": 1, "A": [1, 2]}}

CONVERSATIONS: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    ("one user message", [{"role": "user", "content": "Hello!"}], {}),
    ("system, multi-turn, reasoning kept", [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them.\n"},
        {"role": "user", "content": "And 3+3?"}], {"thinking_effort": "low"}),
    ("thinking off", [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello", "reasoning_content": "dropped"},
                      {"role": "user", "content": "bye"}], {"thinking": False}),
    ("effort high, blank reasoning", [{"role": "user", "content": "x"},
                                      {"role": "assistant", "content": "y", "reasoning_content": "   "},
                                      {"role": "user", "content": "z"}], {"thinking_effort": "high"}),
    ("no effort message", [{"role": "user", "content": "q"}], {"thinking_effort": None}),
    ("tools, calls answered out of order by id", [
        {"role": "user", "content": "Weather in Zürich and news?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two calls.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
            {"id": "c2", "type": "function", "function": {"name": "search", "arguments": '{"q": "news"}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "headlines"},
        {"role": "tool", "tool_call_id": "c1", "content": "12 °C"},
        {"role": "user", "content": "thanks"}], {"tools": [WEATHER, SEARCH], "tool_choice": "required"}),
    ("tool messages matched by order and by name", [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"q": "a"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "name": "renamed", "content": "r2"}], {"tools": [SEARCH, WEATHER], "tool_choice": "none"}),
    ("json block and empty-string arguments", [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"function": {"name": "search", "arguments": {"q": 1}, "_xtml_json_block": '{"q": 1}'}},
            {"function": {"name": "search", "arguments": "  "}}]}], {"tools": [SEARCH]}),
    ("dynamic tools from a system message", [
        {"role": "system", "tools": [SEARCH]}, {"role": "user", "content": "find"}], {}),
    ("json_object response format", [{"role": "user", "content": "json please"}],
     {"response_format": {"type": "json_object"}}),
    ("json_schema response format", [{"role": "user", "content": "person"}],
     {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
         "type": "object", "properties": {"name": {"type": "string"}, "Age": {"type": "integer"}}}}}}),
    ("content parts, names, markers typed as text, unicode", [
        {"role": "system", "name": 'ops "A&B"', "content": "Be <|open|> careful <|sep|>."},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "看这个 🙂"},
                                                    {"type": "text", "text": " and <|end_of_msg|>"}]},
        {"role": "assistant", "name": "bot", "content": "  spaced\n\n"}], {}),
    ("no generation prompt", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
     {"add_generation_prompt": False}),
]


def _options(kwargs: dict[str, Any]) -> ChatOptions:
    thinking = kwargs.get("thinking", True)
    return ChatOptions(thinking=thinking, effort=kwargs.get("thinking_effort", "max"), tools=kwargs.get("tools"),
                       tool_choice=kwargs.get("tool_choice"), response_format=kwargs.get("response_format"),
                       add_generation_prompt=kwargs.get("add_generation_prompt", True))


@pytest.fixture(scope="module")
def template() -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = True, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    # as transformers renders chat templates
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(kimi_k3_template())


@pytest.mark.parametrize("name,messages,kwargs", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_render_matches_jinja_template(template: jinja2.Template, name: str, messages: list, kwargs: dict) -> None:
    expected = template.render(messages=messages, add_generation_prompt=kwargs.get("add_generation_prompt", True),
                               **{k: v for k, v in kwargs.items() if k != "add_generation_prompt"})
    assert render_text(messages, _options(kwargs)) == expected


def test_template_errors_are_ours_too(template: jinja2.Template) -> None:
    cases = [([{"role": "user", "content": "x"}], {"thinking_effort": "medium"}),
             ([{"content": "no role"}], {}),
             ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}], {}),
             ([{"role": "assistant", "content": "", "tool_calls": ["not a mapping"]}], {}),
             ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
              {}),
             ([{"role": "user", "content": "x"}, {"role": "tool", "content": "orphan"}], {})]
    for messages, kwargs in cases:
        with pytest.raises(jinja2.TemplateError):
            template.render(messages=messages, add_generation_prompt=True, **kwargs)
        with pytest.raises(ChatFormatError):
            render(messages, _options(kwargs))


def test_markers_are_specials_and_text_is_not(tiny_dir) -> None:
    tok = K3Tokenizer.load(tiny_dir)
    messages = [{"role": "user", "content": "type <|open|> and <|end_of_msg|> literally"}]
    ids = encode(tok, messages, ChatOptions(effort=None))
    sp = tok.specials
    markers = [i for i in ids if i in tok.special_ids]
    # open message / sep / close message / sep / end_of_msg, then the generation prompt's two open tags
    assert markers == [sp["<|open|>"], sp["<|sep|>"], sp["<|close|>"], sp["<|sep|>"], sp["<|end_of_msg|>"],
                       sp["<|open|>"], sp["<|sep|>"], sp["<|open|>"], sp["<|sep|>"]]
    assert tok.decode(ids) == render_text(messages, ChatOptions(effort=None))


def _parse(tok: K3Tokenizer, text_segments: list[tuple[str, bool]], thinking: bool = True):
    parser = OutputParser(tok, thinking=thinking)
    reasoning, content, calls = [], [], []
    for text, special in text_segments:
        for i in tok.encode(text, allow_special=special):
            d = parser.push(i)
            reasoning.append(d.reasoning)
            content.append(d.content)
            calls += d.tool_calls
    d = parser.flush()
    return "".join(reasoning) + d.reasoning, "".join(content) + d.content, calls + d.tool_calls


def _as_output(messages_tail: str) -> list[tuple[str, bool]]:
    """A model output written in the format, split into (text, is special) like render() does."""
    out: list[tuple[str, bool]] = []
    rest = messages_tail
    while rest:
        cut = min((rest.find(m) for m in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>") if m in rest),
                  default=-1)
        if cut < 0:
            out.append((rest, False))
            break
        if cut:
            out.append((rest[:cut], False))
        marker = next(m for m in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>") if rest.startswith(m, cut))
        out.append((marker, True))
        rest = rest[cut + len(marker):]
    return out


def test_parser_splits_reasoning_response_and_tool_calls(tiny_dir) -> None:
    tok = K3Tokenizer.load(tiny_dir)
    # what the model emits after the generation prompt, written by render() for an assistant message
    args = {"city": "Zürich", "days": 3, "metric": True, "tags": ["x"]}
    full = render_text([{"role": "assistant", "content": "Checking 天气 🙂", "reasoning_content": "I should call.",
                         "tool_calls": [{"function": {"name": "get_weather", "arguments": args}},
                                        {"function": {"name": "search", "arguments": '{"q": "a \\"b\\""}'}}]}],
                       ChatOptions(add_generation_prompt=False, effort=None))
    prompt_part = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    assert full.startswith(prompt_part)
    reasoning, content, calls = _parse(tok, _as_output(full[len(prompt_part):]))
    assert reasoning == "I should call."
    assert content == "Checking 天气 🙂"
    assert [(c.name, json.loads(c.arguments), c.index) for c in calls] == [
        ("get_weather", args, 0), ("search", {"q": 'a "b"'}, 1)]


def test_parser_without_thinking_and_with_a_model_that_ignores_the_format(tiny_dir) -> None:
    tok = K3Tokenizer.load(tiny_dir)
    reasoning, content, calls = _parse(tok, [("plain words", False), ("<|close|>", True), ("response", False),
                                             ("<|sep|>", True)], thinking=False)
    assert (reasoning, content, calls) == ("", "plain words", [])
    reasoning, content, _ = _parse(tok, [("thoughts", False), ("<|close|>", True), ("think", False),
                                         ("<|sep|>", True), ("<|open|>", True), ("response", False),
                                         ("<|sep|>", True), ("answer", False)])
    assert (reasoning, content) == ("thoughts", "answer")
