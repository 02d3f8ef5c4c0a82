"""Waiting on a long gRPC call while making sure its server is alive: a frozen process never reaches the
call's deadline (a forward may take minutes), so the caller asks the server something cheap every few seconds
and gives up on it once it has answered nothing for a while. The coordinator watches its forwards this way, and
a stage its expert calls to other workers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc


class Silent(Exception):
    """The server answered no probe for `seconds` while the call ran."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        super().__init__(f"no answer for {seconds:.1f}s")


async def await_watched(call: Any, probe: Callable[[], Awaitable[object]], interval: float,
                        lost_after: float, result: Awaitable[Any] | None = None) -> Any:
    """`call`'s response (its AioRpcError as raised), or `result`'s (a streaming call's responses, collected);
    meanwhile `probe()` every `interval` seconds, and Silent once probes have failed for `lost_after` seconds
    (the call is then cancelled)."""
    waiter = asyncio.ensure_future(result if result is not None else _result(call))
    last_answer = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=interval)
            if done:
                return waiter.result()
            try:
                await probe()
                last_answer = time.monotonic()
            except grpc.aio.AioRpcError:
                silent = time.monotonic() - last_answer
                if silent >= lost_after:
                    raise Silent(silent) from None
    finally:
        if not waiter.done():
            call.cancel()
            waiter.cancel()


async def _result(call: Any) -> Any:
    return await call
