"""Wide experts between workers: the other holders as this worker's stage reaches them, over gRPC.

A stage thread sends a layer's expert calls (wide.Peer) and waits for them while it computes its own share; the
calls themselves run on the worker's event loop, signed with the cluster key and over TLS exactly as the
coordinator's calls are (a worker that serves TLS calls its peers with TLS, presenting its own certificate for
mutual TLS). Each call is watched (transport/liveness.py): a holder that answers no liveness probe (sent over a
channel of their own, never behind a call's data) for `lost_after` seconds is lost, and the stage's forward fails
with UNAVAILABLE naming it, which the coordinator recovers from by planning again.
Calls bigger than the message cap go in pieces of whole experts (wide.call_pieces).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future

import grpc
import torch

from deltafin.errors import CodecError, HolderError
from deltafin.plan.cluster.expert_placement import ExpertPlacement, Holder
from deltafin.plan.cluster.links import Link
from deltafin.runtime.wide import ExpertCall, call_pieces
from deltafin.transport import codec
from deltafin.transport.auth import ClusterSecurity
from deltafin.transport.codec import Hints
from deltafin.transport.echo import measure
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from deltafin.transport.liveness import Silent, Watch, await_watched, receiving
from deltafin.transport.ports import check_address
from deltafin.transport.protocol import DEFAULT_MAX_MESSAGE

log = logging.getLogger(__name__)

SERVICE = "/deltafin.v1.Worker/"
HINT_TIMEOUT = 5.0  # seconds a hint may take before it is dropped (it only starts reads early)
LINK_TIMEOUT = 30.0  # seconds one probe of a link may take (its largest transfer, on a slow link)
CALL_UNIT = 512  # tokens of the call timeout's unit (the coordinator's --forward-timeout is per 512 tokens)


class GrpcPeer:
    """One holder (see the module docstring). Created and closed on the worker's event loop; `call` and `hint`
    are made from the stage's thread."""

    def __init__(self, holder: Holder, plan: ExpertPlacement, expert_dim: int, loop: asyncio.AbstractEventLoop,
                 security: ClusterSecurity, max_message_bytes: int = DEFAULT_MAX_MESSAGE):
        self.holder, self.plan, self.loop, self.security = holder, plan, loop, security
        self.name = holder.name or holder.address
        self.expert_dim, self.max_message_bytes = expert_dim, max_message_bytes
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 2000), ("grpc.use_local_subchannel_pool", 1)]
        self.channel = security.channel(holder.address, options)
        self.stub = pb_grpc.WorkerStub(self.channel)
        # the liveness probes on a connection of their own: they never queue behind a call's bulk data
        self.probe_channel = security.channel(holder.address, options)
        self.probes = pb_grpc.WorkerStub(self.probe_channel)
        self._hints: set[Future] = set()

    def _md(self, method: str) -> tuple[tuple[str, str], ...] | None:
        return self.security.metadata(SERVICE + method)

    # ---- wide.Peer -------------------------------------------------------------------------------------------

    def call(self, call: ExpertCall) -> Callable[[], torch.Tensor]:
        pieces = call_pieces(call, self.max_message_bytes - self.max_message_bytes // 8)
        futures = [asyncio.run_coroutine_threadsafe(self._run(codec.encode_expert_call(piece),
                                                              int(piece.z.shape[0]), piece.bf16), self.loop)
                   for _, piece in pieces]

        def finish() -> torch.Tensor:  # on the stage's thread: each piece's deadline and probes bound the wait
            if len(pieces) == 1:
                return futures[0].result()
            out = torch.zeros(int(call.z.shape[0]), self.expert_dim, dtype=torch.float32)
            for (rows, _), fut in zip(pieces, futures, strict=True):  # the pieces' sums, in their order
                out[rows] += fut.result()
            return out

        return finish

    def hint(self, hints: Hints, ahead: bool = False) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._hint(codec.encode_expert_call(None, hints, ahead)), self.loop)
        self._hints.add(fut)
        fut.add_done_callback(self._hints.discard)

    # ---- on the event loop -----------------------------------------------------------------------------------

    async def _run(self, request: pb.ExpertRequest, tokens: int, bf16: bool) -> torch.Tensor:
        """The call's sums [tokens, De] fp32, put together from the parts the holder sends as its rows are done."""
        deadline = self.plan.call_timeout * max(1.0, tokens / CALL_UNIT)
        rpc = self.stub.RunExperts(request, timeout=deadline, metadata=self._md("RunExperts"))
        probe = lambda: self.probes.Info(pb.InfoRequest(), timeout=self.plan.probe_interval, metadata=self._md("Info"))
        who = f"{self.name} ({self.holder.address})"
        out = torch.empty(tokens, self.expert_dim, dtype=torch.float32)
        got = torch.zeros(tokens, dtype=torch.bool)
        watch = Watch()

        def part(msg: pb.ExpertResponse) -> None:  # each as it comes: its rows' sums in place
            rows, sums = codec.decode_tensor(msg.rows, "expert rows"), codec.decode_tensor(msg.outputs, "expert sums")
            want = torch.bfloat16 if bf16 else torch.float32
            if rows.dtype != torch.int64 or rows.dim() != 1 or sums.dtype != want or \
                    tuple(sums.shape) != (rows.shape[0], self.expert_dim):
                raise CodecError(f"a part of {sums.dtype} {list(sums.shape)} for rows {rows.dtype} {list(rows.shape)}")
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= tokens or bool(got[rows].any())
                                 or rows.unique().numel() != rows.numel()):
                raise CodecError(f"a part names rows outside [0, {tokens}) or already answered")
            out[rows], got[rows] = sums.float(), True

        try:
            await await_watched(rpc, probe, self.plan.probe_interval, self.plan.lost_after, receiving(rpc, watch, part),
                                watch)
            if not bool(got.all()):
                raise CodecError(f"answered {int(got.sum())} of {tokens} rows")
        except Silent as e:
            raise HolderError(who, "UNAVAILABLE", f"has not answered for {e.seconds:.1f}s: treating it as lost") \
                from None
        except grpc.aio.AioRpcError as e:
            raise HolderError(who, e.code().name, e.details() or "") from None
        except CodecError as e:
            rpc.cancel()
            raise HolderError(who, "DATA_LOSS", str(e)) from None
        return out

    async def _hint(self, request: pb.ExpertRequest) -> None:
        try:
            async for _ in self.stub.RunExperts(request, timeout=HINT_TIMEOUT, metadata=self._md("RunExperts")):
                pass  # a hint is answered with no part
        except grpc.aio.AioRpcError as e:  # a lost hint costs a later read, never a result
            log.debug("hint to %s failed: %s", self.name, e.code().name)

    async def close(self) -> None:
        await asyncio.gather(self.channel.close(), self.probe_channel.close())


