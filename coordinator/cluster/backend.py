"""Where the coordinator's forwards run: in-process stages (single-machine mode) or a cluster of workers.

Both present one async interface, so the generation loop and the HTTP API never know which they drive.
The cluster is driven by the coordinator (the hub, docs/DESIGN.md): ids to stage 0, its residual state on to stage 1
(relayed by the coordinator, or handed from worker to worker where plan/timing/hops.py says that is faster), and so on;
every call carries a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from deltafin.coordinator.cluster.relay import Relay
from deltafin.coordinator.cluster.worker_client import WorkerClient
from deltafin.errors import RemoteError, WorkerLost
from deltafin.plan.cluster.cluster_plan import ClusterPlan, PlannedStage
from deltafin.plan.timing.predict import verify_table
from deltafin.runtime.compute_probe import measure_compute
from deltafin.runtime.features import Features, gather
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.prefix_store import HeldPrefixes, PrefixBudget
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.runtime.worker_stats import StageStats
from deltafin.weights.diskspeed import measure_disk

log = logging.getLogger(__name__)


class Backend(Protocol):
    @property
    def max_forward_tokens(self) -> int | None:
        """Tokens one forward may carry (the stages were sized for it); None: no limit."""
        ...

    @property
    def prefix_stages(self) -> list[PrefixBudget]:
        """What every stage keeps prefixes within, for the coordinator's prefix index."""
        ...

    @property
    def context(self) -> int:
        """Tokens a request may have (prompt and reply): what every stage's sessions were planned for."""
        ...

    @property
    def parallel_stages(self) -> int:
        """Stages that can compute at the same time: the scheduler's default number of batches in flight."""
        ...

    async def forward(self, batch: list[SeqInput], all_logits: bool = False,
                      progress: Callable[[float], None] | None = None) -> list[SeqOutput]:
        """The batch through every stage; `progress` hears the fraction of the model's layers done, every few
        seconds at most (a long prompt's forward takes minutes)."""
        ...

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None,
                      keep_lengths: list[int] | None = None) -> None:
        """Free sessions; with `keep_as` (one id each, "" to free), keep each one's state as that prefix, of
        its first `keep_lengths` tokens (one each, 0: all)."""
        ...

    async def stats(self) -> list[StageStats]:
        """Each stage's counters, in the plan's order."""
        ...

    async def find_prefix(self, tokens: list[int]) -> tuple[str, int] | None:
        """The first stage's longest kept prefix of `tokens` (memory or disk): (its id, its length)."""
        ...

    async def held_prefixes(self, prefix_ids: list[str], logits_for: str | None = None) -> HeldPrefixes:
        """Which of `prefix_ids` every stage holds (with the same length on each), and the last stage's logits
        kept with `logits_for`."""
        ...

    def resuming(self, prefix_id: str, tokens: list[int]) -> None:
        """A request resumes from this kept prefix, which holds `tokens`: a backend that rebuilds sessions after
        losing a worker must know how to feed it again (it may have been kept before this coordinator started)."""
        ...

    async def close(self) -> None: ...


