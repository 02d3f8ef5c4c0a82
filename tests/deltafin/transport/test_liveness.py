"""await_watched: a call whose probes go unanswered is lost after `lost_after`, unless it shows progress (parts
sent or received); progress that stops counts no longer."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from deltafin.transport.liveness import Silent, Watch, await_watched, receiving, sending

INTERVAL, LOST_AFTER = 0.05, 0.3


class Call:
    """A call that answers after `seconds` (a streaming call's result is awaited separately)."""

    def __init__(self, seconds: float):
        self.seconds, self.cancelled = seconds, False

    async def answer(self) -> str:
        await asyncio.sleep(self.seconds)
        return "done"

    def cancel(self) -> None:
        self.cancelled = True


async def _unanswered() -> None:
    await asyncio.sleep(INTERVAL / 2)
    raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata())


async def _moving(watch: Watch, seconds: float) -> None:
    """Marks progress every INTERVAL for `seconds`, then none."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.alive()
        await asyncio.sleep(INTERVAL)


async def test_a_call_that_moves_is_alive_while_probes_go_unanswered() -> None:
    call, watch = Call(4 * LOST_AFTER), Watch()
    mover = asyncio.ensure_future(_moving(watch, 10.0))
    try:
        assert await await_watched(call, _unanswered, INTERVAL, LOST_AFTER, call.answer(), watch) == "done"
    finally:
        mover.cancel()
    assert not call.cancelled


@pytest.mark.parametrize("moving", [0.0, 2 * LOST_AFTER])
async def test_a_call_that_stops_moving_is_lost(moving: float) -> None:
    """Silent within about `lost_after` of its last sign of life (none at all, or progress that stopped)."""
    call, watch = Call(100.0), Watch()
    mover = asyncio.ensure_future(_moving(watch, moving))
    t0 = time.monotonic()
    with pytest.raises(Silent) as lost:
        await await_watched(call, _unanswered, INTERVAL, LOST_AFTER, call.answer(), watch)
    took = time.monotonic() - t0
    await mover
    assert LOST_AFTER <= lost.value.seconds < LOST_AFTER + 3 * INTERVAL
    assert moving + LOST_AFTER <= took < moving + LOST_AFTER + 0.5
    assert call.cancelled


async def test_answered_probes_keep_a_still_call_alive() -> None:
    async def answered() -> None:
        await asyncio.sleep(0)

    call = Call(4 * LOST_AFTER)
    assert await await_watched(call, answered, INTERVAL, LOST_AFTER, call.answer()) == "done"


async def test_parts_sent_and_received_are_progress() -> None:
    watch = Watch()
    watch.last -= 100.0
    parts = sending(["a", "b"], watch)
    assert next(parts) == "a" and watch.silent() < 1.0
    watch.last -= 100.0
    assert list(parts) == ["b"] and watch.silent() < 1.0  # the last part taken, then sent

    async def responses():
        for part in ("x", "y"):
            yield part

    watch.last -= 100.0
    assert await receiving(responses(), watch) == ["x", "y"] and watch.silent() < 1.0
