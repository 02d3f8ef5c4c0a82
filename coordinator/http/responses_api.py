"""OpenAI's Responses API (`POST /v1/responses`), for the coding agents that speak it: JSON bodies in, the chat
messages and options the chat completions path renders out; the engine's events in, a Response object or its
stream of typed events out (reasoning items, the message's output text, function calls).

No HTTP here (that is `server.py`). `input` is a string (one user message) or a list of items: messages (role
user, system, developer or assistant; text or input_text/output_text parts), `function_call` items (an earlier
reply's calls) and `function_call_output` items (their results), `reasoning` items (an earlier reply's
thinking, kept with the assistant turn after it); `instructions` is a system message first. `tools` are
function tools (`{"type": "function", "name", "description", "parameters"}`), `tool_choice` auto, none, required
or one function (K3 can require a call, not a particular one: it is told of that tool only). `reasoning.effort`
maps onto K3's thinking: none turns it off, minimal and low think at low, medium at high, high and xhigh at max;
absent, the server's default (as the chat route). `text.format` is text, json_object or json_schema. A reply's
thinking comes back as a `reasoning` item with `reasoning_text` content (K3's is its own, not a summary).
Responses are not stored (`store` is false): `previous_response_id` is refused; send the conversation.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from deltafin.coordinator.engine.events import Finished, TokenEvent, gathered
from deltafin.coordinator.http import request as rq
from deltafin.text.chat import SERVING_EFFORT, ChatOptions, Delta, ToolCall

PATH = "/v1/responses"
EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "max", "xhigh": "max"}
Events = AsyncIterator[TokenEvent | Finished]


def parse_responses(body: Any, served: str, strict: bool = False) -> tuple[rq.GenerationRequest, dict[str, Any]]:
    """The request, and its settings as the Response object repeats them."""
    if not isinstance(body, dict):
        raise rq.bad(None, "the request body must be a JSON object")
    if body.get("previous_response_id"):
        raise rq.bad("previous_response_id", "'previous_response_id' is not supported: responses are not stored "
                     "(store is false); send the whole conversation in 'input'")
    max_tokens = rq.json_field(body, "max_output_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise rq.bad("max_output_tokens", "'max_output_tokens' must be at least 1")
    chat_like = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "top_k", "min_p", "seed")
                 if k in body}
    params = rq.common_params({**chat_like, "max_tokens": max_tokens}, served, strict)
    messages = _messages(body)
    options = _options(body)
    settings = {"instructions": body.get("instructions"), "max_output_tokens": max_tokens,
                "temperature": params.sampling.temperature, "top_p": params.sampling.top_p,
                "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
                "reasoning": {"effort": options.effort if options.thinking else "none", "summary": None},
                "text": body.get("text") or {"format": {"type": "text"}}}
    return rq.GenerationRequest(params, messages, options), settings


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text",
                                                                                  "text") for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise rq.bad(where, f"{where} must be a string or an array of input_text/output_text parts (images and files "
                 "are not supported: Deltafin serves Kimi K3's text model)")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages in OpenAI's chat shape."""
    out: list[dict[str, Any]] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str) and items:
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise rq.bad("input", "'input' must be a non-empty string or array of items")
    reasoning = ""  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text(item.get("content", ""), f"{where}.content")})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        elif kind == "function_call":
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = reasoning, ""
            out[-1].setdefault("tool_calls", []).append({"id": str(item.get("call_id", "")), "type": "function",
                                                         "function": {"name": item.get("name"),
                                                                      "arguments": item.get("arguments", "{}")}})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _text(item.get("output", ""), f"{where}.output")})
        else:
            raise rq.bad(where, f"{where}: unsupported item (messages, reasoning, function_call and "
                         "function_call_output are)")
    return out


def _options(body: dict[str, Any]) -> ChatOptions:
    reasoning = rq.json_field(body, "reasoning", dict, {})
    effort = reasoning.get("effort")
    if effort is not None and effort != "none" and effort not in EFFORTS:
        raise rq.bad("reasoning.effort", f"unsupported reasoning effort {effort!r}: none, minimal, low, medium, "
                     "high or xhigh")
    thinking = effort != "none"
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) for t in tools)):
        raise rq.bad("tools", "'tools' must be function tools: {\"type\": \"function\", \"name\": ..., "
                     "\"parameters\": ...} (built-in tools are OpenAI's own)")
    declared = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                for t in tools or []]
    choice, tool_choice = body.get("tool_choice"), None
    if isinstance(choice, dict) and choice.get("type") == "function":
        declared = [t for t in declared if t["function"]["name"] == choice.get("name")]
        if not declared:
            raise rq.bad("tool_choice", f"tool_choice names {choice.get('name')!r}, which is not among 'tools'")
        tool_choice = "required"
    elif choice in ("none", "required"):
        tool_choice = choice
    elif choice not in (None, "auto"):
        raise rq.bad("tool_choice", "'tool_choice' must be auto, none, required or {\"type\": \"function\", ...}")
    fmt = (rq.json_field(body, "text", dict, {}) or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                                  "schema": fmt.get("schema", {})}}
    elif fmt.get("type") == "json_object":
        response_format = {"type": "json_object"}
    elif fmt.get("type") == "text":
        response_format = None
    else:
        raise rq.bad("text.format", "'text.format.type' must be text, json_object or json_schema")
    return ChatOptions(thinking=thinking, effort=EFFORTS.get(effort, SERVING_EFFORT) if thinking else None,
                       tools=declared or None, tool_choice=tool_choice, response_format=response_format)