class LocalBackend:
    """Single-machine mode: the same stages in this process, run on one thread of their own."""

    def __init__(self, pipeline: LocalPipeline):
        self.pipeline = pipeline
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="deltafin-local")
        self._priced: ClusterPlan | None = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @property
    def max_forward_tokens(self) -> int | None:
        return self.pipeline.max_forward_tokens

    @property
    def prefix_stages(self) -> list[PrefixBudget]:
        return [PrefixBudget(s.start, s.end, s.prefixes.budget, s.dtype.itemsize,
                             s.prefixes.disk.budget if s.prefixes.disk is not None else 0,
                             s.plan.context, s.identity) for s in self.pipeline.stages]

    @property
    def context(self) -> int:
        return min(s.plan.context for s in self.pipeline.stages)

    @property
    def parallel_stages(self) -> int:
        return 1  # the stages run one after another on this process's one stage thread

    def priced_plan(self) -> ClusterPlan:
        """The in-process stages as a one-worker plan, for what the predictions price (drafting's pass cost): their
        sizing, this machine's compute measured on the stages' device (runtime/compute_probe.py) and, where
        anything streams, its disk (the --disk-gbps given, else measured). Measured once, at the first call."""
        if self._priced is None:
            self._priced = self._price()
        return self._priced

    def _price(self) -> ClusterPlan:
        stages = self.pipeline.stages
        first = stages[0]
        streams = any(s.plan.streaming or s.plan.streamed_layers for s in stages)
        given = first.options.disk_gbps
        gbps = (given[0] if given else measure_disk(first.ckpt, first.options.sizing.read_threads, first.options.io)) \
            if streams else 0.0
        compute = measure_compute(first.cfg, first.device, first.dtype)
        plan = ClusterPlan(tuple(PlannedStage("local", "", s.start, s.end, s.plan, 0.0, disk_gbps=gbps, compute=compute)
                          for s in stages))
        return replace(plan, verify=verify_table(first.cfg, plan, first.dtype.itemsize))

    async def forward(self, batch: list[SeqInput], all_logits: bool = False,
                      progress: Callable[[float], None] | None = None) -> list[SeqOutput]:
        if progress is not None:
            loop = asyncio.get_running_loop()
            heard = progress
            progress = lambda fraction: loop.call_soon_threadsafe(heard, fraction)  # from the stage's thread
        stop = threading.Event()  # a cancelled call stops the stage between layers, not after minutes
        try:
            return await self._run(lambda: self.pipeline.forward(batch, all_logits=all_logits, progress=progress,
                                                                 should_stop=stop.is_set))
        except asyncio.CancelledError:
            stop.set()
            raise

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None,
                      keep_lengths: list[int] | None = None) -> None:
        keep, lengths = keep_as or [""] * len(session_ids), keep_lengths or [0] * len(session_ids)
        await self._run(lambda: [self.pipeline.release(s, k or None, n)
                                 for s, k, n in zip(session_ids, keep, lengths, strict=True)])

    async def stats(self) -> list[StageStats]:
        return await self._run(lambda: [replace(s.stats(), name=f"local-{i}")
                                        for i, s in enumerate(self.pipeline.stages)])

    async def find_prefix(self, tokens: list[int]) -> tuple[str, int] | None:
        return await self._run(self.pipeline.stages[0].prefixes.find, tokens)

    async def held_prefixes(self, prefix_ids: list[str], logits_for: str | None = None) -> HeldPrefixes:
        return all_held(await self._run(lambda: [s.held_prefixes(prefix_ids, logits_for)
                                                 for s in self.pipeline.stages]))

    def resuming(self, prefix_id: str, tokens: list[int]) -> None:
        pass  # in-process stages are never lost

    async def close(self) -> None:
        await self._run(self.pipeline.close)
        self.executor.shutdown(wait=True)


@dataclass(frozen=True)
class Resume:
    """Where a failed forward goes on from: stage `stage`, given `inputs` (its states), or, where the stage before
    handed them to its worker, under the request id `handed` (`inputs` then only count the tokens)."""

    stage: int
    inputs: list[SeqInput]
    handed: str = ""


