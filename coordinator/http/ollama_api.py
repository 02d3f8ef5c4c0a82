"""Ollama's API, for the chat front-ends, editor plugins and note apps that speak it: JSON bodies in, the chat
messages, options and sampling the OpenAI path uses out; the engine's events in, Ollama's objects out (one JSON
object a line when streaming, Ollama's default, or one object).

No HTTP here (that is `ollama_routes.py`). Requests: `/api/chat` (messages with `thinking` and `tool_calls`,
tool results as `tool` messages naming `tool_name`), `/api/generate` (a `prompt` with an optional `system`; `raw`:
the prompt as plain text, no chat format), and `model` is optional (one server serves one model). `options`
map onto the sampling: temperature, top_p, top_k, min_p, seed, stop, num_predict (max tokens; -1 and -2: up to
the context), repeat_penalty (repetition_penalty), presence_penalty, frequency_penalty; num_ctx may not exceed
the server's context; the other options (they tune llama.cpp's runtime: num_gpu, num_thread, ...) do nothing
here. `think` sets K3's thinking effort: true (the server's default effort), false (no thinking), "low", "medium"
(K3's high), "high" (K3's max); absent, the server's default (as the OpenAI route). `format`: "json" or a JSON
schema. Images are refused: Deltafin serves K3's text model. Errors are Ollama's `{"error": MESSAGE}`.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deltafin.coordinator.engine.events import Finished, TokenEvent, gathered
from deltafin.coordinator.http import request as rq
from deltafin.errors import SamplingError
from deltafin.text.chat import SERVING_EFFORT, ChatOptions, Delta
from deltafin.text.sampling_params import SamplingParams

PREFIX = "/api/"  # errors under it take Ollama's shape
VERSION = "0.12.0"  # the Ollama API version whose routes and fields this adapter follows
THINK = {True: SERVING_EFFORT, "low": "low", "medium": "high", "high": "max"}
Events = AsyncIterator[TokenEvent | Finished]


def is_ollama_path(path: str) -> bool:
    return path.startswith(PREFIX)


def error_body(err: rq.ApiError) -> tuple[int, dict[str, Any]]:
    """A refusal's HTTP status and Ollama's error body."""
    return err.status, {"error": err.message}


def parse_chat(body: Any, served: str, strict: bool) -> rq.GenerationRequest:
    """An /api/chat request."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise rq.bad("messages", "'messages' must be a non-empty array")
    out = [_message(m, i) for i, m in enumerate(messages)]
    return rq.GenerationRequest(_params(body, served, strict), out, _chat_options(body), context=_num_ctx(body))


def parse_generate(body: Any, served: str, strict: bool) -> rq.GenerationRequest:
    """An /api/generate request: the prompt as a user message (after `system`, if any), or with `raw` as is."""
    body = _object(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise rq.bad("prompt", "'prompt' must be a non-empty string")
    if body.get("images"):
        raise rq.bad("images", "images are not supported: Deltafin serves Kimi K3's text model")
    if body.get("suffix"):
        raise rq.bad("suffix", "'suffix' (fill-in-the-middle) is not supported by Kimi K3")
    params = _params(body, served, strict)
    if rq.json_field(body, "raw", bool, False):
        return rq.GenerationRequest(params, None, prompt=prompt, context=_num_ctx(body))
    system = rq.json_field(body, "system", str, None)
    messages = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": prompt}]
    return rq.GenerationRequest(params, messages, _chat_options(body), context=_num_ctx(body))


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise rq.bad(None, "the request body must be a JSON object")
    return body


def _is_tool(t: Any) -> bool:
    return isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)