# ---- responses ------------------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat:
    """The Response object (`whole`), or its stream of events (`opening`, `chunks`): a reasoning item while K3
    thinks, a message item with its output text, a function_call item per tool call, then response.completed
    (or response.incomplete at max_output_tokens)."""

    def __init__(self, req: rq.GenerationRequest, settings: dict[str, Any]):
        self.req, self.settings, self.id, self.created = req, settings, _id("resp"), int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output so far; the last may be open (streaming)
        self.open: str | None = None  # the open item's kind: reasoning | message
        self.reasoning_tokens = 0

    def response(self, status: str, end: Finished | None = None) -> dict[str, Any]:
        incomplete = end is not None and end.reason == "length"
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.req.params.model,
            "status": "incomplete" if incomplete else status, "output": self.items, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "parallel_tool_calls": True, "store": False, "usage": None, **self.settings}
        if end is not None:
            u = end.usage
            out["usage"] = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                            "output_tokens": u.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                            "total_tokens": u.total_tokens}
        return out

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    async def whole(self, events: Events) -> dict[str, Any]:
        reply, end = await gathered(events, self._count_reasoning)
        if reply.reasoning:
            self.items.append(_reasoning_item(_id("rs"), reply.reasoning))
        if reply.content or not reply.tool_calls:
            self.items.append(_message_item(_id("msg"), reply.content, "completed"))
        self.items += [_call_item(c) for c in reply.tool_calls]
        return self.response("completed", end)

    def _count_reasoning(self, e: TokenEvent | Finished) -> None:
        self.reasoning_tokens += isinstance(e, TokenEvent) and bool(e.delta.reasoning)

    def opening(self) -> list[dict[str, Any]]:
        head = self.response("in_progress")
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def chunks(self, e: TokenEvent | Finished) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        d: Delta = e.delta
        self._count_reasoning(e)
        if d.reasoning:
            out += self._into("reasoning") + [self._event(
                "response.reasoning_text.delta", item_id=self.items[-1]["id"], output_index=len(self.items) - 1,
                content_index=0, delta=d.reasoning)]
            self.items[-1]["content"][0]["text"] += d.reasoning
        if d.content:
            out += self._into("message") + [self._event(
                "response.output_text.delta", item_id=self.items[-1]["id"], output_index=len(self.items) - 1,
                content_index=0, delta=d.content, logprobs=[])]
            self.items[-1]["content"][0]["text"] += d.content
        for call in d.tool_calls:
            out += self._close()
            item = _call_item(call)
            self.items.append(item)
            i = len(self.items) - 1
            out += [self._event("response.output_item.added", output_index=i, item={**item, "arguments": ""}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                delta=call.arguments),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                arguments=call.arguments),
                    self._event("response.output_item.done", output_index=i, item=item)]
        if isinstance(e, Finished):
            out += self._close()
            done = self.response("completed", e)
            out.append(self._event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                                   response=done))
        return out

    def _into(self, kind: str) -> list[dict[str, Any]]:
        """Open an item of `kind` (closing the one open before) unless it is the one open."""
        if self.open == kind:
            return []
        out = self._close()
        item_id = _id("rs" if kind == "reasoning" else "msg")
        item = _reasoning_item(item_id, "") if kind == "reasoning" else _message_item(item_id, "", "in_progress")
        self.items.append(item)
        self.open = kind
        i = len(self.items) - 1
        shown = {**item, "content": []}
        out.append(self._event("response.output_item.added", output_index=i, item=shown))
        if kind == "message":
            out.append(self._event("response.content_part.added", item_id=item_id, output_index=i, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        item, i = self.items[-1], len(self.items) - 1
        text = item["content"][0]["text"]
        if self.open == "reasoning":
            out = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=text)]
        else:
            item["status"] = "completed"
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=text, logprobs=[]),
                   self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=item["content"][0])]
        self.open = None
        return out + [self._event("response.output_item.done", output_index=i, item=item)]


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def sse_event(obj: dict[str, Any]) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
