"""The worker's gRPC servicer: thin adapters between the wire format and what the worker was assigned (a
Stage, and with wide experts its share of every MoE layer's experts: deltafin/runtime/assigned.py).

One thread owns the stage (loading and every forward run there, in order: assignment.py holds the stage, its
thread and the Assign transaction); other stages' expert calls run on a thread of their own, so they never queue
behind this worker's forwards. RPC handlers decode, hand the work to those threads, and encode. Every Deltafin
error maps to one gRPC status (transport/grpc_status.py); anything else is logged and answered INTERNAL, and the
worker keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deltafin.checkpoint.shards import Checkpoint
from deltafin.errors import CodecError, DeltafinError, NotAssigned
from deltafin.runtime import wide
from deltafin.runtime.assigned import Assigned
from deltafin.runtime.memory import peak_rss
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.worker_stats import StageStats
from deltafin.transport import codec, forward_parts, worker_info
from deltafin.transport.auth import AuthInterceptor, ClusterSecurity, ServerTls
from deltafin.transport.decoding import DecodeGuard
from deltafin.transport.echo import MAX_REPLY
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from deltafin.transport.grpc_status import status_for
from deltafin.transport.ports import cannot_listen
from deltafin.transport.protocol import DEFAULT_MAX_MESSAGE
from deltafin.transport.worker_info import WorkerDescription
from deltafin.weights.spine_convert import spine_disk
from deltafin.worker.assignment import AssignmentSlot, check_assignment
from deltafin.worker.forwards import Forwards, as_done, until
from deltafin.worker.handoff import Courier, Inbox, handing
from deltafin.worker.peers import Peers

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_HELD_IDS = 4096  # prefix ids one HeldPrefixes call may ask about


class WorkerService(pb_grpc.WorkerServicer):
    """`peer_security`: how this worker signs and encrypts its own calls to other workers (wide experts)."""

    def __init__(self, ckpt: Checkpoint, description: WorkerDescription, device: torch.device,
                 defaults: StageOptions, peer_security: ClusterSecurity | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE):
        self.ckpt, self.device, self.defaults = ckpt, device, defaults
        self.description = description
        self.slot = AssignmentSlot(ckpt, device, lambda: self.description.key)  # what it holds, on its thread
        self.expert_executor = ThreadPoolExecutor(1, thread_name_prefix="deltafin-experts")  # others' calls
        self.peers = Peers(peer_security or ClusterSecurity(), max_message_bytes)
        self.inbox = Inbox()  # states handed here by the stage before (handoff.py)
        self.courier = Courier(peer_security or ClusterSecurity(), max_message_bytes)  # ... and to the next
        self.max_message_bytes = max_message_bytes
        self.forwards = Forwards(self.slot, self._served)
        self.last_served = time.monotonic()  # when a forward or an expert call last ended (worker/idle.py)
        self.serving = 0  # forwards and expert calls in flight

    @property
    def assigned(self) -> Assigned | None:
        return self.slot.assigned

    @property
    def state(self) -> str:
        return self.slot.state

    @property
    def stage(self) -> Stage | None:
        return self.slot.stage

    def idle_for(self) -> float:  # what worker/idle.py reads
        return 0.0 if self.serving else time.monotonic() - self.last_served

    def holds_stage(self) -> bool:
        return self.assigned is not None

    @contextlib.contextmanager
    def _served(self) -> Iterator[None]:
        self.serving += 1
        try:
            yield
        finally:
            self.serving -= 1
            self.last_served = time.monotonic()

    # ---- helpers ---------------------------------------------------------------------------------

    @staticmethod
    @contextlib.asynccontextmanager
    async def _answering(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """What the body raises, as the call's status: a Deltafin error its own (transport/grpc_status.py),
        anything else logged and INTERNAL; a cancelled call stays cancelled, an abort stays as it was."""
        try:
            yield
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            code = status_for(e)
            if not isinstance(e, DeltafinError):
                log.exception("unexpected error")
                await context.abort(code, f"internal error: {type(e).__name__}: {e}")
            await context.abort(code, str(e))

    def info(self) -> WorkerDescription:
        assigned = (self.assigned.start, self.assigned.end) if self.assigned is not None else (0, 0)
        return dataclasses.replace(self.description, state=self.state, assigned=assigned)

    # ---- RPCs --------------------------------------------------------------------------------------

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.WorkerInfo:
        msg = worker_info.encode_info(self.info())
        msg.forward_layers_done, msg.forward_layers = self.forwards.progress
        return msg

    async def Assign(self, request: pb.Assignment, context: grpc.aio.ServicerContext) -> AsyncIterator[
            pb.AssignProgress]:
        async with self._answering(context):
            options, sizing, plan = check_assignment(request, self.description, self.ckpt.config, self.defaults)
            sizing = self.slot.check_fits(request.start, request.end, options, sizing, plan)
            peers = await self.peers.update(plan, self.description.key, self.ckpt.config.expert_dim) if plan else {}
        # the load: closed at once when the coordinator goes away, so the slot closes what it was loading
        loading = self.slot.replace(request.start, request.end, options, sizing, plan, peers)
        async with self._answering(context), contextlib.aclosing(loading):
            async for message, fraction in loading:
                yield pb.AssignProgress(message=message, fraction=fraction)
        what = f"layers {request.start}-{request.end - 1}" if request.end > request.start else "expert holder"
        stage = self.stage
        if stage is not None:  # it may have converted its spine: the next plan knows
            disk = await asyncio.to_thread(spine_disk, self.ckpt, self.defaults.spine_dir)
            self.description = dataclasses.replace(self.description, spine_disk=disk)
        disk = stage.prefixes.disk.budget if stage is not None and stage.prefixes.disk is not None else 0
        yield pb.AssignProgress(message=f"{what} ready", fraction=1.0, ready=True, prefix_disk_bytes=disk,
                                state_identity=stage.identity if stage is not None else "")

    async def Forward(self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext) -> pb.ForwardResponse:
        async with self._answering(context):
            batch = codec.decode_inputs(list(request.sequences))
            outputs = await self.forwards.run(batch, request.all_logits, request.request_id)
            return pb.ForwardResponse(sequences=codec.encode_outputs(outputs))
        return pb.ForwardResponse()  # not reached: a failure aborts

    async def ForwardParts(self, requests: AsyncIterator[pb.ForwardRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ForwardResponse]:
        """A forward in parts each way: outputs the stage has done before its forward ends (Stage.forward's `early`)
        go at once, the rest once it ends."""
        async with self._answering(context):
            msgs = await self.forwards.parts(requests)
            first = msgs[0]
            handed = first.handed_from
            inputs = self.inbox.take(handed) if handed else msgs  # HandOff: handoff.py
            batch, _, _ = forward_parts.decode_request_parts(inputs)
            all_logits, rid = first.all_logits, first.request_id
            cap = self.max_message_bytes - self.max_message_bytes // 8
            part_bytes = min(cap, first.part_bytes or cap)
            outputs = as_done(lambda early: self.forwards.run(batch, all_logits, rid, early), ran=lambda: (
                self.inbox.done(handed) if handed else None))
            if first.hand_to:
                async for part in handing(outputs, self.courier, first, {b.session_id: b for b in batch}, part_bytes,
                                          context.time_remaining()):
                    yield part
                return
            async for outs in outputs:
                for part in forward_parts.encode_output_parts(outs, part_bytes):
                    yield part

    async def HandOff(self, requests: AsyncIterator[pb.ForwardRequest],
                      context: grpc.aio.ServicerContext) -> pb.HandOffAck:
        """The next forward's input parts from the stage before (handoff.py), kept until that forward runs."""
        async with self._answering(context):
            msgs = await self.forwards.parts(requests)
            if not msgs[0].request_id:
                raise CodecError("a hand-off needs its forward's request id")
            return pb.HandOffAck(bytes=self.inbox.put(msgs, 2 * self.forwards.largest()))
        return pb.HandOffAck()  # not reached: a failure aborts

    async def RunExperts(self, request: pb.ExpertRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExpertResponse]:
        """Another stage's expert call, its rows' sums sent as they are done (wide.ExpertHolder.stream)."""
        async with self._answering(context):
            holder = self.assigned.holder if self.assigned is not None else None
            if holder is None:
                raise NotAssigned(f"this worker serves no experts (state: {self.state}); the coordinator must plan "
                                  "wide experts over it")
            call, hints = codec.decode_expert_call(request)
            if call is None:  # hints alone: start the reads now, answer at once
                holder.hint(hints, request.hints_ahead)
                return
            loop = asyncio.get_running_loop()
            parts: asyncio.Queue[tuple[torch.Tensor, torch.Tensor]] = asyncio.Queue()
            with self._served():
                if call.z.shape[0] * call.z.shape[1] * 4 <= wide.SUMS_PART_BYTES:  # one part (a token's): no stream
                    out = await loop.run_in_executor(self.expert_executor, holder.run, call)
                    yield pb.ExpertResponse(rows=codec.encode_tensor(torch.arange(out.shape[0])),
                                            outputs=codec.encode_tensor(out))
                    return
                run = loop.run_in_executor(self.expert_executor, holder.stream, call,
                                           lambda rows, sums: loop.call_soon_threadsafe(parts.put_nowait, (rows, sums)))
                async for rows, sums in until(run, parts):
                    yield pb.ExpertResponse(rows=codec.encode_tensor(rows), outputs=codec.encode_tensor(sums))

    async def FindPrefix(self, request: pb.FindPrefixRequest,
                         context: grpc.aio.ServicerContext) -> pb.FindPrefixResponse:
        async with self._answering(context):
            stage = self.stage
            if stage is None or not stage.first:
                raise NotAssigned("only the first stage knows its kept prefixes' tokens")
            tokens = codec.decode_tensor(request.tokens, "tokens")
            if tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32):
                raise CodecError("FindPrefix takes a 1-D integer tensor of token ids")
            vocab = stage.cfg.vocab_size
            if tokens.numel() and bool(((tokens < 0) | (tokens >= vocab)).any()):
                raise CodecError(f"FindPrefix: token ids must be in [0, {vocab})")
            found = await self.slot.on_stage_thread(stage.prefixes.find, tokens.tolist())
            return pb.FindPrefixResponse(prefix_id=found[0], length=found[1]) if found else pb.FindPrefixResponse()
        return pb.FindPrefixResponse()  # not reached: a failure aborts

    async def HeldPrefixes(self, request: pb.HeldPrefixesRequest,
                           context: grpc.aio.ServicerContext) -> pb.HeldPrefixesResponse:
        async with self._answering(context):
            stage = self.stage
            if stage is None:
                raise NotAssigned("this worker has no stage: it holds no prefixes")
            ids = list(request.prefix_ids)
            if len(ids) > MAX_HELD_IDS or any(len(i) > 128 for i in [*ids, request.logits_for]):
                raise CodecError(f"HeldPrefixes takes at most {MAX_HELD_IDS} ids of at most 128 characters")
            held = await self.slot.on_stage_thread(stage.held_prefixes, ids, request.logits_for or None)
            return codec.encode_held(held)
        return pb.HeldPrefixesResponse()  # not reached: a failure aborts

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        stage = self.stage
        if stage is None:
            return pb.ReleaseResponse(released=0)
        ids, keep, lengths = list(request.session_ids), list(request.keep_as), list(request.keep_lengths)
        for name, given in (("keep_as", keep), ("keep_lengths", lengths)):
            if given and len(given) != len(ids):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{name} has {len(given)} entries for {len(ids)} sessions")
        if any(n < 0 for n in lengths):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "keep_lengths must be >= 0")
        keep, lengths = keep or [""] * len(ids), lengths or [0] * len(ids)
        released = await self.slot.on_stage_thread(
            lambda: sum(stage.release(s, k or None, n) for s, k, n in zip(ids, keep, lengths, strict=True)))
        return pb.ReleaseResponse(released=released)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        flag = self.forwards.running.get(request.request_id)
        if flag is not None:
            flag.set()
        return pb.CancelResponse(cancelled=flag is not None)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        assigned = self.assigned
        stats = assigned.stats(self.description.key) if assigned is not None else StageStats()
        stats = dataclasses.replace(stats, state=self.state, name=self.description.name, rss_peak_bytes=peak_rss(),
                                    handed_on=self.courier.handed, hand_offs_failed=self.courier.failed,
                                    handed_in=self.inbox.received)
        return pb.StatsResponse(stats=codec.encode_stats(stats))

    async def Echo(self, request: pb.EchoRequest, context: grpc.aio.ServicerContext) -> pb.EchoReply:
        if not 0 <= request.reply_bytes <= MAX_REPLY:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reply_bytes must be in [0, {MAX_REPLY}]")
        return pb.EchoReply(payload=bytes(request.reply_bytes))

    async def MeasureLink(self, request: pb.MeasureLinkRequest, context: grpc.aio.ServicerContext
                          ) -> pb.LinkMeasure:
        async with self._answering(context):
            link = await self.peers.measure(request.address)
        return pb.LinkMeasure(rtt_s=link.rtt_s, up_bps=link.up_bps, down_bps=link.down_bps,
                              probe_bytes=link.probe_bytes)

    def close(self) -> None:
        for flag in self.forwards.running.values():
            flag.set()
        self.expert_executor.shutdown(wait=True)
        self.slot.close()


