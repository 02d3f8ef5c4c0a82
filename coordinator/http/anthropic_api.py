"""Anthropic's Messages API shapes: JSON bodies in, the chat messages and options the OpenAI path renders out;
generation events in, Anthropic's message or stream events out.

No HTTP here (that is `server.py`). A request becomes OpenAI-style chat messages (`deltafin.text.chat` renders
them into K3's format): `system` a system message; text blocks the message's text; an assistant's `thinking`
blocks its reasoning (`redacted_thinking` is dropped: only Anthropic can read it); `tool_use` blocks its tool
calls; a user's `tool_result` blocks tool messages answering them by id (`is_error`: the text starts with
"Error: ", as K3's format has no error flag). `thinking` maps onto K3's thinking effort: enabled with
`budget_tokens` up to 4,096 thinks at low, up to 16,384 at high, more at max (K3 takes an effort, not a
budget: `max_tokens` is the only hard cap); adaptive at the server's default (low); `output_config.effort`,
when given, picks the level (low; medium and high: high; xhigh and max: max); disabled or absent: no
thinking, as Anthropic's API. `output_config.format` (a JSON schema) is K3's response-format instruction.
`tool_choice` any is K3's `required`; `{"type": "tool", "name"}` declares only that tool and requires a call.
What K3's format cannot say is refused with a 400 naming it: images and documents, server tools,
`disable_parallel_tool_use`, a final assistant message (prefill).

Usage follows Anthropic's meaning, the three adding up to the prompt: `cache_read_input_tokens` are those
resumed from a kept prefix, `cache_creation_input_tokens` those prefilled and kept for later requests (at message
ends, `cache_control` breakpoints and the prompt's end: coordinator/engine/prefix_index.py), `input_tokens` the
rest. A `cache_control` on a text block is a breakpoint there.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deltafin.coordinator.engine.events import Finished, TokenEvent, Usage
from deltafin.coordinator.http import request as rq
from deltafin.errors import SamplingError
from deltafin.text.chat import SERVING_EFFORT, ChatOptions, Delta, ToolCall
from deltafin.text.sampling_params import SamplingParams

log = logging.getLogger(__name__)

PATH = "/v1/messages"  # and below it: errors there take Anthropic's shape
# budget_tokens -> K3's thinking effort: the smallest level whose limit the budget is within, else max
BUDGET_EFFORTS = ((4096, "low"), (16384, "high"))
OUTPUT_EFFORTS = {"low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}  # output_config
# HTTP status -> Anthropic's error type; a full queue is 529 overloaded_error (the server is busy, not the
# client over a rate limit); the official clients retry it as they retry 429
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 529: "overloaded_error"}
STATUS = {429: 529}
PING = {"type": "ping"}


def is_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_body(err: rq.ApiError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and Anthropic's error body for an API error."""
    status = STATUS.get(err.status, err.status)
    kind = ERROR_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": err.message}}


# ---- reading the request ------------------------------------------------------------------------------------


def _get(obj: dict[str, Any], name: str, kind: type, where: str | None = None, default: Any = None) -> Any:
    """obj[name] checked against a JSON type; absent or null gives the default. `where`: obj's own path."""
    value, path = obj.get(name), f"{where}.{name}" if where else name
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return rq.as_float(value, path)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        got = _TYPE_NAMES.get(float if type(value) is int else type(value), type(value).__name__)
        raise rq.bad(path, f"'{path}' must be {_TYPE_NAMES[kind]}, got {got}")
    return value


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
               list: "an array"}