class ClusterBackend:
    """Stages on workers, called in layer order by the coordinator; with wide experts, `holders` are the workers
    that only serve experts (the stages call them directly)."""

    def __init__(self, stages: list[WorkerClient], max_forward_tokens: int | None = None,
                 prefix_stages: list[PrefixBudget] | None = None, parallel_stages: int | None = None,
                 holders: list[WorkerClient] | None = None, context: int = 0,
                 route: Callable[[int], tuple[bool, ...]] | None = None):
        self.stages = sorted(stages, key=lambda w: w.start)
        self.context = context  # the plan's: tokens a request may have
        self.holders = list(holders or [])
        self.max_forward_tokens = max_forward_tokens
        self.prefix_stages = prefix_stages or []  # as planned (empty: the cluster keeps no prefixes)
        self.parallel_stages = parallel_stages or len(self.stages)
        self.route = route or (lambda tokens: ())  # which hops of a forward of so many tokens go directly

    @property
    def workers(self) -> list[WorkerClient]:
        return [*self.stages, *self.holders]

    def hand_to(self, tokens: int) -> list[str]:
        """Per stage, where a forward of `tokens` tokens goes on from it: the next stage's address where that hop is
        handed over directly (plan/timing/hops.py), else "" (relayed; the last stage: back here)."""
        direct = self.route(tokens)
        return [self.stages[i + 1].address if i < len(direct) and direct[i] else "" for i in range(len(self.stages))]

    async def forward(self, batch: list[SeqInput], all_logits: bool = False, resume: Resume | None = None,
                      progress: Callable[[float], None] | None = None) -> list[SeqOutput]:
        """The batch through every stage, each hop relayed part by part (relay.py: the next stage's call starts
        with the first part of the one before's answer) or handed from worker to worker (`hand_to`: the next
        stage's call starts once it holds them). A failure at stage i carries `resume_at`, a Resume: the stages
        before it have advanced, it and those after have not (a failed forward, or one whose inputs never all came,
        changes no session), so `resume=resume_at` on the same stages finishes the same forward."""
        request_id = uuid.uuid4().hex
        at = resume or Resume(0, batch)
        inputs, layers, last = at.inputs, self.stages[-1].end, len(self.stages) - 1
        hand = self.hand_to(sum(b.num_tokens for b in batch))
        calls: dict[int, asyncio.Task[list[SeqOutput]]] = {}
        handed: dict[int, str] = {}  # the request id each stage's inputs were handed to it under ("": sent)

        def start(i: int, relayed: Relay | None, handed_from: str = "") -> None:
            worker = self.stages[i]
            hop = None if progress is None else (lambda d, _n, at=worker.start: progress((at + d) / layers))
            relay = None if i == last or hand[i] else Relay(
                inputs, all_logits, request_id, self.stages[i + 1].part_bytes, lambda: start(i + 1, relay),
                hand[i + 1], self.stages[i + 1].timeouts.lost_after)
            handed[i] = handed_from
            calls[i] = asyncio.ensure_future(worker.forward(inputs, all_logits, request_id, hop, relayed, relay,
                                                            hand[i], handed_from))
            if relay is not None:
                calls[i].add_done_callback(lambda c: relay.close() if not c.cancelled() and not c.exception() else None)

        start(at.stage, None, at.handed)
        features: list[Features] = [{} for _ in inputs]  # every stage's answers to the draft features asked
        try:
            for i in range(at.stage, last + 1):
                try:
                    outputs = await calls[i]
                except (RemoteError, WorkerLost) as e:
                    e.resume_at = Resume(i, inputs, handed[i])  # type: ignore[attr-defined]
                    raise
                gather([o.features for o in outputs], features)
                if i < last:
                    direct = all(o.state is None for o in outputs)  # handed over (else answered: the fallback too)
                    if not direct:
                        inputs = [b.carrying(o.state) for b, o in zip(inputs, outputs, strict=True)]  # type: ignore[arg-type]
                    if i + 1 not in calls:  # an answer of no parts (nothing relayed): the next call starts whole
                        start(i + 1, None, request_id if direct else "")
            return [dataclasses.replace(o, features=f) for o, f in zip(outputs, features, strict=True)]
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.gather(*(self.cancel_call(self.stages[i], request_id)
                                                  for i, c in calls.items() if not c.done())))
            raise
        finally:
            await _dropped(list(calls.values()))

    @staticmethod
    async def cancel_call(worker: WorkerClient, request_id: str) -> None:
        with contextlib.suppress(RemoteError):  # best effort: the worker also stops when the call's deadline passes
            await worker.cancel(request_id)

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None,
                      keep_lengths: list[int] | None = None) -> None:
        await asyncio.gather(*(w.release(session_ids, keep_as, keep_lengths) for w in self.stages),
                             return_exceptions=True)

    async def stats(self) -> list[StageStats]:
        return list(await asyncio.gather(*(w.stats() for w in self.workers)))

    async def find_prefix(self, tokens: list[int]) -> tuple[str, int] | None:
        """Stage 0's answer; a worker that cannot say (an older one, a failure) finds nothing."""
        try:
            return await self.stages[0].find_prefix(tokens)
        except RemoteError as e:
            log.debug("no kept prefix from %s: %s", self.stages[0].name, e)
            return None

    async def held_prefixes(self, prefix_ids: list[str], logits_for: str | None = None) -> HeldPrefixes:
        """Every stage's answer; a stage that cannot say holds nothing (so nothing is resumed)."""
        answers = await asyncio.gather(*(w.held_prefixes(prefix_ids, logits_for) for w in self.stages),
                                       return_exceptions=True)
        for w, a in zip(self.stages, answers, strict=True):
            if isinstance(a, BaseException):
                log.warning("%s could not say which kept prefixes it holds: %s", w.name, a)
        return all_held([a if isinstance(a, HeldPrefixes) else HeldPrefixes({}) for a in answers])

    def resuming(self, prefix_id: str, tokens: list[int]) -> None:
        pass  # without recovery (ResilientCluster), a lost worker ends the requests it served

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers))


async def _dropped(tasks: list[asyncio.Task]) -> None:
    """Tasks cancelled where they still run, and waited for (nothing left behind, no exception unretrieved)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def all_held(answers: list[HeldPrefixes]) -> HeldPrefixes:
    """The stages' answers as one: the ids every stage holds with the same length, the last stage's logits."""
    if not answers:
        return HeldPrefixes({})
    common = {pid: n for pid, n in answers[0].lengths.items() if all(a.lengths.get(pid) == n for a in answers)}
    return HeldPrefixes(common, answers[-1].logits)
