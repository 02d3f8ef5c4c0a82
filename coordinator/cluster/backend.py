"""Where the coordinator's forwards run: in-process stages (single-machine mode) or a cluster of workers.

Both present one async interface, so the generation loop and the HTTP API never know which they drive.
The cluster routes through the coordinator (the hub, docs/DESIGN.md): ids to stage 0, its residual state to
stage 1, and so on; every call carries a deadline.
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

import grpc
import torch

from deltafin.coordinator.cluster.relay import Relay
from deltafin.errors import RemoteError, WorkerLost
from deltafin.plan.cluster_plan import Plan, StagePlan
from deltafin.plan.expert_placement import ExpertPlan
from deltafin.plan.links import Link
from deltafin.plan.predict import verify_table
from deltafin.plan.sizing import StageSizing
from deltafin.runtime.compute_probe import measure_compute
from deltafin.runtime.features import Features, gather
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.prefix_store import HeldPrefixes, PrefixBudget
from deltafin.runtime.stage import SeqInput, SeqOutput
from deltafin.transport import codec, worker_info
from deltafin.transport.auth import ClusterSecurity
from deltafin.transport.codec import DEFAULT_MAX_MESSAGE
from deltafin.transport.echo import measure
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from deltafin.transport.liveness import Silent, Watch, await_watched, receiving, sending, sending_async
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

    async def stats(self) -> list[dict[str, Any]]: ...

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
        self._priced: Plan | None = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @property
    def max_forward_tokens(self) -> int | None:
        return self.pipeline.max_forward_tokens

    @property
    def prefix_stages(self) -> list[PrefixBudget]:
        return [PrefixBudget(s.start, s.end, s.prefixes.budget, s.dtype.itemsize,
                             s.prefixes.disk.budget if s.prefixes.disk is not None else 0,
                             s.sizing.context, s.identity) for s in self.pipeline.stages]

    @property
    def context(self) -> int:
        return min(s.sizing.context for s in self.pipeline.stages)

    @property
    def parallel_stages(self) -> int:
        return 1  # the stages run one after another on this process's one stage thread

    def priced_plan(self) -> Plan:
        """The in-process stages as a one-worker plan, for what the predictions price (drafting's pass cost): their
        sizing, this machine's compute measured on the stages' device (runtime/compute_probe.py) and, where
        anything streams, its disk (the --disk-gbps given, else measured). Measured once, at the first call."""
        if self._priced is None:
            self._priced = self._price()
        return self._priced

    def _price(self) -> Plan:
        stages = self.pipeline.stages
        first = stages[0]
        streams = any(s.sizing.streaming or s.sizing.streamed_layers for s in stages)
        given = first.options.disk_gbps
        gbps = (given[0] if given else measure_disk(first.ckpt, first.options.sizing.read_threads, first.options.io)) \
            if streams else 0.0
        compute = measure_compute(first.cfg, first.device, first.dtype)
        plan = Plan(tuple(StagePlan("local", "", s.start, s.end, s.sizing, 0.0, disk_gbps=gbps, compute=compute)
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

    async def stats(self) -> list[dict[str, Any]]:
        return await self._run(lambda: [{"name": f"local-{i}", **s.stats(), "sessions": len(s.sessions),
                                         "session_bytes": s.session_bytes(), "layers": [s.start, s.end]}
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


FORWARD_UNIT = 512  # tokens of one default prompt chunk (--prefill-chunk)
PART_BYTES = 1 << 20  # a forward's parts, each way: each one a sign of life (liveness.py), ~8 s apart at 1 Mbit/s


@dataclass
class Timeouts:
    forward: float = 600.0  # deadline of a forward of up to FORWARD_UNIT tokens (it may stream every expert)
    control: float = 15.0  # Info, Release, Stats, Cancel
    assign: float = 3600.0  # loading a stage of K3 reads tens of GB
    probe_interval: float = 2.0  # during a forward, ask the worker whether it is alive this often
    lost_after: float = 10.0  # a worker that has not answered for this long is lost (crashed, frozen, cut off)
    reconnect: float = 15.0  # a worker of the plan that stops answering (a dropped link) is asked again this long
    # before the cluster is planned without it (recovery.py)

    def describe(self) -> str:  # as `plan` states them
        return (f"a stage's forward {self.forward:.0f} s per {FORWARD_UNIT} tokens; a worker silent "
                f"{self.lost_after:g} s during one is lost; one that stops answering is asked again for "
                f"{self.reconnect:g} s (the step retried where it failed) before the cluster is planned without it")

    def forward_deadline(self, tokens: int) -> float:
        """A forward's deadline grows with its tokens: one chunk may read every expert of the stage (the
        `forward` seconds), and compute grows linearly beyond a chunk. Liveness probes, not the deadline,
        catch a dead worker; the deadline only bounds one that is alive and stuck."""
        return self.forward * max(1.0, tokens / FORWARD_UNIT)


SERVICE = "/deltafin.v1.Worker/"


class WorkerClient:
    """A channel to one worker and the layers it serves; every call carries the cluster key's signature
    (when there is a key) and a deadline."""

    def __init__(self, address: str, name: str = "", max_message_bytes: int = DEFAULT_MAX_MESSAGE,
                 timeouts: Timeouts | None = None, security: ClusterSecurity | None = None):
        self.address, self.name = address, name or address
        self.prefix_disk = 0  # what its stage keeps prefixes in on its disk (told when its assignment is ready)
        self.identity = ""  # what its stage's kept states depend on (told when its assignment is ready)
        self.timeouts = timeouts or Timeouts()
        self.security = security or ClusterSecurity()
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   # a restarted worker must be reachable at once: short reconnect backoff, and a channel of
                   # its own (a shared subchannel would still be backing off from the dead process)
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 2000), ("grpc.use_local_subchannel_pool", 1)]
        self.channel = self.security.channel(address, options)
        self.stub = pb_grpc.WorkerStub(self.channel)
        # Info (the liveness probe) on a connection of its own: it never queues behind a forward's bulk data
        self.probe_channel = self.security.channel(address, options)
        self.probes = pb_grpc.WorkerStub(self.probe_channel)
        self.start = self.end = 0
        self.part_bytes = min(PART_BYTES, max_message_bytes - max_message_bytes // 8)  # tensor data a message carries

    def _md(self, method: str) -> Any:
        return self.security.metadata(SERVICE + method)

    def _error(self, e: grpc.aio.AioRpcError) -> RemoteError:
        return RemoteError(f"{self.name} ({self.address})", e.code(), e.details() or "")

    async def info(self, timeout: float | None = None) -> worker_info.WorkerDescription:
        try:
            msg = await self.probes.Info(pb.InfoRequest(), timeout=timeout or self.timeouts.control,
                                         metadata=self._md("Info"))
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        d = worker_info.decode_info(msg, self.address)
        self.name = d.name or self.name
        return d

    async def measure_link(self) -> Link:
        """The coordinator's link to this worker (transport/echo.py)."""
        async def echo(payload: bytes, reply_bytes: int) -> int:
            reply = await self.stub.Echo(pb.EchoRequest(payload=payload, reply_bytes=reply_bytes),
                                         timeout=self.timeouts.control, metadata=self._md("Echo"))
            return len(reply.payload)

        try:
            return await measure(echo, self.address)
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None

    async def measure_link_to(self, address: str) -> Link:
        """This worker's link to the worker at `address`, measured by this worker."""
        try:
            m = await self.stub.MeasureLink(pb.MeasureLinkRequest(address=address), timeout=self.timeouts.control,
                                            metadata=self._md("MeasureLink"))
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return Link(m.rtt_s, m.up_bps, m.down_bps, address, m.probe_bytes)

    async def assign(self, start: int, end: int, fingerprint: str, options: dict[str, Any],
                     sizing: StageSizing | None = None, progress: Any = None,
                     experts: ExpertPlan | None = None) -> None:
        """Load layers [start, end) (with wide experts, start == end == 0: an expert holder only) as `sizing`
        plans them (None: as the worker plans them within its own budget), computing and reading as `options`
        say."""
        request = pb.Assignment(start=start, end=end, model_fingerprint=fingerprint,
                                options=codec.encode_stage_options(options))
        if sizing is not None:
            request.plan.CopyFrom(codec.encode_stage_plan(sizing))
        if experts is not None:
            request.experts.CopyFrom(codec.encode_expert_plan(experts))
        try:
            async for update in self.stub.Assign(request, timeout=self.timeouts.assign, metadata=self._md("Assign")):
                if progress is not None:
                    progress(self, update.message, update.fraction)
                if update.ready:
                    self.prefix_disk, self.identity = update.prefix_disk_bytes, update.state_identity
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        self.start, self.end = start, end

    async def forward(self, batch: list[SeqInput], all_logits: bool, request_id: str,
                      progress: Callable[[int, int], None] | None = None, relayed: Relay | None = None,
                      relay: Relay | None = None) -> list[SeqOutput]:
        """One stage's forward, watched (transport/liveness.py): if the worker shows no sign of life (a probe
        answered, a part of the call sent or received) for `lost_after` seconds, the call is abandoned with
        WorkerLost (a frozen process never reaches its deadline otherwise). The probes' answers say how far the
        forward is: `progress(layers done, layers)`. `relayed`: the inputs come part by part from the stage
        before (`batch` names the sequences and their tokens); `relay`: each output part goes on to the next
        stage as it comes (coordinator/cluster/relay.py)."""
        tokens = sum(item.num_tokens for item in batch)
        deadline = self.timeouts.forward_deadline(tokens)

        async def probe() -> None:
            info = await self.probes.Info(pb.InfoRequest(), timeout=self.timeouts.probe_interval,
                                          metadata=self._md("Info"))
            if progress is not None and info.forward_layers:
                progress(info.forward_layers_done, info.forward_layers)

        # in parts: a long prompt's states (or the ones that come back) may be larger than one message
        watch = Watch()
        parts = (sending_async(relayed.parts(), watch) if relayed is not None else
                 sending(codec.encode_request_parts(batch, all_logits, request_id, self.part_bytes), watch))
        call = self.stub.ForwardParts(parts, timeout=deadline, metadata=self._md("ForwardParts"))
        try:
            response = await await_watched(call, probe, self.timeouts.probe_interval, self.timeouts.lost_after,
                                           receiving(call, watch, relay.put if relay is not None else None), watch)
        except Silent as e:
            raise WorkerLost(f"{self.name} ({self.address})", e.seconds) from None
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return codec.decode_output_parts(response)

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None,
                      keep_lengths: list[int] | None = None) -> int:
        try:
            r = await self.stub.Release(pb.ReleaseRequest(session_ids=session_ids, keep_as=keep_as or [],
                                                          keep_lengths=keep_lengths or []),
                                        timeout=self.timeouts.control, metadata=self._md("Release"))
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return r.released

    async def cancel(self, request_id: str) -> bool:
        try:
            r = await self.stub.Cancel(pb.CancelRequest(request_id=request_id),
                                       timeout=min(self.timeouts.control, 2 * self.timeouts.probe_interval),
                                       metadata=self._md("Cancel"))
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return r.cancelled

    async def stats(self) -> dict[str, Any]:
        try:
            r = await self.stub.Stats(pb.StatsRequest(), timeout=self.timeouts.control, metadata=self._md("Stats"))
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return codec.decode_stats(r.stats)

    async def held_prefixes(self, prefix_ids: list[str], logits_for: str | None = None) -> HeldPrefixes:
        try:
            r = await self.stub.HeldPrefixes(pb.HeldPrefixesRequest(prefix_ids=prefix_ids, logits_for=logits_for or ""),
                                             timeout=self.timeouts.forward, metadata=self._md("HeldPrefixes"))
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return codec.decode_held(r)

    async def find_prefix(self, tokens: list[int]) -> tuple[str, int] | None:
        try:
            r = await self.stub.FindPrefix(pb.FindPrefixRequest(tokens=codec.encode_tensor(torch.tensor(tokens))),
                                           timeout=self.timeouts.control, metadata=self._md("FindPrefix"))
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return (r.prefix_id, r.length) if r.prefix_id else None

    async def close(self) -> None:
        await asyncio.gather(self.channel.close(), self.probe_channel.close())