def parse_messages(body: Any, served: str, strict: bool = False, counting: bool = False) -> rq.GenerationRequest:
    """A Messages request (`counting`: a count_tokens request, which has no max_tokens): the system prompt and the
    turns as OpenAI-style chat messages, stop_sequences as stops, thinking as the effort."""
    if not isinstance(body, dict):
        raise rq.bad(None, "the request body must be a JSON object")
    model = rq.served_model(_get(body, "model", str, default=served), served, strict)  # (left out: the served one)
    max_tokens = _get(body, "max_tokens", int)
    if max_tokens is None and not counting:
        raise rq.bad("max_tokens", "'max_tokens' is required")
    if max_tokens is not None and max_tokens < 1:
        raise rq.bad("max_tokens", f"'max_tokens' must be at least 1, got {max_tokens}")
    _get(body, "metadata", dict)  # {"user_id": ...}: accepted, not used
    effort = _thinking(body)
    tools, tool_choice = _tools(body)
    messages = _system(body) + _turns(body)
    params = rq.Params(model, max_tokens, _sampling(body), _stops(body), _get(body, "stream", bool, default=False),
                       expert_mode=rq.expert_mode_field(body, "expert_mode"))
    options = ChatOptions(thinking=effort is not None, effort=effort, tools=tools, tool_choice=tool_choice,
                          response_format=_response_format(body))
    return rq.GenerationRequest(params, messages, options)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    temperature = _get(body, "temperature", float, default=1.0)
    if not 0.0 <= temperature <= 1.0:
        raise rq.bad("temperature", f"'temperature' must be between 0 and 1, got {temperature}")
    try:
        return SamplingParams(temperature=temperature, top_p=_get(body, "top_p", float, default=1.0),
                              top_k=_get(body, "top_k", int, default=0))
    except SamplingError as e:
        raise rq.bad(e.param, str(e)) from None


def _stops(body: dict[str, Any]) -> list[str]:
    stops = _get(body, "stop_sequences", list, default=[])
    if not all(isinstance(s, str) and 0 < len(s) <= rq.MAX_STOP_CHARS for s in stops) \
            or len(stops) > rq.MAX_STOP_STRINGS:
        raise rq.bad("stop_sequences", f"'stop_sequences' takes up to {rq.MAX_STOP_STRINGS} non-empty strings of up "
                     f"to {rq.MAX_STOP_CHARS} characters")
    return list(stops)


