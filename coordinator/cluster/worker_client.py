"""The coordinator's side of one worker: a channel to it and every call it is asked, each signed with the cluster key
(when there is one), under a deadline, and a forward watched for signs of life (transport/liveness.py); the
timeouts all of them run under (`Timeouts`, stated by `plan`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from deltafin.coordinator.cluster.relay import Relay
from deltafin.errors import RemoteError, WorkerLost
from deltafin.plan.cluster.expert_placement import ExpertPlacement
from deltafin.plan.cluster.links import Link
from deltafin.plan.memory.stage_plan import StagePlan
from deltafin.runtime.prefix_store import HeldPrefixes
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.runtime.stage_options import AssignmentOptions
from deltafin.runtime.worker_stats import StageStats
from deltafin.transport import codec, forward_parts, worker_info
from deltafin.transport.auth import ClusterSecurity
from deltafin.transport.echo import measure
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from deltafin.transport.liveness import Silent, Watch, await_watched, receiving, sending, sending_async
from deltafin.transport.protocol import DEFAULT_MAX_MESSAGE

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
        self.closed = False  # closed (a new plan replaced it): its calls in flight end cancelled
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

    async def assign(self, start: int, end: int, fingerprint: str, options: AssignmentOptions,
                     plan: StagePlan | None = None, progress: Any = None,
                     experts: ExpertPlacement | None = None) -> None:
        """Load layers [start, end) (with wide experts, start == end == 0: an expert holder only) as `plan`
        says (None: as the worker plans them within its own budget), computing and reading as `options`
        say."""
        request = pb.Assignment(start=start, end=end, model_fingerprint=fingerprint,
                                options=codec.encode_stage_options(options))
        if plan is not None:
            request.plan.CopyFrom(codec.encode_stage_plan(plan))
        if experts is not None:
            request.experts.CopyFrom(codec.encode_expert_placement(experts))
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
                      relay: Relay | None = None, hand_to: str = "", handed_from: str = "") -> list[SeqOutput]:
        """One stage's forward, watched (transport/liveness.py): if the worker shows no sign of life (a probe
        answered, a part of the call sent or received) for `lost_after` seconds, the call is abandoned with
        WorkerLost (a frozen process never reaches its deadline otherwise). The probes' answers say how far the
        forward is: `progress(layers done, layers)`. `relayed`: the inputs come part by part from the stage
        before (`batch` names the sequences and their tokens); `relay`: each output part goes on to the next
        stage as it comes (coordinator/cluster/relay.py). `hand_to`: the worker hands its outputs to the next stage's
        worker at that address itself (worker/handoff.py) and answers only their features (states None), or, where
        it could not, the outputs; `handed_from`: the inputs were handed to this worker under that request id
        (`batch` then only counts the tokens)."""
        tokens = sum(item.num_tokens for item in batch)
        deadline = self.timeouts.forward_deadline(tokens)

        async def probe() -> None:
            info = await self.probes.Info(pb.InfoRequest(), timeout=self.timeouts.probe_interval,
                                          metadata=self._md("Info"))
            if progress is not None and info.forward_layers:
                progress(info.forward_layers_done, info.forward_layers)

        # in parts: a long prompt's states (or the ones that come back) may be larger than one message
        watch = Watch()
        parts = (sending_async(relayed.parts(), watch) if relayed is not None else  # the relay sets hand_to
                 sending(self._requests(batch, all_logits, request_id, hand_to, handed_from), watch))
        call = self.stub.ForwardParts(parts, timeout=deadline, metadata=self._md("ForwardParts"))
        try:
            response = await await_watched(call, probe, self.timeouts.probe_interval, self.timeouts.lost_after,
                                           receiving(call, watch, relay.put if relay is not None else None), watch)
        except Silent as e:
            raise WorkerLost(f"{self.name} ({self.address})", e.seconds) from None
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        if response and response[0].handed:
            return forward_parts.decode_handed(response)
        return forward_parts.decode_output_parts(response)

    def _requests(self, batch: list[SeqInput], all_logits: bool, request_id: str, hand_to: str,
                  handed_from: str) -> list[pb.ForwardRequest]:
        """A forward's request parts (`forward` says what `hand_to` and `handed_from` are)."""
        requests = ([pb.ForwardRequest(request_id=request_id, all_logits=all_logits, part_bytes=self.part_bytes,
                                       handed_from=handed_from)] if handed_from else
                    forward_parts.encode_request_parts(batch, all_logits, request_id, self.part_bytes))
        requests[0].hand_to, requests[0].lost_after = hand_to, self.timeouts.lost_after if hand_to else 0.0
        return requests

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

    async def stats(self) -> StageStats:
        try:
            r = await self.stub.Stats(pb.StatsRequest(), timeout=self.timeouts.control, metadata=self._md("Stats"))
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        except asyncio.CancelledError:
            if not self.closed:
                raise
            # a new plan closed this client while /health or /metrics asked it: a failed call, not a cancelled request
            raise RemoteError(f"{self.name} ({self.address})", grpc.StatusCode.CANCELLED, "replaced by a new plan") \
                from None
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
        self.closed = True
        await asyncio.gather(self.channel.close(), self.probe_channel.close())
