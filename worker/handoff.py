"""Stage to stage: a stage's outputs handed straight to the next stage's worker, where the plan says that is faster
than relaying them through the coordinator (plan/timing/hops.py).

The sender (`handing`): a ForwardParts call with `hand_to` runs the forward as always, but sends each part of its
outputs, as the next stage's input parts under the call's request id, to that worker's HandOff (`Courier`: a
channel of its own per address, signed with the cluster key and over TLS as the wide experts' calls are, watched for
signs of life like every long call). Once the next worker holds them all, the coordinator is answered `handed` (the
draft features only). Where the hand-off fails (the link dropped, the worker is gone or silent for `lost_after`),
the sender answers with its outputs as it would have without it, and the coordinator relays them: a failed hop
costs a crossing, never a forward.

The receiver (`Inbox`): keeps each hand-off's parts under its request id until the forward that names it in
`handed_from` has run. A forward that fails or is cancelled before it runs leaves them, so the coordinator can
retry that stage alone (the stage before has advanced its sessions). At most MOST_KEPT hand-offs, as many bytes as
`cap` allows, and none older than KEEP_SECONDS are kept (oldest first out); a forward that names one no longer
here fails with StatesGone, and the coordinator replays its sessions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc

from deltafin.errors import StatesGone
from deltafin.runtime.features import Features
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.transport import forward_parts
from deltafin.transport.auth import ClusterSecurity
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from deltafin.transport.liveness import Silent, Watch, await_watched, sending_async
from deltafin.transport.ports import check_address

log = logging.getLogger(__name__)

SERVICE = "/deltafin.v1.Worker/"
MOST_KEPT = 16  # hand-offs kept at once (a cluster's batches in flight and a prompt's pipelined forwards)
KEEP_SECONDS = 900.0  # a hand-off not claimed in this long is dropped (its forward was given up)
CHANNELS = 4  # next stages' channels kept (a plan has one next stage; a re-plan may bring another)


@dataclass
class _Held:
    parts: list[pb.ForwardRequest]
    nbytes: int
    at: float


class Inbox:
    """What stages before handed this worker (see the module docstring); used on the worker's event loop."""

    def __init__(self, most: int = MOST_KEPT, keep_seconds: float = KEEP_SECONDS):
        self.most, self.keep_seconds = most, keep_seconds
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self.received = 0  # hand-offs taken in

    def put(self, parts: list[pb.ForwardRequest], cap: int) -> int:
        """Keep a whole hand-off (its parts, under their request id), hand-offs within `cap` bytes in all; its
        bytes."""
        now, nbytes = time.monotonic(), sum(p.ByteSize() for p in parts)
        for rid in [r for r, h in self._held.items() if now - h.at > self.keep_seconds]:
            log.info("dropped the states handed for %s: not claimed in %.0f s", rid[:8], self.keep_seconds)
            del self._held[rid]
        self._held[parts[0].request_id] = _Held(parts, nbytes, now)
        self.received += 1
        while len(self._held) > 1 and (len(self._held) > self.most or self.nbytes > cap):
            rid, gone = self._held.popitem(last=False)
            log.warning("dropped the states handed for %s (%.1f MB) to make room", rid[:8], gone.nbytes / 1e6)
        return nbytes

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self._held.values())

    def take(self, request_id: str) -> list[pb.ForwardRequest]:
        """The parts handed under `request_id` (kept until `done`), or StatesGone."""
        held = self._held.get(request_id)
        if held is None:
            raise StatesGone(f"the states handed to this worker for {request_id[:8]} are not here (never whole, or "
                             "dropped): the sessions are rebuilt")
        return held.parts

    def done(self, request_id: str) -> None:
        """Its forward ran: the stage has taken the states into its sessions."""
        self._held.pop(request_id, None)


