"""What every route of the HTTP transport shares: the app's keys, reading a JSON body, the first event of a
generation (admission and prompt errors as statuses), and an error in the shape of the API its path belongs to
(OpenAI's, Anthropic's under /v1/messages, Ollama's under /api/)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.token_loop import Finished, TokenEvent
from deltafin.coordinator.http import anthropic_api as am
from deltafin.coordinator.http import ollama_api as ol
from deltafin.coordinator.http import openai_api as oa
from deltafin.errors import HTTP_STATUS, PromptTooLong, lookup

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", Engine)
REQUESTS = web.AppKey("requests", dict)
MAX_BODY = web.AppKey("max_body", int)
Events = AsyncIterator[TokenEvent | Finished]


def error_response(err: oa.ApiError, path: str) -> web.Response:
    """The error in the shape of the API the path belongs to: Anthropic's under /v1/messages, Ollama's under
    /api/, else OpenAI's."""
    if am.is_messages_path(path):
        status, body = am.error_body(err)
        return web.json_response(body, status=status)
    if ol.is_ollama_path(path):
        return web.json_response(ol.error_body(err), status=err.status)
    return web.json_response(err.body(), status=err.status)


def as_api_error(e: BaseException) -> oa.ApiError:
    """The API's answer to an error: its own, or the one deltafin/errors.py's HTTP_STATUS gives it."""
    if isinstance(e, oa.ApiError):
        return e
    found = lookup(HTTP_STATUS, e)
    if found is None:
        log.exception("unexpected error serving a request")
        return oa.ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
    status, kind, code = found
    message = f"a worker failed: {e}" if code == "worker_unavailable" else str(e)
    return oa.ApiError(status, message, type=kind, param=getattr(e, "param", None), code=code)


async def read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise oa.bad(None, f"the request body is not valid JSON: {e}") from None


async def first_event(events: Events, prompt_param: str) -> TokenEvent | Finished:
    """The first event, before any response header: admission and prompt errors become proper statuses."""
    try:
        return await anext(events)
    except PromptTooLong as e:
        await events.aclose()
        raise oa.ApiError(400, str(e), param=prompt_param, code="context_length_exceeded") from None
    except BaseException:
        await events.aclose()
        raise


async def rest_of(first: TokenEvent | Finished, events: Events) -> Events:
    yield first
    async with contextlib.aclosing(events):
        async for e in events:
            yield e