async def expire_sessions(service: WorkerService, idle_seconds: float) -> None:
    """Forever: every so often, drop the sessions of `service`'s stage idle for longer than `idle_seconds`."""
    while True:
        await asyncio.sleep(max(1.0, min(60.0, idle_seconds / 4)))
        stage = service.stage
        if stage is None:
            continue
        gone = await service.slot.on_stage_thread(stage.expire, idle_seconds)
        if gone:
            log.info("expired %d idle sessions (TTL %.0fs)", len(gone), idle_seconds)


async def create_server(service: WorkerService, host: str, port: int,
                        max_message_bytes: int = DEFAULT_MAX_MESSAGE, key: bytes | None = None,
                        tls: ServerTls | None = None) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server for `service` plus the standard health service; returns (server, bound port).
    With `key`, every Worker call must carry the cluster key's signature; with `tls`, only TLS is served."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               ("grpc.so_reuseport", 0)]  # gRPC's default lets a second worker share the port, silently
    interceptors = [*([AuthInterceptor(key)] if key is not None else []), DecodeGuard()]  # the key first
    server = grpc.aio.server(options=options, interceptors=interceptors)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    try:  # gRPC says 0, or (newer) raises RuntimeError, without the reason
        bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise cannot_listen(host, port, "this worker")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("deltafin.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
    service.health = health_servicer  # type: ignore[attr-defined]
    return server, bound