def _thinking(body: dict[str, Any]) -> str | None:
    """K3's thinking effort for the request's `thinking` and `output_config.effort`; None: no thinking."""
    thinking = _get(body, "thinking", dict)
    kind = thinking.get("type") if thinking is not None else "disabled"
    if kind == "disabled":
        return None
    if kind not in ("enabled", "adaptive"):
        raise rq.bad("thinking", "'thinking.type' must be enabled, adaptive or disabled")
    effort = _get(_get(body, "output_config", dict, default={}), "effort", str, "output_config")
    if effort is not None and effort not in OUTPUT_EFFORTS:
        raise rq.bad("output_config", f"'output_config.effort' must be one of {', '.join(OUTPUT_EFFORTS)}")
    if effort is not None:
        return OUTPUT_EFFORTS[effort]
    if kind == "adaptive":
        return SERVING_EFFORT
    budget = _get(thinking, "budget_tokens", int, "thinking")
    if budget is None or budget < 1:
        raise rq.bad("thinking", "'thinking.budget_tokens' must be a positive integer when thinking is enabled")
    return next((level for limit, level in BUDGET_EFFORTS if budget <= limit), "max")


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema) as K3's response-format instruction (not enforced)."""
    fmt = _get(_get(body, "output_config", dict, default={}), "format", dict, "output_config")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise rq.bad("output_config", "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The tools K3 is told of, in OpenAI's shape, and K3's tool_choice (None | "required" | "none")."""
    declared = [_tool(t, f"tools[{i}]") for i, t in enumerate(_get(body, "tools", list, default=[]))]
    choice = _get(body, "tool_choice", dict, default={"type": "auto"})
    kind = choice.get("type")
    if choice.get("disable_parallel_tool_use"):
        raise rq.bad("tool_choice", "'disable_parallel_tool_use' is not supported: Kimi K3's format cannot limit "
                     "a message to one tool call")
    if kind in ("auto", "none"):
        return declared or None, None if kind == "auto" else "none"
    if kind not in ("any", "tool"):
        raise rq.bad("tool_choice", "'tool_choice.type' must be auto, any, tool or none")
    if not declared:
        raise rq.bad("tool_choice", f"tool_choice {kind} needs 'tools'")
    if kind == "any":
        return declared, "required"
    chosen = [t for t in declared if t["function"]["name"] == choice.get("name")]
    if not chosen:
        raise rq.bad("tool_choice", f"tool_choice names {choice.get('name')!r}, which is not among 'tools'")
    return chosen, "required"  # K3 can require a call, not a particular one: it is told of that one only


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise rq.bad(where, f"{where} must be an object")
    if tool.get("type") not in (None, "custom"):
        raise rq.bad(where, f"{where}: server tool {tool['type']!r} is not supported: Kimi K3 calls the tools "
                     "the client runs (name, description, input_schema)")
    name, schema = _get(tool, "name", str, where), _get(tool, "input_schema", dict, where)
    if not name or schema is None:
        raise rq.bad(where, f"{where} needs a 'name' and an 'input_schema'")
    description = _get(tool, "description", str, where)
    function = {"name": name, **({"description": description} if description is not None else {}),
                "parameters": schema}
    return {"type": "function", "function": function}


def _system(body: dict[str, Any]) -> list[dict[str, Any]]:
    system = body.get("system")
    if system is None or (isinstance(system, (str, list)) and not system):
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": [_text(b, f"system[{i}]") for i, b in enumerate(system)]}]
    raise rq.bad("system", "'system' must be a string or an array of text blocks")


def _text(block: Any, where: str) -> dict[str, Any]:
    """A text block as a content part; its `cache_control`, a breakpoint the prefix cache keeps state at."""
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise rq.bad(where, f"{where} must be a text block {{\"type\": \"text\", \"text\": ...}}")
    return {"type": "text", "text": block["text"], **({"cache_control": True} if block.get("cache_control") else {})}


def _blocks(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise rq.bad(f"{where}.content", f"{where}.content must be a string or an array of content blocks")
    return content


def _turns(body: dict[str, Any]) -> list[dict[str, Any]]:
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise rq.bad("messages", "'messages' must be a non-empty array")
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # the tool_use ids of the assistant turn before
    for i, m in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise rq.bad(where, f"{where} must be an object with role user or assistant")
        if m["role"] == "assistant":
            out.append(_assistant(_blocks(m, where), where))
            calls = {c["id"] for c in out[-1].get("tool_calls", [])}
        else:
            out += _user(_blocks(m, where), where, calls)
            calls = set()
    if turns[-1]["role"] == "assistant":
        raise rq.bad("messages", "a final assistant message (a prefill of the reply) is not supported: the last "
                     "message must be the user's")
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type")
        if kind == "text":
            text.append(_text(b, at)["text"])
        elif kind == "thinking":
            reasoning.append(_get(b, "thinking", str, at, default=""))
        elif kind == "tool_use":
            call_id, name, args = _get(b, "id", str, at), _get(b, "name", str, at), _get(b, "input", dict, at, {})
            if not call_id or not name:
                raise rq.bad(at, f"{at}: a tool_use block needs an 'id' and a 'name'")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind != "redacted_thinking":  # only Anthropic can read it
            raise rq.bad(at, f"{at}: unsupported block type {kind!r} in an assistant message (text, thinking, "
                         "redacted_thinking, tool_use)")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], where: str, calls: set[str]) -> list[dict[str, Any]]:
    """A user turn: its text blocks a user message, its tool_result blocks tool messages, in their order."""
    out: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type")
        if kind == "text":
            if not out or out[-1]["role"] != "user":
                out.append({"role": "user", "content": []})
            out[-1]["content"].append(_text(b, at))
        elif kind == "tool_result":
            out.append(_tool_result(b, at, calls))
        elif kind in ("image", "document"):
            raise rq.bad(at, f"{at}: {kind} blocks are not supported: Deltafin serves Kimi K3's text model")
        else:
            raise rq.bad(at, f"{at}: unsupported block type {kind!r} in a user message (text, tool_result)")
    return out


def _tool_result(block: dict[str, Any], at: str, calls: set[str]) -> dict[str, Any]:
    call_id = _get(block, "tool_use_id", str, at)
    if call_id not in calls:
        raise rq.bad(at, f"{at}: tool_use_id {call_id!r} answers no tool_use of the assistant message before it")
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        text = "".join(_text(b, f"{at}.content[{k}]")["text"] for k, b in enumerate(content))
    else:
        raise rq.bad(at, f"{at}.content must be a string or an array of text blocks")
    if _get(block, "is_error", bool, at, default=False):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