class Peers:
    """The worker's channels to the other holders of its current expert plan, kept across plans for the holders
    that stay (same worker, same address)."""

    def __init__(self, security: ClusterSecurity, max_message_bytes: int = DEFAULT_MAX_MESSAGE):
        self.security, self.max_message_bytes = security, max_message_bytes
        self.peers: dict[str, GrpcPeer] = {}

    async def update(self, plan: ExpertPlacement, me: str, expert_dim: int) -> dict[str, GrpcPeer]:
        """Channels to every holder of `plan` but `me` (on the event loop); those no longer in it are closed."""
        loop = asyncio.get_running_loop()
        wanted = {h.key: h for h in plan.holders if h.key != me}
        for key in list(self.peers):
            peer = self.peers[key]
            if key not in wanted or wanted[key].address != peer.holder.address:
                await self.peers.pop(key).close()
        for key, holder in wanted.items():
            if key in self.peers:
                self.peers[key].plan, self.peers[key].holder = plan, holder
            else:
                self.peers[key] = GrpcPeer(holder, plan, expert_dim, loop, self.security, self.max_message_bytes)
        return dict(self.peers)

    async def measure(self, address: str) -> Link:
        """This worker's link to the worker at `address` (transport/echo.py), over a channel of its own."""
        check_address(address, "a link's far end")
        tls = self.security.tls
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", self.max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]
        async with (grpc.aio.secure_channel(address, tls.credentials(), options=options + tls.options())
                    if tls is not None else grpc.aio.insecure_channel(address, options=options)) as channel:
            stub = pb_grpc.WorkerStub(channel)

            async def echo(payload: bytes, reply_bytes: int) -> int:  # each call signed afresh (no replays)
                reply = await stub.Echo(pb.EchoRequest(payload=payload, reply_bytes=reply_bytes), timeout=LINK_TIMEOUT,
                                        metadata=self.security.metadata(SERVICE + "Echo"))
                return len(reply.payload)

            try:
                return await measure(echo, address)
            except grpc.aio.AioRpcError as e:
                raise HolderError(address, e.code().name, f"its link cannot be measured: {e.details()}") from None

    async def close(self) -> None:
        for peer in self.peers.values():
            await peer.close()
        self.peers.clear()
