"""What every route of the HTTP transport shares: the app's keys, reading a JSON body, the first event of a
generation (admission and prompt errors as statuses), and any error as the API's refusal (`as_api_error`; each
adapter gives it its API's shape)."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import zlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.events import Finished, TokenEvent
from deltafin.coordinator.http import request as rq
from deltafin.errors import HTTP_STATUS, ChatFormatError, PromptTooLong, lookup
from deltafin.text.chat import ChatOptions, encode_with_boundaries
from deltafin.text.tokenizer import K3Tokenizer

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", Engine)
REQUESTS = web.AppKey("requests", dict)
MAX_BODY = web.AppKey("max_body", int)
Events = AsyncIterator[TokenEvent | Finished]


def as_api_error(e: BaseException) -> rq.ApiError:
    """The API's answer to an error: its own, or the one deltafin/errors.py's HTTP_STATUS gives it."""
    if isinstance(e, rq.ApiError):
        return e
    found = lookup(HTTP_STATUS, e)
    if found is None:
        log.exception("unexpected error serving a request")
        return rq.ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
    status, kind, code = found
    message = f"a worker failed: {e}" if code == "worker_unavailable" else str(e)
    return rq.ApiError(status, message, type=kind, param=getattr(e, "param", None), code=code)


MAX_DEPTH = 64  # objects and arrays nested in a body (a tool's schema needs a handful)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, refused with a 4xx before any work when it cannot be: a Content-Encoding other than
    identity, gzip or deflate (415) or one the body does not match, a decoded body over the size limit (413), an
    unknown charset (415), text that is not JSON, nesting deeper than MAX_DEPTH, a number JSON's parser will not
    hold, strings that are not Unicode (a lone surrogate escape)."""
    raw = _decoded(await request.read(), request.headers.get("Content-Encoding", ""), request.app[MAX_BODY])
    charset = request.charset or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        raise rq.ApiError(415, f"unsupported charset {charset!r}: send JSON in UTF-8",
                          code="unsupported_media_type") from None
    try:
        body = json.loads(raw.decode(charset))
    except RecursionError:
        raise rq.bad(None, f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and an integer of over 4,300 digits
        raise rq.bad(None, f"the request body is not valid JSON: {e}") from None
    _check_value(body)
    return body


# The server decodes Content-Encoding itself (start() turns aiohttp's off): aiohttp's decoder leaves a handler
# waiting forever for a deflate body that ends early when the body arrives after the headers.
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _decoded(raw: bytes, content_encoding: str, limit: int) -> bytes:
    """The body with its codings undone, last applied first; never more than `limit` bytes of it."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding not in WBITS:
            raise rq.ApiError(415, f"unsupported Content-Encoding {coding!r}: send the body as is, gzip or deflate",
                              code="unsupported_media_type")
        wbits = WBITS[coding]
        if coding == "deflate" and not _zlib_header(raw):
            wbits = -zlib.MAX_WBITS  # a raw deflate stream, as some clients send
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(raw, limit + 1)
        except zlib.error as e:
            raise rq.bad(None, f"the request body is not {coding} data: {e}") from None
        if len(out) > limit:
            raise rq.ApiError(413, f"the request body is larger than {limit} bytes once decoded ({coding})")
        if not inflater.eof or inflater.unused_data:
            raise rq.bad(None, f"the request body is not one complete {coding} stream")
        raw = out
    return raw


def _zlib_header(data: bytes) -> bool:
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


def _check_value(body: Any) -> None:
    """No nesting past MAX_DEPTH, every string encodable as UTF-8 (walked without recursion)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise rq.bad(None, f"the request body is nested deeper than {MAX_DEPTH} levels")
            items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
            for key, item in items:
                if isinstance(key, str):
                    _encodable(key)
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            _encodable(value)


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise rq.bad(None, "the request body has a string that is not valid Unicode (a lone surrogate escape, "
                     "such as \\ud800)") from None


async def chat_prompt(tokenizer: K3Tokenizer, messages: list[dict[str, Any]], options: ChatOptions
                      ) -> tuple[list[int], list[int]]:
    """The prompt's ids and message ends, in a thread (a prompt of megabytes takes seconds to tokenize, which the
    event loop must not wait for); a conversation the chat format cannot render is a 400 naming `messages`."""
    try:
        return await asyncio.to_thread(encode_with_boundaries, tokenizer, messages, options)
    except ChatFormatError as e:
        raise rq.bad("messages", str(e)) from None
    except (TypeError, AttributeError, KeyError, ValueError) as e:
        raise rq.bad("messages", f"'messages': a message has a field of the wrong shape "
                     f"({type(e).__name__}: {e})") from None


async def first_event(events: Events, prompt_param: str) -> TokenEvent | Finished:
    """The first event, before any response header: admission and prompt errors become proper statuses."""
    try:
        return await anext(events)
    except PromptTooLong as e:
        await events.aclose()
        raise rq.ApiError(400, str(e), param=prompt_param, code="context_length_exceeded") from None
    except BaseException:
        await events.aclose()
        raise


async def rest_of(first: TokenEvent | Finished, events: Events) -> Events:
    yield first
    async with contextlib.aclosing(events):
        async for e in events:
            yield e
