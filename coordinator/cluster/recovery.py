"""Keep generating when workers fail: a journal of every session's inputs, re-planning, replay.

`ResilientCluster` wraps the ClusterBackend. For every live session it records the token ids fed to
stage 0 and how they were chunked (prompt, then one token per step): 4 bytes per token plus 4 per
forward, at most `journal_tokens` tokens in all (the least recently used sessions lose their record
first, and would fail rather than recover; kept prefixes' records go before any live session's). A
session resumed from a kept prefix starts with that prefix's record, so it too replays from token 0.
Hub routing makes that enough: every stage's input is a
deterministic function of those ids, so replaying them in the same chunks rebuilds every cache exactly,
bit for bit on the same devices and dtypes, and greedy decoding continues with the same tokens.

When a forward fails because a worker is gone (connection refused or reset, deadline, no answer to the
liveness probes for `lost_after` seconds) or lost its state (restarted, session expired or evicted), the
coordinator probes every worker it knows (named, discovered, the current ones), plans again over those
that answer, loads the stages whose assignment changed, marks the affected sessions stale and retries.
A stale session is replayed before its next forward. Replay costs one forward per recorded chunk: for
a request that had generated n tokens, 1 + n forwards of the stages that were rebuilt.

If no plan fits the workers that remain, that request fails with ClusterUnavailable (HTTP 503) and the
coordinator keeps serving: the next request tries again, so a returning worker brings the cluster back.
While the cluster is idle, workers that come back or appear (named addresses, Bonjour) are noticed every
`rejoin_interval` seconds, and the layers are planned again over them when the plan gets more workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from deltafin.checkpoint.config import ModelConfig, load_config
from deltafin.coordinator.cluster.backend import ClusterBackend
from deltafin.coordinator.cluster.workers import (
    ClusterSpec,
    Worker,
    assign_plan,
    discover_addresses,
    find_workers,
    plan_cluster,
    probe_workers,
)
from deltafin.errors import ClusterUnavailable, DeltafinError, PartialFailure, RemoteError, WorkerLost
from deltafin.plan.planner import Plan
from deltafin.runtime.prefix_store import PrefixBudget
from deltafin.runtime.stage import SeqInput, SeqOutput

log = logging.getLogger(__name__)

# failures that another plan or a replay can fix
GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
STATE_LOST = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(frozen=True)
class RecoveryOptions:
    enabled: bool = True
    max_attempts: int = 3  # recoveries for one forward before it fails
    rejoin_interval: float = 5.0  # seconds between looks for returning or new workers while idle (0: never)
    journal_tokens: int = 1 << 22  # tokens recorded across sessions (4 bytes each): 16 MB


@dataclass
class _Journal:
    ids: array = field(default_factory=lambda: array("i"))  # every token fed to stage 0, in order
    chunks: array = field(default_factory=lambda: array("i"))  # the length of each forward that fed them
    starts: array = field(default_factory=lambda: array("i"))  # the cache_len each forward continued from
    speculative: array = field(default_factory=lambda: array("b"))  # whether it was (the next may rewind)

    def copy(self) -> _Journal:
        return _Journal(array("i", self.ids), array("i", self.chunks), array("i", self.starts),
                        array("b", self.speculative))

    @property
    def end(self) -> int:
        return self.starts[-1] + self.chunks[-1] if self.chunks else 0

    def continues(self, cache_len: int) -> bool:
        """Whether a forward from `cache_len` follows what is recorded: from its end, or from a position of
        the last forward if that was speculative (the stages rewind there)."""
        if cache_len == self.end:
            return True
        return bool(self.chunks) and bool(self.speculative[-1]) and self.starts[-1] < cache_len <= self.end

    def add(self, item: SeqInput) -> None:
        self.ids.extend(int(t) for t in item.ids.tolist())  # type: ignore[union-attr]
        self.chunks.append(item.num_tokens)
        self.starts.append(item.cache_len)
        self.speculative.append(item.speculative)

    def forwards(self) -> list[SeqInput]:
        """The recorded forwards again, for a session id filled in by the caller."""
        out, pos = [], 0
        for n, start, spec in zip(self.chunks, self.starts, self.speculative, strict=True):
            out.append(SeqInput("", start, ids=torch.tensor(self.ids[pos:pos + n], dtype=torch.long),
                                speculative=bool(spec)))
            pos += n
        return out


@dataclass(frozen=True)
class Recovery:
    cause: str
    seconds: float
    workers: tuple[str, ...]  # the plan's workers afterwards
    replanned: bool


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


def _recoverable(e: BaseException) -> bool:
    if isinstance(e, WorkerLost):
        return True
    return isinstance(e, RemoteError) and (e.code in GONE or e.code in STATE_LOST)


class ResilientCluster:
    """A Backend over the cluster that survives losing workers (see the module docstring)."""

    def __init__(self, spec: ClusterSpec, cfg: ModelConfig, backend: ClusterBackend, plan: Plan,
                 options: RecoveryOptions | None = None):
        self.spec, self.cfg, self.backend, self.plan = spec, cfg, backend, plan
        self.options = options or RecoveryOptions()
        self.journal: OrderedDict[str, _Journal] = OrderedDict()
        self.prefix_journal: OrderedDict[str, _Journal] = OrderedDict()  # kept prefixes: how their state was fed
        self.journal_size = 0
        self.stale: set[str] = set()
        self.known = list(dict.fromkeys([*spec.addresses, *(w.address for w in backend.workers)]))
        self.recoveries: list[Recovery] = []
        self.lock = RWLock()  # forwards share it (batches pipeline through the stages); re-plans take it alone
        self._membership: asyncio.Task[None] | None = None

    @property
    def max_forward_tokens(self) -> int | None:
        return self.backend.max_forward_tokens

    @property
    def prefix_stages(self) -> list[PrefixBudget]:
        return self.backend.prefix_stages

    @property
    def stages(self) -> list[Any]:
        return self.backend.stages

    @property
    def workers(self) -> list[Any]:
        return self.backend.workers

    @property
    def parallel_stages(self) -> int:
        return self.backend.parallel_stages

    # ---- the Backend interface ------------------------------------------------------------------------

    async def forward(self, batch: list[SeqInput], all_logits: bool = False,
                      progress: Callable[[float], None] | None = None) -> list[SeqOutput]:
        self._watch_membership()
        attempts, resume = 0, None
        while True:
            try:
                async with self.lock.shared():
                    for item in batch:
                        if item.session_id in self.stale:
                            await self._replay(item)
                    outputs = await self.backend.forward(batch, all_logits, resume, progress)
                self._record(batch)
                return outputs
            except (RemoteError, WorkerLost) as e:
                if not self.options.enabled or not _recoverable(e):
                    self._mark_stale(b.session_id for b in batch)  # earlier stages may have advanced
                    if len(batch) > 1:  # find out which sequence is at fault; the others go on
                        return await self._one_by_one(batch, all_logits)
                    raise
                attempts += 1
                if attempts > 1 and len(batch) > 1:  # recovery did not help the batch: one sequence may be
                    return await self._one_by_one(batch, all_logits)  # beyond rebuilding; the others go on
                if attempts > self.options.max_attempts:
                    raise ClusterUnavailable(f"giving up after {attempts - 1} recoveries; last error: {e}") from None
                at = getattr(e, "resume_at", None)
                event = await self.recover(str(e), [b.session_id for b in batch], retry_hop=at is not None)
                # the stages kept their sessions (e.g. only an expert holder was lost): retry the hop that failed
                resume = at if not event.replanned and at is not None else None

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None,
                      keep_lengths: list[int] | None = None) -> None:
        for sid, keep in zip(session_ids, keep_as or [""] * len(session_ids), strict=True):
            j = self.journal.get(sid)
            if keep and j is not None:  # the kept prefix is rebuilt the way the session was
                self.journal.pop(sid)
                self.stale.discard(sid)
                self.prefix_journal[keep] = j
            else:
                self._forget(sid)
                self._forget_prefix(sid)
        await self.backend.release(session_ids, keep_as, keep_lengths)

    async def stats(self) -> list[dict[str, Any]]:
        return await self.backend.stats()

    async def find_prefix(self, tokens: list[int]) -> tuple[str, int] | None:
        return await self.backend.find_prefix(tokens)

    async def close(self) -> None:
        if self._membership is not None:
            self._membership.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._membership
        await self.backend.close()

    # ---- journal ----------------------------------------------------------------------------------------

    def _record(self, batch: list[SeqInput]) -> None:
        if not self.options.enabled:
            return
        for item in batch:
            if item.ids is None:
                continue
            if item.cache_len == 0:
                self._forget(item.session_id)
            if item.resume_from and item.session_id not in self.journal:
                kept = self.prefix_journal.get(item.resume_from)
                if kept is not None:  # a resumed session replays from token 0 the way its prefix was fed
                    self.journal[item.session_id] = kept.copy()
                    self.journal_size += len(kept.ids)
            j = self.journal.setdefault(item.session_id, _Journal())
            if not j.continues(item.cache_len):  # not a continuation of what was recorded: cannot replay it
                self._forget(item.session_id)
                continue
            j.add(item)
            self.journal_size += item.num_tokens
            self.journal.move_to_end(item.session_id)
            if item.save_as:
                self.prefix_journal[item.save_as] = j.copy()
                self.journal_size += len(j.ids)
        while self.journal_size > self.options.journal_tokens and self.prefix_journal:
            self._forget_prefix(next(iter(self.prefix_journal)))
        while self.journal_size > self.options.journal_tokens and len(self.journal) > 1:
            sid, _ = next(iter(self.journal.items()))
            log.warning("session %s no longer fits the replay journal; it cannot survive a worker loss", sid[:8])
            self._forget(sid)

    def _forget(self, sid: str) -> None:
        j = self.journal.pop(sid, None)
        if j is not None:
            self.journal_size -= len(j.ids)
        self.stale.discard(sid)

    def _forget_prefix(self, prefix_id: str) -> None:
        j = self.prefix_journal.pop(prefix_id, None)
        if j is not None:
            self.journal_size -= len(j.ids)

    def _mark_stale(self, sids: Any) -> None:
        self.stale.update(s for s in sids if s in self.journal)

    async def _replay(self, item: SeqInput) -> None:
        """Rebuild a session's caches on every stage by feeding its recorded chunks again."""
        sid = item.session_id
        j = self.journal.get(sid)
        if j is None or item.cache_len == 0:
            self.stale.discard(sid)
            return
        if not j.continues(item.cache_len):
            self._forget(sid)
            raise ClusterUnavailable(f"session {sid[:8]} cannot be rebuilt: its record ends at {j.end} tokens "
                                     f"but the call continues at {item.cache_len}")
        t0 = time.monotonic()
        for fwd in j.forwards():  # the same chunks, speculative ones too: the stages rewind as they did
            await self.backend.forward([dataclasses.replace(fwd, session_id=sid)])
        self.stale.discard(sid)
        log.info("replayed session %s: %d tokens in %d forwards, %.2fs", sid[:8], len(j.ids), len(j.chunks),
                 time.monotonic() - t0)

    async def _one_by_one(self, batch: list[SeqInput], all_logits: bool) -> list[SeqOutput]:
        results: list[SeqOutput | BaseException] = []
        for item in batch:
            try:
                results.append((await self.forward([item], all_logits))[0])
            except DeltafinError as e:
                results.append(e)
        if any(isinstance(r, BaseException) for r in results):
            raise PartialFailure(results)
        return results  # type: ignore[return-value]

    # ---- recovery ---------------------------------------------------------------------------------------

    async def recover(self, cause: str, sessions: list[str], retry_hop: bool = False) -> Recovery:
        """Plan again over the workers that answer; reload what changed; mark sessions for replay (the failed
        batch's only when the stages are unchanged, and none then when its caller retries the failed hop)."""
        t0 = time.monotonic()
        async with self.lock.exclusive():
            log.warning("cluster problem: %s; checking the workers", cause)
            candidates = await self._candidates()
            if not candidates:
                raise ClusterUnavailable(f"no worker answers (after: {cause})")
            before = [(w.address, w.start, w.end) for w in self.backend.stages]
            current = {(d.address, d.assigned) for _, d in candidates if d.state == "ready"}
            try:
                backend, plan = await assign_plan(self.spec, self.cfg, candidates, show_progress=False, reuse=True)
            except DeltafinError as e:
                raise ClusterUnavailable(f"the workers that answer cannot run the model: {e} "
                                         f"(after: {cause})") from None
            after = [(w.address, w.start, w.end) for w in backend.stages]
            replanned = after != before or any((addr, (lo, hi)) not in current for addr, lo, hi in after)
            moved = experts_moved(self.plan, plan)
            if moved:
                log.warning("%s", moved)
            old, self.backend, self.plan = self.backend, backend, plan
            self.known = list(dict.fromkeys([*self.known, *(w.address for w in backend.workers)]))
            with contextlib.suppress(Exception):
                await old.close()
            self._mark_stale(self.journal if replanned else [] if retry_hop else sessions)
            event = Recovery(cause, time.monotonic() - t0, tuple(w.name for w in backend.stages), replanned)
            self.recoveries.append(event)
            log.warning("recovered in %.2fs: %s; %s", event.seconds,
                        "new plan " + " | ".join(f"{w.name} {w.start}-{w.end - 1}" for w in backend.stages)
                        if replanned else "same stages", f"{len(self.stale)} sessions to replay" if self.stale
                        else "retrying the step" if retry_hop else "nothing to replay")
            return event

    async def _candidates(self) -> list[Worker]:
        addresses = list(dict.fromkeys([*self.known, *await self._discovered()]))
        return await probe_workers(self.spec, addresses, quiet=True, timeout=self._probe_timeout())

    def _probe_timeout(self) -> float:
        """A worker that does not answer Info this fast is not a candidate (a frozen one never answers)."""
        t = self.spec.timeouts
        return min(t.control, max(t.lost_after / 2, 1.0))

    async def _discovered(self) -> list[str]:
        if not self.spec.discover:
            return []
        try:
            return await discover_addresses(self.spec, timeout=min(self.spec.discover_timeout, 1.5))
        except Exception as e:  # Bonjour trouble must not stop a recovery over the named workers
            log.warning("looking for workers on Bonjour failed (going on with the named ones): %s", e)
            return []

    # ---- workers that come back -----------------------------------------------------------------------

    def _watch_membership(self) -> None:
        if self.options.rejoin_interval > 0 and (self._membership is None or self._membership.done()):
            self._membership = asyncio.ensure_future(self._membership_loop())

    async def _membership_loop(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.options.rejoin_interval * min(2 ** failures, 16))
            if self.journal or self.lock.locked():
                continue  # sessions are live: moving stages now would make them all replay
            try:
                lost = await self._lost_stages()
                if lost:
                    await self.recover(f"idle check: {lost} not answering", [])
                await self._rejoin()
                failures = 0
            except Exception as e:
                failures += 1
                log.warning("checking for lost or returning workers failed (next try in %.0fs): %s",
                            self.options.rejoin_interval * min(2 ** failures, 16), e)

    async def _lost_stages(self) -> str:
        """Names of current workers (stages and expert holders) that do not answer (or no longer hold their
        part)."""
        stages = list(self.backend.workers)
        answers = await asyncio.gather(*(w.info(self._probe_timeout()) for w in stages), return_exceptions=True)
        return ", ".join(w.name for w, a in zip(stages, answers, strict=True)
                         if isinstance(a, BaseException) or a.state != "ready" or a.assigned != (w.start, w.end))

    async def _rejoin(self) -> None:
        in_use = list(dict.fromkeys(w.address for w in self.backend.workers))  # in plan order: the same ranges
        extra = [a for a in dict.fromkeys([*self.known, *await self._discovered()]) if a not in in_use]
        if not extra:
            return
        new = await probe_workers(self.spec, extra, quiet=True, timeout=self._probe_timeout())
        if not new:
            return
        current = await probe_workers(self.spec, in_use, quiet=True, timeout=self._probe_timeout())
        workers = current + new
        try:
            better = len(plan_cluster(self.spec, self.cfg, workers).workers) > len(self.plan.workers)
        except DeltafinError:
            better = False
        if not better or self.journal:
            await asyncio.gather(*(c.close() for c, _ in workers))
            return
        async with self.lock.exclusive():
            if self.journal:  # a request started meanwhile: not now
                await asyncio.gather(*(c.close() for c, _ in workers))
                return
            backend, plan = await assign_plan(self.spec, self.cfg, workers, show_progress=False, reuse=True)
            old, self.backend, self.plan = self.backend, backend, plan
            self.known = list(dict.fromkeys([*self.known, *(w.address for w in backend.workers)]))
            with contextlib.suppress(Exception):
                await old.close()
            self._mark_stale(self.journal)
        log.warning("worker(s) %s joined; new plan %s%s", ", ".join(d.name for _, d in new),
                    " | ".join(f"{w.name} {w.start}-{w.end - 1}" for w in self.backend.stages),
                    "".join(f" | {w.name} experts" for w in self.backend.holders))


