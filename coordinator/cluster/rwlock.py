"""A readers-writer lock for asyncio: the cluster's forwards share it, re-plans and rejoins take it alone.

A waiting exclusive holder goes before new shared ones, so a re-plan is not starved by a stream of forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class RWLock:
    """Many holders in shared mode or one in exclusive mode; a waiting exclusive holder goes first."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def locked(self) -> bool:
        return self._exclusive or self._shared > 0 or self._waiting > 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and self._waiting == 0)
            self._shared += 1
        try:
            yield
        finally:
            async with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
            finally:
                self._waiting -= 1
                self._cond.notify_all()
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()
