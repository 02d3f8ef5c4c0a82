"""Waiting on a long gRPC call while making sure its server is alive: a frozen process never reaches the
call's deadline (a forward may take minutes), so the caller watches for signs of life and gives up on the server
once it has shown none for a while (`lost_after`). The coordinator watches its forwards this way, and a stage its
expert calls to other workers.

Two signs of life count, whichever came last (a `Watch` holds the time):
- a probe answered: every `interval` seconds the caller asks the server something cheap (`Info`, which also says
  the layers done of the forward in flight). The callers send probes over a channel of their own, a TCP
  connection apart from the call's, so they never queue behind its bulk data (hundreds of MB of hidden states);
- the call moved: a request part taken by gRPC to send (it takes the next once the last is on its way, as fast as
  the server reads them, give or take its flow-control window of a few MB) or a response part received (`sending`
  and `receiving` mark them). On a link so busy that even a probe's few bytes are late, bytes still flowing mean
  the server is alive.
A crashed server fails the call at once (its connection resets); a frozen one stops reading, so parts stop, and
answers no probe: it is lost within `lost_after` (and a probe's timeout) of its last sign of life.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc

T = TypeVar("T")


class Silent(Exception):
    """The server showed no sign of life for `seconds` while the call ran."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        super().__init__(f"no answer for {seconds:.1f}s")


class Watch:
    """When one watched call's server last showed a sign of life (see the module docstring)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def alive(self) -> None:
        self.last = time.monotonic()

    def silent(self) -> float:
        """Seconds since the last sign of life."""
        return time.monotonic() - self.last


def sending(parts: Iterable[T], watch: Watch) -> Iterator[T]:
    """A client-streamed call's request parts, each one gRPC takes (the previous one sent) a sign of life."""
    for part in parts:
        watch.alive()
        yield part
    watch.alive()  # the last one sent


async def sending_async(parts: AsyncIterable[T], watch: Watch) -> AsyncIterator[T]:
    """`sending` for parts that come while the call runs (relayed from another call)."""
    async for part in parts:
        watch.alive()
        yield part
    watch.alive()


async def receiving(responses: AsyncIterable[T], watch: Watch,
                    each: Callable[[T], None] | None = None) -> list[T]:
    """A server-streamed call's responses, collected, each one received a sign of life (and given to `each`)."""
    out = []
    async for part in responses:
        watch.alive()
        out.append(part)
        if each is not None:
            each(part)
    return out


async def await_watched(call: Any, probe: Callable[[], Awaitable[object]], interval: float,
                        lost_after: float, result: Awaitable[Any] | None = None, watch: Watch | None = None) -> Any:
    """`call`'s response (its AioRpcError as raised), or `result`'s (a streaming call's responses, collected);
    meanwhile `probe()` every `interval` seconds, and Silent once neither a probe's answer nor the call's progress
    (marked on `watch`) has been seen for `lost_after` seconds (the call is then cancelled)."""
    watch = watch or Watch()
    waiter = asyncio.ensure_future(result if result is not None else _result(call))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=interval)
            if done:
                return waiter.result()
            try:
                await probe()
                watch.alive()
            except grpc.aio.AioRpcError:
                silent = watch.silent()
                if silent >= lost_after:
                    raise Silent(silent) from None
    finally:
        if not waiter.done():
            call.cancel()
            waiter.cancel()


async def _result(call: Any) -> Any:
    return await call