class ClusterBackend:
    """Stages on workers, called in layer order by the coordinator; with wide experts, `holders` are the workers
    that only serve experts (the stages call them directly)."""

    def __init__(self, stages: list[WorkerClient], max_forward_tokens: int | None = None,
                 prefix_stages: list[PrefixBudget] | None = None, parallel_stages: int | None = None,
                 holders: list[WorkerClient] | None = None, context: int = 0):
        self.stages = sorted(stages, key=lambda w: w.start)
        self.context = context  # the plan's: tokens a request may have
        self.holders = list(holders or [])
        self.max_forward_tokens = max_forward_tokens
        self.prefix_stages = prefix_stages or []  # as planned (empty: the cluster keeps no prefixes)
        self.parallel_stages = parallel_stages or len(self.stages)

    @property
    def workers(self) -> list[WorkerClient]:
        return [*self.stages, *self.holders]

    async def forward(self, batch: list[SeqInput], all_logits: bool = False,
                      resume: tuple[int, list[SeqInput]] | None = None,
                      progress: Callable[[float], None] | None = None) -> list[SeqOutput]:
        """The batch through every stage, each hop relayed part by part (relay.py: the next stage's call starts
        with the first part of the one before's answer). A failure at stage i carries `resume_at = (i, that
        stage's inputs)`: the stages before it have advanced, it and those after have not (a failed forward, or
        one whose inputs never all came, changes no session), so `resume=resume_at` on the same stages finishes
        the same forward."""
        request_id = uuid.uuid4().hex
        first, inputs = (0, batch) if resume is None else resume
        layers, last = self.stages[-1].end, len(self.stages) - 1
        calls: dict[int, asyncio.Task[list[SeqOutput]]] = {}

        def start(i: int, relayed: Relay | None) -> None:
            worker = self.stages[i]
            hop = None if progress is None else (lambda d, _n, at=worker.start: progress((at + d) / layers))
            relay = None if i == last else Relay(inputs, all_logits, request_id, self.stages[i + 1].part_bytes,
                                                 lambda: start(i + 1, relay))
            calls[i] = asyncio.ensure_future(self._stage(worker, inputs, all_logits, request_id, hop, relayed, relay))

        start(first, None)
        features: list[Features] = [{} for _ in inputs]  # every stage's answers to the draft features asked
        try:
            for i in range(first, last + 1):
                try:
                    outputs = await calls[i]
                except (RemoteError, WorkerLost) as e:
                    e.resume_at = (i, inputs)  # type: ignore[attr-defined]
                    raise
                gather([o.features for o in outputs], features)
                if i < last:
                    inputs = [b.carrying(o.state) for b, o in zip(inputs, outputs, strict=True)]  # type: ignore[arg-type]
                    if i + 1 not in calls:  # an answer of no parts (nothing relayed): the next call starts whole
                        start(i + 1, None)
            return [dataclasses.replace(o, features=f) for o, f in zip(outputs, features, strict=True)]
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.gather(*(self.cancel_call(self.stages[i], request_id)
                                                  for i, c in calls.items() if not c.done())))
            raise
        finally:
            await _dropped(list(calls.values()))

    @staticmethod
    async def _stage(worker: WorkerClient, batch: list[SeqInput], all_logits: bool, request_id: str,
                     progress: Callable[[int, int], None] | None, relayed: Relay | None,
                     relay: Relay | None) -> list[SeqOutput]:
        """One stage's call; its relay to the next closed once its answer is whole."""
        outputs = await worker.forward(batch, all_logits, request_id, progress, relayed, relay)
        if relay is not None:
            relay.close()
        return outputs

    @staticmethod
    async def cancel_call(worker: WorkerClient, request_id: str) -> None:
        with contextlib.suppress(RemoteError):  # best effort: the worker also stops when the call's deadline passes
            await worker.cancel(request_id)

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None,
                      keep_lengths: list[int] | None = None) -> None:
        await asyncio.gather(*(w.release(session_ids, keep_as, keep_lengths) for w in self.stages),
                             return_exceptions=True)

    async def stats(self) -> list[dict[str, Any]]:
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
