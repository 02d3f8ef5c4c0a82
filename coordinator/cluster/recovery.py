"""Keep generating when workers fail: a journal of every session's inputs, re-planning, replay.

`ResilientCluster` wraps the ClusterBackend. For every live session it records the token ids fed to
stage 0 and how they were chunked, in a bounded replay journal (journal.py: `journal_tokens` tokens in all).
Hub routing makes that enough: every stage's input is a deterministic function of those ids, so replaying
them in the same chunks rebuilds every cache exactly, bit for bit on the same devices and dtypes, and greedy
decoding continues with the same tokens.

When a forward fails because a worker is gone (connection refused or reset, deadline, no answer to the
liveness probes for `lost_after` seconds) or lost its state (restarted, session expired or evicted), the
coordinator probes every worker it knows (named, discovered, the current ones), plans again over those
that answer, loads the stages whose assignment changed, marks the affected sessions stale and retries.
A stale session is replayed before its next forward. Replay costs one forward per recorded chunk: for
a request that had generated n tokens, 1 + n forwards of the stages that were rebuilt.

If no plan fits the workers that remain, that request fails with ClusterUnavailable (HTTP 503) and the
coordinator keeps serving: the next request tries again, so a returning worker brings the cluster back.
While the cluster is idle, workers that come back or appear (named addresses, Bonjour) are noticed every
`rejoin_interval` seconds (membership.py), and the layers are planned again over them when the plan gets
more workers. Either way the new plan is put in force by one step, CurrentPlan.adopt (current_plan.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from deltafin.checkpoint.config import ModelConfig, load_config
from deltafin.coordinator.cluster.backend import ClusterBackend
from deltafin.coordinator.cluster.current_plan import CurrentPlan
from deltafin.coordinator.cluster.journal import ReplayJournal
from deltafin.coordinator.cluster.membership import Membership
from deltafin.coordinator.cluster.pipelined import Progress, forward_pipelined
from deltafin.coordinator.cluster.rwlock import RWLock
from deltafin.coordinator.cluster.workers import ClusterSpec, assign_plan, find_workers
from deltafin.errors import ClusterUnavailable, DeltafinError, PartialFailure, RemoteError, WorkerLost
from deltafin.plan.cluster.cluster_plan import ClusterPlan
from deltafin.runtime.prefix_store import HeldPrefixes, PrefixBudget
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.runtime.worker_stats import StageStats

log = logging.getLogger(__name__)

# failures that another plan or a replay can fix
GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
STATE_LOST = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
RECONNECT_POLL = 0.5  # seconds between asks of a worker that stopped answering (Timeouts.reconnect bounds them)


@dataclass(frozen=True)
class RecoveryOptions:
    enabled: bool = True
    max_attempts: int = 3  # recoveries for one forward before it fails
    rejoin_interval: float = 5.0  # seconds between looks for returning or new workers while idle (0: never)
    journal_tokens: int = 1 << 22  # tokens recorded across sessions (4 bytes each): 16 MB


@dataclass(frozen=True)
class Recovery:
    cause: str
    seconds: float
    workers: tuple[str, ...]  # the plan's workers afterwards
    replanned: bool


def _gone(e: BaseException) -> bool:
    return isinstance(e, WorkerLost) or isinstance(e, RemoteError) and e.code in GONE


def _recoverable(e: BaseException) -> bool:
    if isinstance(e, WorkerLost):
        return True
    return isinstance(e, RemoteError) and (e.code in GONE or e.code in STATE_LOST)


class ResilientCluster:
    """A Backend over the cluster that survives losing workers (see the module docstring)."""

    def __init__(self, spec: ClusterSpec, cfg: ModelConfig, backend: ClusterBackend, plan: ClusterPlan,
                 options: RecoveryOptions | None = None):
        self.spec, self.cfg = spec, cfg
        self.options = options or RecoveryOptions()
        self.current = CurrentPlan(spec, cfg, backend, plan)
        self.journal = ReplayJournal(self.options.journal_tokens)
        self.recoveries: list[Recovery] = []
        self.reconnecting: dict[str, float] = {}  # the plan's workers asked again after they stopped answering
        self.lock = RWLock()  # forwards share it (batches pipeline through the stages); re-plans take it alone
        self.membership = Membership(self.current, self.journal, self.lock, self.options.rejoin_interval,
                                     lambda cause, sessions: self.recover(cause, sessions))  # looked up per call

    @property
    def backend(self) -> ClusterBackend:
        return self.current.backend

    @property
    def plan(self) -> ClusterPlan:
        return self.current.plan

    def priced_plan(self) -> ClusterPlan:
        """The plan in force, whose predictions price drafting's verification passes."""
        return self.current.plan

    @property
    def max_forward_tokens(self) -> int | None:
        return self.backend.max_forward_tokens

    @property
    def prefix_stages(self) -> list[PrefixBudget]:
        return self.backend.prefix_stages

    @property
    def context(self) -> int:
        return self.backend.context

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
        self.membership.watch()
        attempts, resume = 0, None
        while True:
            try:
                async with self.lock.shared():
                    for item in batch:
                        if item.session_id in self.journal.stale:
                            await self._replay(item)
                    outputs = await self.backend.forward(batch, all_logits, resume, progress)
                if self.options.enabled:
                    self.journal.record(batch)
                return outputs
            except (RemoteError, WorkerLost) as e:
                if not self.options.enabled or not _recoverable(e):
                    self.journal.mark_stale(b.session_id for b in batch)  # earlier stages may have advanced
                    if len(batch) > 1:  # find out which sequence is at fault; the others go on
                        return await self._one_by_one(batch, all_logits)
                    raise
                attempts += 1
                if attempts > 1 and len(batch) > 1:  # recovery did not help the batch: one sequence may be
                    return await self._one_by_one(batch, all_logits)  # beyond rebuilding; the others go on
                if attempts > self.options.max_attempts:
                    raise ClusterUnavailable(f"giving up after {attempts - 1} recoveries; last error: {e}") from None
                # a dropped connection leaves the stage as it was: the step is retried there; lost state (a session
                # or handed states gone) is rebuilt by replaying the sessions (the stages before have advanced)
                at = getattr(e, "resume_at", None) if _gone(e) else None
                event = await self.recover(str(e), [b.session_id for b in batch], retry_hop=at is not None)
                # the stages kept their sessions (e.g. only an expert holder was lost): retry the hop that failed
                resume = at if not event.replanned and at is not None else None

    async def forward_pipelined(self, items: list[SeqInput], progress: list[Progress] | None = None) -> list[SeqOutput]:
        """One sequence's consecutive forwards through the stages at once (pipelined.py). After a failure the
        forwards that passed every stage are recorded, the session marked for replay (earlier stages may have
        taken later forwards), the cluster recovered as for `forward`, and the rest sent again."""
        self.membership.watch()
        out: list[SeqOutput] = []
        attempts = 0
        while True:
            try:
                async with self.lock.shared():
                    if items[0].session_id in self.journal.stale:
                        await self._replay(items[0])
                    got = await forward_pipelined(self.backend, items, progress)
                self._record(items)
                return out + got
            except (RemoteError, WorkerLost) as e:
                done = getattr(e, "done_forwards", 0)
                self._record(items[:done])
                sid = items[0].session_id
                out, items = out + e.outputs[:done], items[done:]  # type: ignore[attr-defined]
                progress = progress[done:] if progress is not None else None
                self.journal.mark_stale([sid])
                attempts += 1
                if not self.options.enabled or not _recoverable(e) or attempts > self.options.max_attempts:
                    raise
                await self.recover(str(e), [sid])

    def _record(self, items: list[SeqInput]) -> None:
        if self.options.enabled:
            for item in items:
                self.journal.record([item])

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None,
                      keep_lengths: list[int] | None = None) -> None:
        for sid, keep in zip(session_ids, keep_as or [""] * len(session_ids), strict=True):
            self.journal.release(sid, keep)
        await self.backend.release(session_ids, keep_as, keep_lengths)

    async def stats(self) -> list[StageStats]:
        return await self.backend.stats()

    async def find_prefix(self, tokens: list[int]) -> tuple[str, int] | None:
        return await self.backend.find_prefix(tokens)

    async def held_prefixes(self, prefix_ids: list[str], logits_for: str | None = None) -> HeldPrefixes:
        async with self.lock.shared():  # not from the stages of a plan being recovered
            return await self.backend.held_prefixes(prefix_ids, logits_for)

    def resuming(self, prefix_id: str, tokens: list[int]) -> None:
        self.journal.know_prefix(prefix_id, tokens, self.max_forward_tokens)

    async def close(self) -> None:
        await self.membership.close()
        await self.backend.close()

    # ---- replay -----------------------------------------------------------------------------------------

    async def _replay(self, item: SeqInput) -> None:
        """Rebuild a session's caches on every stage by feeding its recorded chunks again."""
        sid = item.session_id
        j = self.journal.sessions.get(sid)
        if j is None or item.cache_len == 0:
            self.journal.stale.discard(sid)
            return
        if not j.continues(item.cache_len):
            self.journal.forget(sid)
            raise ClusterUnavailable(f"session {sid[:8]} cannot be rebuilt: its record ends at {j.end} tokens "
                                     f"but the call continues at {item.cache_len}")
        t0 = time.monotonic()
        for fwd in j.forwards():  # the same chunks, speculative ones too: the stages rewind as they did
            await self.backend.forward([dataclasses.replace(fwd, session_id=sid)])
        self.journal.stale.discard(sid)
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

    async def _answering(self) -> list[Any]:
        """The workers that answer. Where one of the plan's does not (a link that dropped: a Wi-Fi roam, a
        re-plugged cable), asked again every RECONNECT_POLL seconds for up to the `reconnect` timeout before the
        cluster is planned without it: back with its sessions, the plan stays and the step is retried there. One
        that answers without its stage (restarted) is not waited for: the plan is made again at once."""
        t0, window = time.monotonic(), self.spec.timeouts.reconnect
        wanted = {w.address: w.name for w in self.backend.workers}
        gone: list[str] = []  # the plan's workers that did not answer the first time
        while True:
            candidates = await self.current.candidates()
            missing = sorted(set(wanted) - {d.address for _, d in candidates})  # one back without its stage answers
            waited = time.monotonic() - t0
            self.reconnecting = {wanted[a]: waited for a in missing} if missing and waited < window else {}
            if not self.reconnecting:
                if missing and window:
                    log.warning("%s did not answer for %.1f s: planning without", _names(wanted, missing), waited)
                elif gone:
                    log.warning("%s answers again after %.1f s", _names(wanted, gone), waited)
                return candidates
            (log.info if gone else log.warning)(
                "%s does not answer: asking again for up to %g s before planning without it (%.1f s so far)",
                _names(wanted, missing), window, waited)
            gone = gone or missing
            await asyncio.sleep(min(RECONNECT_POLL, window - waited))

    async def recover(self, cause: str, sessions: list[str], retry_hop: bool = False) -> Recovery:
        """Plan again over the workers that answer; reload what changed; mark sessions for replay (the failed
        batch's only when the stages are unchanged, and none then when its caller retries the failed hop)."""
        t0 = time.monotonic()
        async with self.lock.exclusive():
            log.warning("cluster problem: %s; checking the workers", cause)
            candidates = await self._answering()
            if not candidates:
                raise ClusterUnavailable(f"no worker answers (after: {cause})")
            before = [(w.address, w.start, w.end) for w in self.backend.stages]
            current = {(d.address, d.assigned) for _, d in candidates if d.state == "ready"}
            try:
                backend, plan = await assign_plan(self.spec, self.cfg, candidates, show_progress=False)
            except DeltafinError as e:
                raise ClusterUnavailable(f"the workers that answer cannot run the model: {e} "
                                         f"(after: {cause})") from None
            after = [(w.address, w.start, w.end) for w in backend.stages]
            replanned = after != before or any((addr, (lo, hi)) not in current for addr, lo, hi in after)
            moved = experts_moved(self.plan, plan)
            if moved:
                log.warning("%s", moved)
            await self.current.adopt(backend, plan)
            self.journal.mark_stale(self.journal.sessions if replanned else [] if retry_hop else sessions)
            event = Recovery(cause, time.monotonic() - t0, tuple(w.name for w in backend.stages), replanned)
            self.recoveries.append(event)
            log.warning("recovered in %.2fs: %s; %s", event.seconds,
                        "new plan " + " | ".join(f"{w.name} {w.start}-{w.end - 1}" for w in backend.stages)
                        if replanned else "same stages", f"{len(self.journal.stale)} sessions to replay"
                        if self.journal.stale else "retrying the step" if retry_hop else "nothing to replay")
            return event

def _names(names: dict[str, str], addresses: list[str]) -> str:
    return ", ".join(names[a] for a in addresses)


def experts_moved(before: ClusterPlan | None, after: ClusterPlan) -> str:
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


async def connect_cluster(spec: ClusterSpec, show_progress: bool = True, recovery: RecoveryOptions | None = None,
                          cfg: ModelConfig | None = None) -> tuple[ResilientCluster, ClusterPlan]:
    """Find the workers, plan, load the stages; the result recovers from losing workers. `cfg`: the model's
    config when the caller has read it already."""
    cfg = cfg or load_config(spec.model_dir)
    backend, plan = await assign_plan(spec, cfg, await find_workers(spec), show_progress)
    return ResilientCluster(spec, cfg, backend, plan, recovery), plan