def experts_moved(before: Plan | None, after: Plan) -> str:
    """What a re-plan did to the wide experts, in words ("" when nothing moved): the holders that left, with
    the share each had and who holds those experts now, and the holders that joined."""
    if before is None:
        return ""
    a, b = before.experts, after.experts
    if a is None and b is None or a == b:
        return ""
    if a is None or b is None:
        return f"experts are now {'wide' if b is not None else 'local to each stage'}"
    names = {w.key: w.worker for w in (*before.workers, *after.workers)}
    left = [h for h in a.holders if h not in b.holders]
    joined = [h for h in b.holders if h not in a.holders]
    parts = []
    for h in left:
        takers = [names[x] for i, x in enumerate(b.holders)
                  if any(set(b.share(i, layer)) & set(a.share(a.holders.index(h), layer)) for layer in b.layers)]
        parts.append(f"{names[h]}'s experts ({a.describe(a.holders.index(h))}) moved to {', '.join(takers)}")
    parts += [f"{names[h]} joined as an expert holder ({b.describe(b.holders.index(h))})" for h in joined]
    return "wide experts: " + ("; ".join(parts) if parts else "shares rebalanced")


async def connect_cluster(spec: ClusterSpec, show_progress: bool = True,
                          recovery: RecoveryOptions | None = None) -> tuple[ResilientCluster, Plan]:
    """Find the workers, plan, load the stages; the result recovers from losing workers."""
    cfg = load_config(spec.model_dir)
    backend, plan = await assign_plan(spec, cfg, await find_workers(spec), show_progress)
    return ResilientCluster(spec, cfg, backend, plan, recovery), plan