def _message(m: Any, i: int) -> dict[str, Any]:
    """An Ollama message as the chat format takes it (OpenAI's shape)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
        raise rq.bad(where, f"{where} must be an object with role system, user, assistant or tool")
    if m.get("images"):
        raise rq.bad(f"{where}.images", "images are not supported: Deltafin serves Kimi K3's text model")
    content = m.get("content", "")
    if not isinstance(content, str):
        raise rq.bad(f"{where}.content", f"{where}.content must be a string")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if m["role"] == "assistant":
        if isinstance(m.get("thinking"), str) and m["thinking"]:
            out["reasoning_content"] = m["thinking"]
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  for c in calls):
            raise rq.bad(f"{where}.tool_calls", f"{where}.tool_calls must be an array of {{\"function\": ...}}")
        if calls:
            out["tool_calls"] = [{"type": "function", "function": {
                "name": c["function"].get("name"), "arguments": c["function"].get("arguments") or {}}} for c in calls]
    if m["role"] == "tool" and isinstance(m.get("tool_name"), str):
        out["name"] = m["tool_name"]
    return out


def _options(body: dict[str, Any]) -> dict[str, Any]:
    return rq.json_field(body, "options", dict, {})


def _num_ctx(body: dict[str, Any]) -> int | None:
    n = _options(body).get("num_ctx")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise rq.bad("options.num_ctx", "'options.num_ctx' must be a positive integer")
    return n


def _params(body: dict[str, Any], served: str, strict: bool) -> rq.Params:
    """The sampling and limits of `options`, checked as the OpenAI route checks its own."""
    model = rq.served_model(rq.json_field(body, "model", str, served), served, strict)
    o = _options(body)
    num_predict = o.get("num_predict")
    if num_predict is not None and (not isinstance(num_predict, int) or isinstance(num_predict, bool)
                                    or num_predict == 0 or num_predict < -2):
        raise rq.bad("options.num_predict", "'options.num_predict' must be a positive integer, -1 or -2")
    stop = o.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if not all(isinstance(s, str) and 0 < len(s) <= rq.MAX_STOP_CHARS for s in stops) \
            or len(stops) > rq.MAX_STOP_STRINGS:
        raise rq.bad("options.stop", f"'options.stop' takes up to {rq.MAX_STOP_STRINGS} non-empty strings of up to "
                     f"{rq.MAX_STOP_CHARS} characters")
    try:
        sampling = SamplingParams(
            temperature=_number(o, "temperature", 0.8), top_p=_number(o, "top_p", 0.9),
            top_k=max(0, int(_number(o, "top_k", 40))), min_p=_number(o, "min_p", 0.0),
            repetition_penalty=_number(o, "repeat_penalty", 1.0),
            presence_penalty=_number(o, "presence_penalty", 0.0),
            frequency_penalty=_number(o, "frequency_penalty", 0.0),
            seed=o["seed"] if isinstance(o.get("seed"), int) and not isinstance(o.get("seed"), bool) else None)
    except SamplingError as e:
        raise rq.bad(f"options.{e.param}" if e.param else "options", str(e)) from None
    stream = rq.json_field(body, "stream", bool, True)
    return rq.Params(model, num_predict if num_predict and num_predict > 0 else None, sampling, stops, stream,
                     expert_mode=rq.expert_mode_field(o, "options.expert_mode"))


def _number(o: dict[str, Any], name: str, default: float) -> float:
    value = o.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise rq.bad(f"options.{name}", f"'options.{name}' must be a number")
    return rq.as_float(value, f"options.{name}")


def _chat_options(body: dict[str, Any]) -> ChatOptions:
    think = body.get("think", True)
    if think is None:
        think = True
    if think is not False and not (isinstance(think, bool | str) and think in THINK):
        raise rq.bad("think", "'think' must be true, false, \"low\", \"medium\" or \"high\"")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(_is_tool(t) for t in tools)):
        raise rq.bad("tools", "'tools' must be an array of {\"type\": \"function\", \"function\": {\"name\": ...}}")
    fmt = body.get("format")
    if fmt in (None, ""):
        response_format = None
    elif fmt == "json":
        response_format = {"type": "json_object"}
    elif isinstance(fmt, dict):
        response_format = {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt}}
    else:
        raise rq.bad("format", "'format' must be \"json\" or a JSON schema object")
    on = think is not False
    return ChatOptions(thinking=on, effort=THINK[think] if on else None, tools=tools or None,
                       response_format=response_format)


# ---- responses ------------------------------------------------------------------------------------------------


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


class OllamaFormat:
    """An /api/chat or /api/generate response: each event's text as a line (`chunks`), or all of it in one
    object (`whole`); the last says done, why, the token counts and the durations (nanoseconds)."""

    def __init__(self, model: str, chat: bool, thinking: bool):
        self.model, self.chat, self.thinking = model, chat, thinking
        self.started = time.monotonic()

    def _body(self, delta: Delta) -> dict[str, Any]:
        if not self.chat:
            return {"response": delta.content, **({"thinking": delta.reasoning} if delta.reasoning else {})}
        message: dict[str, Any] = {"role": "assistant", "content": delta.content}
        if delta.reasoning:
            message["thinking"] = delta.reasoning
        if delta.tool_calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                     for c in delta.tool_calls]
        return {"message": message}

    def _line(self, delta: Delta, end: Finished | None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": now_iso(), **self._body(delta),
                               "done": end is not None}
        if end is not None:
            total = int((time.monotonic() - self.started) * 1e9)
            u, t = end.usage, end.timing
            out.update(done_reason="stop" if end.reason == "stop" else "length", total_duration=total,
                       load_duration=0, prompt_eval_count=u.prompt_tokens - u.cached_tokens,
                       prompt_eval_duration=int(t.prefill_s * 1e9), eval_count=u.completion_tokens,
                       eval_duration=int(t.decode_s * 1e9))
        return out

    def chunks(self, e: TokenEvent | Finished) -> list[dict[str, Any]]:
        end = e if isinstance(e, Finished) else None
        if end is None and not (e.delta.content or e.delta.reasoning or e.delta.tool_calls):
            return []
        return [self._line(e.delta, end)]

    async def whole(self, events: Events) -> dict[str, Any]:
        return self._line(*await gathered(events))


def _arguments(text: str) -> Any:
    """Ollama carries a call's arguments as an object (OpenAI as a JSON string)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---- the model ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What Ollama's model routes say about the served model."""

    name: str
    family: str
    parameters: int
    disk_bytes: int
    digest: str
    context: int
    modified: float


def details(m: ModelFacts) -> dict[str, Any]:
    size = f"{m.parameters / 1e12:.1f}T" if m.parameters >= 1e12 else f"{m.parameters / 1e9:.1f}B" \
        if m.parameters >= 1e9 else f"{m.parameters / 1e6:.1f}M"
    return {"parent_model": "", "format": "safetensors", "family": m.family, "families": [m.family],
            "parameter_size": size, "quantization_level": "MXFP4"}


def tags(m: ModelFacts) -> dict[str, Any]:
    modified = dt.datetime.fromtimestamp(m.modified, dt.timezone.utc).isoformat().replace("+00:00", "Z")
    return {"models": [{"name": m.name, "model": m.name, "modified_at": modified, "size": m.disk_bytes,
                        "digest": m.digest, "details": details(m)}]}


def show(m: ModelFacts) -> dict[str, Any]:
    return {"modelfile": "", "parameters": "", "template": "", "details": details(m),
            "model_info": {"general.architecture": m.family, "general.parameter_count": m.parameters,
                           f"{m.family}.context_length": m.context},
            "capabilities": ["completion", "tools", "thinking"]}


def ps(m: ModelFacts) -> dict[str, Any]:
    return {"models": [{"name": m.name, "model": m.name, "size": m.disk_bytes, "digest": m.digest,
                        "details": details(m), "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                        "context_length": m.context}]}
