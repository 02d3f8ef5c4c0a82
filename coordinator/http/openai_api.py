"""OpenAI's adapter: JSON bodies in, the one generation request out (`parse_completion`, `parse_chat`:
request.py's GenerationRequest); the engine's events in, OpenAI's responses out (`CompletionFormat`, `ChatFormat`:
the whole response, or its stream's chunks, usage, logprobs and tool calls); a refusal in OpenAI's error shape
(`error_body`: `{"error": {"message", "type", "param", "code"}}`, naming the parameter).

No HTTP here (that is `server.py`).

Supported beyond OpenAI's core fields, as vLLM and llama.cpp's server spell them: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, and for chat `chat_template_kwargs` {"thinking": bool,
"thinking_effort": "low"|"high"|"max"}; Deltafin's own `speculative` ("draft" | "ngram" | "none", the server's
`--speculative` when absent); `reasoning_effort` is OpenAI's name for the effort ("none" turns
thinking off); a request that names neither thinks at `SERVING_EFFORT` (low).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deltafin.coordinator.engine.events import Finished, TokenEvent, Usage, gathered
from deltafin.coordinator.http.request import ApiError, GenerationRequest, Params, bad, common_params, json_field
from deltafin.text.chat import EFFORTS, SERVING_EFFORT, ChatOptions, Delta, ToolCall
from deltafin.text.sampling import Choice
from deltafin.text.tokenizer import K3Tokenizer

COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's API
MAX_TOP_LOGPROBS = 20
Events = AsyncIterator[TokenEvent | Finished]


def error_body(err: ApiError) -> tuple[int, dict[str, Any]]:
    """A refusal's HTTP status and OpenAI's error body (also what a path of no other API answers)."""
    return err.status, {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def _check_bias(params: Params, vocab_size: int) -> None:
    for token, _ in params.sampling.logit_bias:
        if token >= vocab_size:
            raise bad("logit_bias", f"logit_bias token {token} is outside the vocabulary (0..{vocab_size - 1})")


# ---- text completions ------------------------------------------------------------------------------------


def parse_completion(body: Any, served: str, tokenizer: K3Tokenizer, strict: bool = False) -> GenerationRequest:
    """A text completion: a raw prompt (`prompt_ids`, `prompt`), echoed before the text with `echo`."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    logprobs = json_field(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad("logprobs", f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")
    params = common_params(body, served, strict, logprobs)
    if params.max_tokens is None:  # OpenAI's default for text completions; chat's is the server's (engine.py)
        params = dataclasses.replace(params, max_tokens=COMPLETION_MAX_TOKENS)
    _check_bias(params, tokenizer.vocab_size)
    if body.get("suffix"):
        raise bad("suffix", "'suffix' (fill-in-the-middle) is not supported by Kimi K3")
    echo = json_field(body, "echo", bool, False)
    if echo and logprobs is not None:
        raise bad("echo", "'echo' together with 'logprobs' (prompt logprobs) is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise bad("prompt", f"prompt token ids must be in 0..{tokenizer.vocab_size - 1}")
        ids, text = list(prompt), tokenizer.decode(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "only one prompt per request is supported (got a batch)")
    else:
        raise bad("prompt", "'prompt' must be a non-empty string or a non-empty array of token ids")
    if not ids:
        raise bad("prompt", "the prompt is empty")
    return GenerationRequest(params, None, prompt=text, prompt_ids=ids, echo=echo)


# ---- chat completions ------------------------------------------------------------------------------------


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any, served: str, tokenizer: K3Tokenizer, strict: bool = False) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    want_logprobs = json_field(body, "logprobs", bool, False)
    top = json_field(body, "top_logprobs", int, None)
    if top is not None and not want_logprobs:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")
    n_top = (top or 0) if want_logprobs else None
    params = common_params(body, served, strict, n_top)
    _check_bias(params, tokenizer.vocab_size)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a role among {', '.join(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad(f"messages[{i}].content", "message content must be a string, an array of parts or null")
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        out.append(m)
    return GenerationRequest(params, out, _chat_options(body), top_logprobs=n_top)


def _is_tool(t: Any) -> bool:
    return isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)


def _chat_options(body: dict[str, Any]) -> ChatOptions:
    kwargs = json_field(body, "chat_template_kwargs", dict, {})
    thinking = kwargs.get("thinking", True)
    if not isinstance(thinking, bool):
        raise bad("chat_template_kwargs", "chat_template_kwargs.thinking must be true or false")
    effort = kwargs.get("thinking_effort", SERVING_EFFORT)
    reasoning = json_field(body, "reasoning_effort", str, None)
    if reasoning is not None:
        if reasoning == "none":
            thinking = False
        else:
            effort = reasoning
    if thinking and effort not in EFFORTS:
        raise bad("reasoning_effort", f"unsupported reasoning effort {effort!r}: Kimi K3 supports low, high and max "
                  "(or none to answer without thinking)")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(_is_tool(t) for t in tools)):
        raise bad("tools", "'tools' must be an array of {\"type\": \"function\", \"function\": {\"name\": ...}}")
    choice = body.get("tool_choice")
    tool_choice = None
    if choice in (None, "auto"):
        pass
    elif choice in ("none", "required"):
        tool_choice = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        tool_choice = "required"  # K3's format can require a call, not a particular one
    else:
        raise bad("tool_choice", "'tool_choice' must be auto, none, required or {\"type\": \"function\", ...}")
    if tool_choice == "required" and not tools:
        raise bad("tool_choice", "'tool_choice' requires 'tools'")
    fmt = json_field(body, "response_format", dict, None)
    if fmt is not None and fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("response_format", "'response_format.type' must be text, json_object or json_schema")
    return ChatOptions(thinking=thinking, effort=effort if thinking else None, tools=tools or None,
                       tool_choice=tool_choice, response_format=fmt if fmt and fmt.get("type") != "text" else None)


