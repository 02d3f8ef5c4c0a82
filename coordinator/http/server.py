"""The HTTP transport on aiohttp (asyncio, like grpc.aio: one event loop serves both): the app and its routes,
body parsing, SSE framing and heartbeats, error mapping, API keys, the web chat's files, /v1/status and
/metrics. Each API's wire format is its adapter's: openai_api.py (OpenAI's chat and text completions),
anthropic_api.py (Anthropic's Messages), ollama_api.py and responses_api.py turn a JSON body into the one
GenerationRequest (request.py) and the engine's events into the API's response or stream events, and shape its
refusals (ERROR_SHAPES); this module starts the generation and sends what the adapter shapes.

    POST /v1/chat/completions   OpenAI's chat, with reasoning_content, tool calls, SSE streaming, logprobs
    POST /v1/completions        OpenAI's text completion of a prompt (text or token ids)
    POST /v1/messages           Anthropic's Messages API: thinking, text and tool_use blocks, its SSE events
    POST /v1/messages/count_tokens  the prompt tokens a Messages request would build
    POST /v1/responses          OpenAI's Responses API: reasoning items, output text, function calls (responses_api.py)
    /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version: Ollama's API (ollama_routes.py)
    GET  /v1/models             the served model
    GET  /health                200 when every worker answers, else 503
    GET  /metrics               Prometheus text: requests, tokens, tok/s, queue, per-worker I/O and hit rate
    GET  /v1/status             JSON for the web chat's cluster panel: counters, prefills, each worker (status.py)
    GET  /                      the web chat (coordinator/http/web/: one page, one script, one stylesheet; no auth,
                                it holds no secrets: its API calls send the key the user types)

Errors are OpenAI-style JSON bodies with the HTTP status (400 bad request, 404 unknown model or path,
413 body too large, 429 queue full, 500/503 a worker failed); under /v1/messages they take Anthropic's shape
(anthropic_api.py: a full queue is 529 overloaded_error), under /api/ Ollama's `{"error"}`. A client that
disconnects cancels its generation, which frees its sessions on every worker. A stream whose first token takes
longer than HEARTBEAT_S (a queue, a long prefill: minutes at K3's size) opens anyway and says how far it is in an SSE
comment every HEARTBEAT_S, so that read timeouts and proxies see bytes; a failure after that is an error
event in the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, Protocol

from aiohttp import web

from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.events import Finished, PrefillProgress, TokenEvent
from deltafin.coordinator.engine.token_loop import PlainText, TextView
from deltafin.coordinator.http import anthropic_api as am
from deltafin.coordinator.http import ollama_api as ol
from deltafin.coordinator.http import ollama_routes
from deltafin.coordinator.http import openai_api as oa
from deltafin.coordinator.http import request as rq
from deltafin.coordinator.http import responses_api as rs
from deltafin.coordinator.http.handling import (
    ENGINE,
    MAX_BODY,
    REQUESTS,
    Events,
    as_api_error,
    chat_prompt,
    first_event,
    read_json,
    rest_of,
)
from deltafin.coordinator.http.metrics import render
from deltafin.coordinator.http.status import status as status_json
from deltafin.runtime.worker_stats import StageStats
from deltafin.text.chat import OutputParser

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0



# Each API's refusals in its own shape, by the paths it owns; any other path OpenAI's.
ERROR_SHAPES = ((am.is_messages_path, am.error_body), (ol.is_ollama_path, ol.error_body))


def error_response(err: rq.ApiError, path: str) -> web.Response:
    """The refusal in the shape of the API the path belongs to (ERROR_SHAPES, else OpenAI's)."""
    shape = next((body for owns, body in ERROR_SHAPES if owns(path)), oa.error_body)
    status, body = shape(err)
    return web.json_response(body, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        response = error_response(rq.ApiError(e.status, e.reason if e.status != 413 else
                                               f"the request body is larger than {request.app[MAX_BODY]} bytes",
                                               type=kind), request.path)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    except Exception as e:
        response = error_response(as_api_error(e), request.path)
        status = response.status
        return response
    finally:
        resource = request.match_info.route.resource
        key = (resource.canonical if resource is not None else "other", status)
        counts = request.app[REQUESTS]
        counts[key] = counts.get(key, 0) + 1


class _Sse:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.started = False

    async def start(self) -> None:
        self.started = True
        await self.response.prepare(self.request)

    async def comment(self, text: str) -> None:
        await self.response.write(b": " + text.encode() + b"\n\n")

    async def send(self, obj: dict[str, Any]) -> None:
        await self.response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    async def error(self, err: rq.ApiError) -> None:
        await self.send(oa.error_body(err)[1])

    async def finish(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


class _Prefill:
    """A request's prefill progress, as its progress callback hears it."""

    def __init__(self) -> None:
        self.progress: PrefillProgress | None = None
        self.started = 0.0

    def __call__(self, p: PrefillProgress) -> None:
        if self.progress is None:
            self.started = time.monotonic()
        self.progress = p

    def say(self) -> str:
        p = self.progress
        if p is None:
            return "waiting for a slot"
        text = f"prefill {int(p.tokens_done)}/{p.tokens_total} tokens"
        elapsed = time.monotonic() - self.started
        if p.bytes_done > 0 and elapsed > 0:
            left = (p.bytes_total - p.bytes_done) / (p.bytes_done / elapsed)
            text += f", {_gb(p.bytes_done)} of {_gb(p.bytes_total)} read, about {left:.0f} s left"
        return text


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


async def _first_streamed(sse: _Sse, events: Events, prompt_param: str, prefill: _Prefill
                          ) -> TokenEvent | Finished | None:
    """A stream's first event. Until it comes, every HEARTBEAT_S the stream opens (if it has not) and a
    comment says how far the request is (clients skip comments). Errors before the stream opened are
    statuses, as `_first` makes them; after, an error event ends the stream and None is returned."""
    first = asyncio.ensure_future(first_event(events, prompt_param))
    try:
        while not (await asyncio.wait({first}, timeout=HEARTBEAT_S))[0]:
            if not sse.started:
                await sse.start()
            await sse.comment(prefill.say())
    except BaseException:
        first.cancel()
        with contextlib.suppress(BaseException):
            await first
        raise
    try:
        return first.result()
    except Exception as e:
        if not sse.started or isinstance(e, ConnectionResetError):
            raise
        await sse.error(as_api_error(e))
        await sse.finish()
        return None


async def _run(request: web.Request, prompt_ids: list[int], view: TextView, p: rq.Params,
               prompt_param: str, sse: _Sse | None = None, boundaries: list[int] | None = None
               ) -> tuple[Events | None, _Sse]:
    """Start one request's generation. Errors before its first event are HTTP statuses; a stream may open
    before that (heartbeats), and then an error ends it as an event: None instead of the events. `sse`: the
    stream to answer on (default OpenAI's); `boundaries`: where the prompt's messages end (kept prefixes)."""
    engine = request.app[ENGINE]
    rq.check_expert_mode(p, engine.expert_mode, "expert_mode")
    prefill = _Prefill()
    events = engine.run(prompt_ids, view, p.generation, progress=prefill, boundaries=boundaries or ())
    sse = sse or _Sse(request)
    first = await (_first_streamed(sse, events, prompt_param, prefill) if p.stream
                   else first_event(events, prompt_param))
    return (None if first is None else rest_of(first, events)), sse


class _Format(Protocol):
    """A response's JSON, as an adapter shapes it (oa.CompletionFormat, oa.ChatFormat, am.MessageFormat): whole
    (`whole`), or streamed (`opening`, then `chunks` of each event)."""

    async def whole(self, events: Events) -> dict[str, Any]: ...

    def opening(self) -> list[dict[str, Any]]: ...

    def chunks(self, event: TokenEvent | Finished) -> list[dict[str, Any]]: ...


async def _respond(sse: _Sse, events: Events | None, fmt: _Format, stream: bool) -> web.StreamResponse:
    if events is None:  # the stream opened and already ended with an error event
        return sse.response
    if not stream:
        return web.json_response(await fmt.whole(events))
    if not sse.started:
        await sse.start()
    try:
        for chunk in fmt.opening():
            await sse.send(chunk)
        async for event in events:
            for chunk in fmt.chunks(event):
                await sse.send(chunk)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # the headers went out: the failure is an error event, then [DONE]
        await sse.error(as_api_error(e))
    return await sse.finish()


# ---- /v1/completions, /v1/chat/completions (OpenAI: openai_api.py) ------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await read_json(request)  # (tokenizing a prompt of megabytes: off the event loop)
    req = await asyncio.to_thread(oa.parse_completion, body, engine.model_name, engine.tokenizer,
                                  engine.strict_model_name)
    p = req.params
    events, sse = await _run(request, req.prompt_ids, PlainText(engine.tokenizer), p, "prompt")
    return await _respond(sse, events, oa.CompletionFormat(engine.tokenizer, req), p.stream)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = oa.parse_chat(await read_json(request), engine.model_name, engine.tokenizer, engine.strict_model_name)
    p = req.params
    ids, ends = await chat_prompt(engine.tokenizer, req.messages, req.options)
    view = OutputParser(engine.tokenizer, thinking=req.options.thinking)
    events, sse = await _run(request, ids, view, p, "messages", boundaries=ends)
    return await _respond(sse, events, oa.ChatFormat(engine.tokenizer, req), p.stream)


# ---- /v1/messages (Anthropic: anthropic_api.py) -------------------------------------------------------------


class _MessagesSse(_Sse):
    """Anthropic's stream: `event: TYPE` before each data line; message_start and a ping as it opens, a ping
    beside every heartbeat comment, a failure as an `error` event; no [DONE]."""

    def __init__(self, request: web.Request, head: list[dict[str, Any]]):
        super().__init__(request)
        self.head = head

    async def start(self) -> None:
        await super().start()
        for event in self.head:
            await self.send(event)

    async def comment(self, text: str) -> None:
        await super().comment(text)
        await self.send(am.PING)

    async def send(self, obj: dict[str, Any]) -> None:
        await self.response.write(am.sse_event(obj))

    async def error(self, err: rq.ApiError) -> None:
        await self.send(am.error_body(err)[1])

    async def finish(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


async def messages(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = am.parse_messages(await read_json(request), engine.model_name, engine.strict_model_name)
    ids, ends = await chat_prompt(engine.tokenizer, req.messages, req.options)
    fmt = am.MessageFormat(req.params.model, len(ids))
    view = OutputParser(engine.tokenizer, thinking=req.options.thinking)
    events, sse = await _run(request, ids, view, req.params, "messages", _MessagesSse(request, fmt.head()), ends)
    return await _respond(sse, events, fmt, req.params.stream)


class _ResponsesSse(_Sse):
    """The Responses API's stream: `event: TYPE` before each data line, a failure as an `error` event, no [DONE]."""

    async def send(self, obj: dict[str, Any]) -> None:
        await self.response.write(rs.sse_event(obj))

    async def error(self, err: rq.ApiError) -> None:
        await self.send({"type": "error", "code": err.code or err.type, "message": err.message, "param": err.param,
                         "sequence_number": 0})

    async def finish(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


async def responses(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req, settings = rs.parse_responses(await read_json(request), engine.model_name, engine.strict_model_name)
    ids, ends = await chat_prompt(engine.tokenizer, req.messages, req.options)
    view = OutputParser(engine.tokenizer, thinking=req.options.thinking)
    events, sse = await _run(request, ids, view, req.params, "input", _ResponsesSse(request), ends)
    return await _respond(sse, events, rs.ResponsesFormat(req, settings), req.params.stream)


async def count_tokens(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    req = am.parse_messages(await read_json(request), engine.model_name, engine.strict_model_name, counting=True)
    return web.json_response({"input_tokens": len((await chat_prompt(engine.tokenizer, req.messages,
                                                                      req.options))[0])})


# ---- models, health, metrics --------------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response({"object": "list", "data": [oa.model_card(engine.model_name, engine.started,
                                                                      engine.max_context)]})


async def model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name = rq.served_model(request.match_info["name"], engine.model_name, engine.strict_model_name)
    return web.json_response(oa.model_card(name, engine.started, engine.max_context))


async def _worker_stats(engine: Engine, timeout: float = 5.0) -> list[StageStats]:
    return await asyncio.wait_for(engine.worker_stats(), timeout)


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        stats = await _worker_stats(engine)
    except Exception as e:
        return web.json_response({"status": "unavailable", "error": str(e) or type(e).__name__}, status=503)
    return web.json_response({"status": "ok", "model": engine.model_name,
                              "workers": [{"name": s.name, "layers": list(s.layers), "sessions": s.sessions,
                                           **({"experts": s.wide.share} if s.wide is not None else {})}
                                          for s in stats if s.ready]})


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        stats = await _worker_stats(engine)
    except Exception as e:
        log.warning("metrics: worker stats unavailable: %s", e)
        stats = []
    text = render(engine, stats, request.app[REQUESTS])
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def status(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        stats, error = await _worker_stats(engine), None
    except Exception as e:
        stats, error = None, str(e) or type(e).__name__
    return web.json_response(status_json(engine.model_name, time.time() - engine.started, engine.counters,
                                         engine.scheduler.stats, list(engine.prefilling.values()), stats,
                                         time.monotonic(), error, engine.max_context,
                                         getattr(engine.backend, "reconnecting", None)))


# the web chat's files (coordinator/http/web/), by the name in the URL: file, content type; any other name is a 404
WEB_FILES = {"": ("index.html", "text/html"), "chat.js": ("chat.js", "text/javascript"),
             "chat.css": ("chat.css", "text/css")}
PAGE_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'"}


async def web_file(request: web.Request) -> web.Response:
    found = WEB_FILES.get(request.match_info.get("name", ""))
    if found is None:
        raise web.HTTPNotFound()
    name, kind = found
    body = resources.files(__package__).joinpath("web", name).read_bytes()
    return web.Response(body=body, content_type=kind, charset="utf-8", headers=PAGE_HEADERS)


def _public(path: str) -> bool:
    """What needs no API key: /health, and the web chat's files (its API calls carry the key)."""
    return path in ("/health", "/") or path.startswith("/web/")


def _auth(api_key: str) -> Any:
    bearer, key = f"Bearer {api_key}".encode(), api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if not _public(request.path):  # OpenAI's clients send Authorization: Bearer, Anthropic's x-api-key
            by_bearer = hmac.compare_digest(request.headers.get("Authorization", "").encode(), bearer)
            by_header = hmac.compare_digest(request.headers.get("x-api-key", "").encode(), key)
            if not (by_bearer or by_header):
                raise rq.ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>` or "
                                  "`x-api-key: <key>`", code="invalid_api_key")
        return await handler(request)

    return check


def create_app(engine: Engine, max_body_bytes: int = 8 << 20, api_key: str | None = None) -> web.Application:
    middlewares = [_errors] + ([_auth(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app[ENGINE] = engine
    app[REQUESTS] = {}
    app[MAX_BODY] = max_body_bytes
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post(rs.PATH, responses)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status)
    ollama_routes.add_routes(app)
    app.router.add_get("/", web_file)
    app.router.add_get("/web/{name}", web_file)
    return app


async def start(engine: Engine, host: str, port: int, max_body_bytes: int = 8 << 20,
                api_key: str | None = None) -> tuple[web.AppRunner, int]:
    """Serve the API; returns the runner (await runner.cleanup() to stop) and the bound port."""
    runner = web.AppRunner(create_app(engine, max_body_bytes, api_key), handler_cancellation=True, access_log=None,
                            auto_decompress=False)  # read_json decodes bodies (handling.WBITS says why)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound


async def stop_listening(runner: web.AppRunner) -> None:
    """Close the listening sockets: no new connections; those open (running requests) go on."""
    for site in list(runner.sites):
        await site.stop()
