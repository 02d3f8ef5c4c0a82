"""Noticing lost, returning and new workers while the cluster is idle.

Every `rejoin_interval` seconds (backing off up to 16 times that while the checks fail), when no session is
recorded in the replay journal and no forward or re-plan holds the lock, `Membership` asks the current workers
whether they still hold their part (a recovery re-plans without those that do not), then probes the other known
and discovered workers (named addresses, Bonjour) and plans the layers again over them when the plan gets more
workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from deltafin.coordinator.cluster.current_plan import CurrentPlan
from deltafin.coordinator.cluster.journal import ReplayJournal
from deltafin.coordinator.cluster.rwlock import RWLock
from deltafin.coordinator.cluster.workers import assign_plan, plan_cluster, probe_workers
from deltafin.errors import DeltafinError

log = logging.getLogger(__name__)

Recover = Callable[[str, list[str]], Awaitable[object]]  # (cause, sessions): ResilientCluster.recover


class Membership:
    """The idle check over `current`, every `interval` seconds once `watch` started it (0: never)."""

    def __init__(self, current: CurrentPlan, journal: ReplayJournal, lock: RWLock, interval: float,
                 recover: Recover) -> None:
        self.current, self.journal, self.lock, self.interval = current, journal, lock, interval
        self.recover = recover
        self._task: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """Start the loop, or start it again if it ended."""
        if self.interval > 0 and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.interval * min(2 ** failures, 16))
            if self.journal.sessions or self.lock.locked():
                continue  # sessions are live: moving stages now would make them all replay
            try:
                lost = await self.lost_stages()
                if lost:
                    await self.recover(f"idle check: {lost} not answering", [])
                await self.rejoin()
                failures = 0
            except Exception as e:
                failures += 1
                log.warning("checking for lost or returning workers failed (next try in %.0fs): %s",
                            self.interval * min(2 ** failures, 16), e)

    async def lost_stages(self) -> str:
        """Names of current workers (stages and expert holders) that do not answer (or no longer hold their
        part)."""
        stages = list(self.current.backend.workers)
        answers = await asyncio.gather(*(w.info(self.current.probe_timeout()) for w in stages),
                                       return_exceptions=True)
        return ", ".join(w.name for w, a in zip(stages, answers, strict=True)
                         if isinstance(a, BaseException) or a.state != "ready" or a.assigned != (w.start, w.end))

    async def rejoin(self) -> None:
        """Plan again over the current workers and the others that answer, when that plan has more workers."""
        cur = self.current
        in_use = list(dict.fromkeys(w.address for w in cur.backend.workers))  # in plan order: the same ranges
        extra = [a for a in dict.fromkeys([*cur.known, *await cur.discovered()]) if a not in in_use]
        if not extra:
            return
        new = await probe_workers(cur.spec, extra, quiet=True, timeout=cur.probe_timeout())
        if not new:
            return
        current = await probe_workers(cur.spec, in_use, quiet=True, timeout=cur.probe_timeout())
        workers = current + new
        try:
            better = len((await plan_cluster(cur.spec, cur.cfg, workers)).workers) > len(cur.plan.workers)
        except DeltafinError:
            better = False
        if not better or self.journal.sessions:
            await asyncio.gather(*(c.close() for c, _ in workers))
            return
        async with self.lock.exclusive():
            if self.journal.sessions:  # a request started meanwhile: not now
                await asyncio.gather(*(c.close() for c, _ in workers))
                return
            backend, plan = await assign_plan(cur.spec, cur.cfg, workers, show_progress=False)
            await cur.adopt(backend, plan)
            self.journal.mark_all_stale()
        log.warning("worker(s) %s joined; new plan %s%s", ", ".join(d.name for _, d in new),
                    " | ".join(f"{w.name} {w.start}-{w.end - 1}" for w in cur.backend.stages),
                    "".join(f" | {w.name} experts" for w in cur.backend.holders))
