"""OpenAI's adapter: JSON bodies in, typed requests out (`parse_completion`, `parse_chat`); the engine's
events in, OpenAI's responses out (`CompletionFormat`, `ChatFormat`: the whole response, or its stream's
chunks, usage, logprobs and tool calls).

No HTTP here (that is `server.py`). Every problem with a request is an `ApiError` carrying the HTTP status
and OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`), naming the parameter.

Supported beyond OpenAI's core fields, as vLLM and llama.cpp's server spell them: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, and for chat `chat_template_kwargs` {"thinking": bool,
"thinking_effort": "low"|"high"|"max"}; Deltafin's own `speculative` ("ngram" | "none", the server's
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

from deltafin.coordinator.engine.token_loop import Finished, TokenEvent, Usage, gathered
from deltafin.errors import SamplingError
from deltafin.text.chat import EFFORTS, SERVING_EFFORT, ChatOptions, Delta, ToolCall
from deltafin.text.drafting import MODES
from deltafin.text.sampling import Choice, SamplingParams
from deltafin.text.tokenizer import K3Tokenizer

COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's API
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # a stop string's length (matching is linear in it; no client needs more)
MAX_TOP_LOGPROBS = 20
Events = AsyncIterator[TokenEvent | Finished]


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- reading fields ------------------------------------------------------------------------------------

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
               list: "an array"}


def as_float(value: int | float, name: str) -> float:
    """A JSON number as a float; one too large (hundreds of digits) is a 400 naming `name`."""
    try:
        return float(value)
    except OverflowError:
        raise bad(name, f"'{name}' is out of range") from None


def _json_type(value: Any) -> str:
    for kind, name in [(bool, "a boolean"), *_TYPE_NAMES.items()]:
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def json_field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """body[name] checked against a JSON type; absent or null gives the default."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return as_float(value, name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise bad(name, f"'{name}' must be {_TYPE_NAMES[kind]}, got {_json_type(value)}")
    return value


@dataclass(frozen=True)
class Params:
    """What chat and text completions share."""

    model: str
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    speculative: str | None = None  # none | ngram for this request; None: the server's --speculative


def served_model(requested: str, served: str, strict: bool) -> str:
    """The name a response carries: the served one, whatever name the request used (clients configured with
    their own model names work), unless `strict` (`--strict-model-name`): then another name is a 404."""
    if strict and requested != served:
        raise ApiError(404, f"The model '{requested}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")
    return served


def request_params(body: dict[str, Any], served: str, strict: bool) -> Params:
    """A body's model, limits, sampling and streaming in OpenAI's names (what the Responses API shares)."""
    return _params(body, served, None, strict)


def _params(body: dict[str, Any], served: str, logprobs: int | None, strict: bool) -> Params:
    model = served_model(json_field(body, "model", str, served), served, strict)  # (left out: the served one)
    n = json_field(body, "n", int, 1)
    if n != 1:
        raise bad("n", "only n=1 is supported: Deltafin generates one choice per request")
    if json_field(body, "best_of", int, 1) != 1:
        raise bad("best_of", "only best_of=1 is supported")
    max_tokens = json_field(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = json_field(body, "max_tokens", int, None)
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad(param, f"'{param}' must be at least 1, got {max_tokens}")
    stream = json_field(body, "stream", bool, False)
    options = json_field(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    include_usage = bool(options and json_field(options, "include_usage", bool, False))
    speculative = json_field(body, "speculative", str, None)
    if speculative is not None and speculative not in MODES:
        raise bad("speculative", f"'speculative' must be one of {', '.join(MODES)}, got {speculative!r}")
    return Params(model, max_tokens, _sampling(body, logprobs), _stops(body), stream, include_usage,
                  json_field(body, "ignore_eos", bool, False), speculative)


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("stop", "'stop' must be a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"'stop' takes up to {MAX_STOP_STRINGS} non-empty strings of up to {MAX_STOP_CHARS} "
                  "characters")
    return stops


def _sampling(body: dict[str, Any], logprobs: int | None) -> SamplingParams:
    bias_in = json_field(body, "logit_bias", dict, {})
    try:
        bias = tuple((int(k), float(v)) for k, v in bias_in.items())
    except (TypeError, ValueError, OverflowError):
        raise bad("logit_bias", "'logit_bias' maps token ids (strings of integers) to numbers") from None
    try:
        return SamplingParams(
            temperature=json_field(body, "temperature", float, 1.0), top_p=json_field(body, "top_p", float, 1.0),
            top_k=max(0, json_field(body, "top_k", int, 0)),  # vLLM spells "off" as -1
            min_p=json_field(body, "min_p", float, 0.0),
            repetition_penalty=json_field(body, "repetition_penalty", float, 1.0),
            presence_penalty=json_field(body, "presence_penalty", float, 0.0),
            frequency_penalty=json_field(body, "frequency_penalty", float, 0.0),
            seed=json_field(body, "seed", int, None), logprobs=logprobs, logit_bias=bias)
    except SamplingError as e:
        raise bad(e.param, str(e)) from None


def _check_bias(params: Params, vocab_size: int) -> None:
    for token, _ in params.sampling.logit_bias:
        if token >= vocab_size:
            raise bad("logit_bias", f"logit_bias token {token} is outside the vocabulary (0..{vocab_size - 1})")


# ---- text completions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionRequest:
    params: Params
    prompt_ids: list[int]
    prompt_text: str
    echo: bool = False


def parse_completion(body: Any, served: str, tokenizer: K3Tokenizer, strict: bool = False) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    logprobs = json_field(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad("logprobs", f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")
    params = _params(body, served, logprobs, strict)
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
    return CompletionRequest(params, ids, text, echo)


# ---- chat completions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    params: Params
    messages: list[dict[str, Any]]
    options: ChatOptions
    top_logprobs: int | None  # None: no logprobs


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any, served: str, tokenizer: K3Tokenizer, strict: bool = False) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    want_logprobs = json_field(body, "logprobs", bool, False)
    top = json_field(body, "top_logprobs", int, None)
    if top is not None and not want_logprobs:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")
    n_top = (top or 0) if want_logprobs else None
    params = _params(body, served, n_top, strict)
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
    return ChatRequest(params, out, _chat_options(body), n_top)


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

    def __init__(self, tokenizer: K3Tokenizer, req: CompletionRequest):
        self.tokenizer, self.p = tokenizer, req.params
        self.id, self.created = new_id("cmpl"), now()
        self.logprobs = self.p.sampling.logprobs is not None
        self.prefix = req.prompt_text if req.echo else ""
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

    def __init__(self, tokenizer: K3Tokenizer, req: ChatRequest):
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
