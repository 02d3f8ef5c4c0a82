"""A stage's hidden states on their way to the next stage through the coordinator, part by part (cut-through).

Where a hop is relayed (plan/timing/hops.py; else the workers hand the states over themselves, worker/handoff.py), a
stage's output states come to the coordinator and go on to the next stage. Waiting for the
whole output before sending it on puts the two links one after the other; a long prompt's states are tens of MB
at K3's width, half a minute each way over Wi-Fi. Relayed, each part (1 MB, worker_client.PART_BYTES) goes on as it
comes, so both links carry the states at once and the hop costs about one crossing. The next stage's call starts
with the first part; it computes once the last has come, as before (a failed or cancelled stream changes no
session there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from deltafin.runtime.stage_io import SeqInput
from deltafin.transport import codec, forward_parts
from deltafin.transport.generated import deltafin_pb2 as pb


class Relay:
    """One hop's parts: `put` each response part of the stage before (in order), `close` after its last;
    the next stage's call reads `parts()`. `on_first` runs at the first part (it starts that call)."""

    def __init__(self, batch: list[SeqInput], all_logits: bool, request_id: str, part_bytes: int,
                 on_first: Callable[[], None], hand_to: str = "", lost_after: float = 0.0):
        """`hand_to`, `lost_after`: the next stage's call hands its own outputs on (ForwardRequest's fields)."""
        # a hop changes only a sequence's tensors: the forward's own inputs give every other field
        self._sequences = {b.session_id: b for b in batch}
        self._all_logits, self._request_id, self._part_bytes = all_logits, request_id, part_bytes
        self._queue: asyncio.Queue[pb.ForwardRequest | None] = asyncio.Queue()
        self._on_first: Callable[[], None] | None = on_first
        self._hand_to, self._lost_after = hand_to, lost_after

    def put(self, part: pb.ForwardResponse) -> None:
        """One part of the stage's outputs (a slice of some sequences' states), as the next stage's input."""
        pieces = codec.decode_outputs(list(part.sequences))
        for request in forward_parts.next_stage_parts(pieces, self._sequences, self._all_logits, self._request_id,
                                                      self._part_bytes):
            request.hand_to, request.lost_after = self._hand_to, self._lost_after
            self._queue.put_nowait(request)
        if self._on_first is not None:
            start, self._on_first = self._on_first, None
            start()

    def close(self) -> None:
        self._queue.put_nowait(None)

    @property
    def started(self) -> bool:
        return self._on_first is None

    async def parts(self) -> AsyncIterator[pb.ForwardRequest]:
        while (part := await self._queue.get()) is not None:
            yield part