class Courier:
    """Hands forwards' outputs to next stages' workers, one channel (and one for liveness probes) per address."""

    def __init__(self, security: ClusterSecurity, max_message_bytes: int):
        self.security = security
        self.options = [("grpc.max_receive_message_length", max_message_bytes),
                        ("grpc.max_send_message_length", max_message_bytes),
                        ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                        ("grpc.max_reconnect_backoff_ms", 2000), ("grpc.use_local_subchannel_pool", 1)]
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, grpc.aio.Channel]] = OrderedDict()
        self.handed = self.failed = 0  # hand-offs made, and those that fell back to the coordinator

    async def _stubs(self, address: str) -> tuple[pb_grpc.WorkerStub, pb_grpc.WorkerStub]:
        if address not in self._channels:
            check_address(address, "the next stage's worker")
            self._channels[address] = (self.security.channel(address, self.options),
                                       self.security.channel(address, self.options))
            while len(self._channels) > CHANNELS:
                for channel in self._channels.popitem(last=False)[1]:
                    await channel.close()
        self._channels.move_to_end(address)
        data, probes = self._channels[address]
        return pb_grpc.WorkerStub(data), pb_grpc.WorkerStub(probes)

    async def hand(self, address: str, parts: AsyncIterator[pb.ForwardRequest], deadline: float | None,
                   lost_after: float) -> bool:
        """Send `parts` to the worker at `address`; whether it holds them all (a failure is logged, not raised)."""
        interval = min(2.0, lost_after / 3)
        try:
            stub, probes = await self._stubs(address)
            watch = Watch()
            call = stub.HandOff(sending_async(parts, watch), timeout=deadline,
                                metadata=self.security.metadata(SERVICE + "HandOff"))
            probe = lambda: probes.Info(pb.InfoRequest(), timeout=interval,
                                        metadata=self.security.metadata(SERVICE + "Info"))
            await await_watched(call, probe, interval, lost_after, None, watch)
            self.handed += 1
            return True
        except Silent as e:
            log.warning("the next stage (%s) was silent for %.1f s: answering with the states", address, e.seconds)
        except grpc.aio.AioRpcError as e:
            log.warning("could not hand the states to the next stage (%s): %s: %s; answering with them", address,
                        e.code().name, e.details())
        except Exception:  # the stage has run: whatever went wrong here, its outputs still reach the coordinator
            log.exception("could not hand the states to the next stage (%s); answering with them", address)
        self.failed += 1
        return False

    async def close(self) -> None:
        for pair in self._channels.values():
            for channel in pair:
                await channel.close()
        self._channels.clear()


async def handing(outputs: AsyncIterator[list[SeqOutput]], courier: Courier, first: pb.ForwardRequest,
                  inputs: Mapping[str, SeqInput], part_bytes: int, deadline: float | None
                  ) -> AsyncIterator[pb.ForwardResponse]:
    """A forward's answer where its outputs go to the next stage (`first.hand_to`): each part of `outputs` sent on
    as it comes; `handed` with the features once all are there, else every output part as without a hand-off."""
    queue: asyncio.Queue[pb.ForwardRequest | None] = asyncio.Queue()
    sent = asyncio.ensure_future(courier.hand(first.hand_to, _drained(queue), deadline, first.lost_after or 10.0))
    kept: list[list[SeqOutput]] = []
    features: dict[str, Features] = {}
    try:
        async for outs in outputs:
            kept.append(outs)
            for o in outs:
                features.setdefault(o.session_id, {}).update(o.features)
            if not sent.done():
                for part in forward_parts.next_stage_parts(outs, inputs, first.all_logits, first.request_id,
                                                           part_bytes):
                    queue.put_nowait(part)
        queue.put_nowait(None)
        handed = await sent
    finally:
        if not sent.done():
            sent.cancel()
    if handed:
        yield forward_parts.encode_handed(features)
        return
    for outs in kept:
        for part in forward_parts.encode_output_parts(outs, part_bytes):
            yield part


async def _drained(queue: asyncio.Queue[pb.ForwardRequest | None]) -> AsyncIterator[pb.ForwardRequest]:
    while (part := await queue.get()) is not None:
        yield part