# ---- responses --------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(u: Usage) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens resumed from a kept prefix (not prefilled)."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def model_card(name: str, created: float, context: int) -> dict[str, Any]:
    """OpenAI's model object, with the deployment's context length (--max-context) as other servers add it."""
    return {"id": name, "object": "model", "created": int(created), "owned_by": "deltafin",
            "context_length": context, "max_model_len": context}


def _token(tokenizer: K3Tokenizer, token_id: int) -> tuple[str, list[int]]:
    data = tokenizer.token_bytes(token_id)
    return data.decode("utf-8", errors="replace"), list(data)


def chat_logprob(tokenizer: K3Tokenizer, choice: Choice) -> dict[str, Any]:
    text, data = _token(tokenizer, choice.token_id)
    top = []
    for tid, lp in choice.top:
        t, b = _token(tokenizer, tid)
        top.append({"token": t, "logprob": lp, "bytes": b})
    return {"token": text, "logprob": choice.logprob, "bytes": data, "top_logprobs": top}


@dataclass
class CompletionLogprobs:
    """The legacy completions shape: parallel lists plus character offsets into the text."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, tokenizer: K3Tokenizer, choice: Choice, offset: int) -> None:
        self.tokens.append(_token(tokenizer, choice.token_id)[0])
        self.token_logprobs.append(choice.logprob)
        self.top_logprobs.append({_token(tokenizer, t)[0]: lp for t, lp in choice.top})
        self.text_offset.append(offset)

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def tool_call_json(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_delta(delta: Delta, ids: list[str], first_index: int) -> dict[str, Any]:
    """A streamed chat delta; tool calls carry their index in the choice's list of calls."""
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [{"index": first_index + i, **tool_call_json(c, ids[i])}
                             for i, c in enumerate(delta.tool_calls)]
    return out


