"""Ollama's routes on the HTTP transport (their wire format is ollama_api.py's): the served model's facts, and
chat and generate, streamed as one JSON object a line (application/x-ndjson) unless `stream` is false.

    GET  /api/version   {"version"}
    GET  /api/tags      the served model, with its size on disk and details
    POST /api/show      its details, context length and capabilities
    GET  /api/ps        the model as loaded
    POST /api/chat      a chat reply: message.content, message.thinking, message.tool_calls
    POST /api/generate  a completion of `prompt` (in the chat format; `raw`: as plain text)

An error before the reply starts is a status with Ollama's `{"error"}` body; after, a last line `{"error"}`.
"""

from __future__ import annotations

import asyncio
import json
import math

from aiohttp import web

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import fingerprint
from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.token_loop import PlainText
from deltafin.coordinator.http import ollama_api as ol
from deltafin.coordinator.http import request as rq
from deltafin.coordinator.http.handling import (
    ENGINE,
    Events,
    as_api_error,
    chat_prompt,
    first_event,
    read_json,
    rest_of,
)
from deltafin.text.chat import OutputParser


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": ol.VERSION})


async def tags(request: web.Request) -> web.Response:
    return web.json_response(ol.tags(facts(request.app[ENGINE])))


async def show(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await read_json(request)
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    rq.served_model(name or engine.model_name, engine.model_name, engine.strict_model_name)
    return web.json_response(ol.show(facts(engine)))


async def ps(request: web.Request) -> web.Response:
    return web.json_response(ol.ps(facts(request.app[ENGINE])))


async def chat(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = ol.parse_chat(await read_json(request), engine.model_name, engine.strict_model_name)
    return await _reply(request, engine, req, chat=True)


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = ol.parse_generate(await read_json(request), engine.model_name, engine.strict_model_name)
    return await _reply(request, engine, req, chat=False)


async def _reply(request: web.Request, engine: Engine, req: rq.GenerationRequest, chat: bool) -> web.StreamResponse:
    if req.context is not None and req.context > engine.max_context:
        raise rq.bad("options.num_ctx", f"options.num_ctx {req.context} is more than this server's context of "
                     f"{engine.max_context} tokens (a server started with --max-context N plans for more)")
    p = req.params
    rq.check_expert_mode(p, engine.expert_mode, "options.expert_mode")
    if req.messages is None:
        ids, ends = await asyncio.to_thread(engine.tokenizer.encode, req.prompt), []  # (off the event loop)
        view = PlainText(engine.tokenizer)
    else:
        ids, ends = await chat_prompt(engine.tokenizer, req.messages, req.options)
        view = OutputParser(engine.tokenizer, thinking=req.options.thinking)
    events = engine.run(ids, view, p.generation, boundaries=ends)
    first = await first_event(events, "messages" if chat else "prompt")
    fmt = ol.OllamaFormat(p.model, chat, req.options.thinking)
    rest = rest_of(first, events)
    if not p.stream:
        return web.json_response(await fmt.whole(rest))
    return await _stream(request, fmt, rest)


async def _stream(request: web.Request, fmt: ol.OllamaFormat, events: Events) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for event in events:
            for line in fmt.chunks(event):
                await response.write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
    except ConnectionResetError:
        raise
    except Exception as e:  # the status went out: the failure is the last line
        await response.write(json.dumps(ol.error_body(as_api_error(e))[1]).encode() + b"\n")
    await response.write_eof()
    return response


def facts(engine: Engine) -> ol.ModelFacts:
    """The served model as Ollama's model routes describe it: its size on disk, its fingerprint as the digest."""
    folder = engine.model_dir
    files = [f for f in folder.iterdir() if f.is_file()] if folder is not None else []
    return ol.ModelFacts(engine.model_name, engine.cfg.model_type, parameter_count(engine.cfg),
                         sum(f.stat().st_blocks * 512 for f in files), fingerprint(folder) if folder else "",
                         engine.max_context, engine.started)


def parameter_count(cfg: ModelConfig) -> int:
    """Every weight of the text model: the spine's, and each MoE layer's experts (two MXFP4 values a byte)."""
    specs = [s for i in range(cfg.num_layers) for s in cfg.layer_tensor_specs(i)] + list(cfg.top_tensor_specs())
    spine = sum(math.prod(s.shape) for s in specs)
    if not cfg.moe_layers:
        return spine
    one = sum(math.prod(s.shape) for s in cfg.expert_tensor_specs(cfg.moe_layers[0], 0) if s.name.endswith("packed"))
    return spine + 2 * one * cfg.num_experts * len(cfg.moe_layers)