# ---- responses ----------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(u: Usage) -> dict[str, int]:
    """Anthropic's usage, adding up to the prompt: cache_read_input_tokens those resumed from a kept prefix,
    cache_creation_input_tokens those prefilled and kept for later requests (up to the last message end,
    breakpoint or grid point it kept), input_tokens the rest."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens - u.cache_created_tokens,
            "output_tokens": u.completion_tokens, "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": u.cache_created_tokens}


def stop_reason(end: Finished, tool_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for how a generation ended."""
    if end.reason == "length":
        return "max_tokens", None
    if isinstance(end.stopped_by, str):
        return "stop_sequence", end.stopped_by
    return ("tool_use" if tool_calls else "end_turn"), None


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A tool call's arguments as the object `input` must be (what is not one is kept under "invalid_json")."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("tool call %s: its arguments are not a JSON object: %.200r", call.name, call.arguments)
        return {"invalid_json": call.arguments}
    return value


@dataclass
class _Block:
    kind: str  # thinking | text | tool_use
    body: dict[str, Any] = field(default_factory=dict)  # the block as the whole message carries it


class MessageFormat:
    """One response: generation events in; the whole message (`whole`), or the stream's events (`head` as it
    opens, then `chunks` of each event). Both come from one list of content blocks, so they agree."""

    def __init__(self, model: str, prompt_tokens: int):
        self.model, self.prompt_tokens = model, prompt_tokens
        self.id = new_id("msg")
        self.blocks: list[_Block] = []
        self.closed = True  # the last block has had its content_block_stop

    def _message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                 usage_: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage_}

    def head(self) -> list[dict[str, Any]]:
        """message_start (before generation: the cache is not known yet; message_delta says it) and a ping."""
        start = self._message([], None, None, usage(Usage(self.prompt_tokens, 0)))
        return [{"type": "message_start", "message": start}, PING]

    def opening(self) -> list[dict[str, Any]]:
        return []  # the head went out as the stream opened

    async def whole(self, events: AsyncIterator[TokenEvent | Finished]) -> dict[str, Any]:
        end = None
        async for e in events:
            self.chunks(e)
            end = e if isinstance(e, Finished) else end
        assert end is not None
        reason, sequence = stop_reason(end, self._tool_calls())
        return self._message([b.body for b in self.blocks], reason, sequence, usage(end.usage))

    def chunks(self, event: TokenEvent | Finished) -> list[dict[str, Any]]:
        out = self._delta(event.delta)
        if isinstance(event, Finished):
            reason, sequence = stop_reason(event, self._tool_calls())
            out += self._close()
            out.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage(event.usage)})
            out.append({"type": "message_stop"})
        return out

    def _tool_calls(self) -> int:
        return sum(b.kind == "tool_use" for b in self.blocks)

    def _delta(self, delta: Delta) -> list[dict[str, Any]]:
        out = self._text("thinking", delta.reasoning) + self._text("text", delta.content)
        for call in delta.tool_calls:
            out += self._close()
            body = {"type": "tool_use", "id": new_id("toolu"), "name": call.name, "input": tool_input(call)}
            out += self._open(_Block("tool_use", body), {**body, "input": {}})
            out.append(self._event_delta({"type": "input_json_delta",
                                          "partial_json": json.dumps(body["input"], ensure_ascii=False)}))
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out = []
        if self.closed or self.blocks[-1].kind != kind:
            out += self._close()
            body = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            out += self._open(_Block(kind, body), dict(body))
        self.blocks[-1].body[kind] += text
        return [*out, self._event_delta({"type": f"{kind}_delta", kind: text})]

    def _open(self, block: _Block, shown: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        self.closed = False
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown}]

    def _event_delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.closed:
            return []
        self.closed = True
        out = [self._event_delta({"type": "signature_delta", "signature": ""})] \
            if self.blocks[-1].kind == "thinking" else []
        return [*out, {"type": "content_block_stop", "index": len(self.blocks) - 1}]


def sse_event(obj: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic's stream writes it: named by the object's type."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