def chunk(kind: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
          usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model,
                            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def now() -> int:
    return int(time.time())


class CompletionFormat:
    """/v1/completions' response: text (after the prompt with `echo`), logprobs at text offsets, usage."""

    def __init__(self, tokenizer: K3Tokenizer, req: GenerationRequest):
        self.tokenizer, self.p = tokenizer, req.params
        self.id, self.created = new_id("cmpl"), now()
        self.logprobs = self.p.sampling.logprobs is not None
        self.prefix = req.prompt if req.echo else ""
        self.offset = len(self.prefix)

    def _chunk(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        return chunk("text_completion", self.id, self.created, self.p.model, choices, usage_)

    @staticmethod
    def _choice(text: str, logprobs: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(self, e: TokenEvent, into: CompletionLogprobs) -> bool:
        if self.logprobs and not e.stop:
            into.add(self.tokenizer, e.choice, self.offset)
            return True
        return False

    async def whole(self, events: Events) -> dict[str, Any]:
        text, lp, end = [self.prefix], CompletionLogprobs(), None
        async for e in events:
            text.append(e.delta.content)
            if isinstance(e, Finished):
                end = e
            else:
                self._logprobs(e, lp)
                self.offset += len(e.delta.content)
        assert end is not None
        return self._chunk([self._choice("".join(text), lp.as_dict() if self.logprobs else None, end.reason)],
                           usage(end.usage))

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk([self._choice(self.prefix, None, None)])] if self.prefix else []

    def chunks(self, e: TokenEvent | Finished) -> list[dict[str, Any]]:
        if isinstance(e, Finished):
            out = [self._chunk([self._choice(e.delta.content, None, e.reason)])]
            return out + ([self._chunk([], usage(e.usage))] if self.p.include_usage else [])
        one = CompletionLogprobs()
        lp = one.as_dict() if self._logprobs(e, one) else None
        self.offset += len(e.delta.content)
        return [self._chunk([self._choice(e.delta.content, lp, None)])] if e.delta.content or lp is not None else []


class ChatFormat:
    """/v1/chat/completions' response: reasoning_content, content, tool calls (finish_reason tool_calls),
    logprobs per token, usage."""

    def __init__(self, tokenizer: K3Tokenizer, req: GenerationRequest):
        self.tokenizer, self.p, self.thinking = tokenizer, req.params, req.options.thinking
        self.id, self.created = new_id("chatcmpl"), now()
        self.logprobs = req.top_logprobs is not None
        self.call_ids: list[str] = []

    def _chunk(self, kind: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        return chunk(kind, self.id, self.created, self.p.model, choices, usage_)

    def _reason(self, e: Finished) -> str:
        return "tool_calls" if self.call_ids and e.reason == "stop" else e.reason

    def _logprob(self, e: TokenEvent | Finished) -> dict[str, Any] | None:
        if isinstance(e, TokenEvent) and self.logprobs and not e.stop:
            return chat_logprob(self.tokenizer, e.choice)
        return None

    async def whole(self, events: Events) -> dict[str, Any]:
        lps: list[dict[str, Any]] = []

        def keep_logprob(e: TokenEvent | Finished) -> None:
            if (lp := self._logprob(e)) is not None:
                lps.append(lp)

        reply, end = await gathered(events, keep_logprob)
        calls = []
        for c in reply.tool_calls:
            self.call_ids.append(new_id("call"))
            calls.append(tool_call_json(c, self.call_ids[-1]))
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if calls else "")}
        if self.thinking:
            message["reasoning_content"] = reply.reasoning
        if calls:
            message["tool_calls"] = calls
        return self._chunk("chat.completion", [{"index": 0, "message": message, "logprobs": {"content": lps} if
                                                self.logprobs else None, "finish_reason": self._reason(end)}],
                           usage(end.usage))

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk("chat.completion.chunk", [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}])]

    def chunks(self, e: TokenEvent | Finished) -> list[dict[str, Any]]:
        first = len(self.call_ids)
        self.call_ids.extend(new_id("call") for _ in e.delta.tool_calls)
        delta = chat_delta(e.delta, self.call_ids[first:], first)
        kind = "chat.completion.chunk"
        if isinstance(e, Finished):
            end = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": self._reason(e)}
            out = [self._chunk(kind, [end])]
            return out + ([self._chunk(kind, [], usage(e.usage))] if self.p.include_usage else [])
        lp = self._logprob(e)
        if not delta and lp is None:
            return []
        return [self._chunk(kind, [{"index": 0, "delta": delta, "logprobs": {"content": [lp]} if lp is not None
                                    else None, "finish_reason": None}])]
