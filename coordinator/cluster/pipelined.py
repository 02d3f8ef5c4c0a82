"""One prompt's forwards through a cluster's stages at once (stage-to-stage pipelining of a long prompt).

A prompt longer than a forward goes in several (plan/timing/predict.py forward_lengths). One after another, each waits
for the one before it to pass every stage, so while stage 1 computes, stage 0 is idle. Here forward k goes to
stage i as soon as stage i has done forward k - 1 and stage i - 1 forward k: the forwards are the same (each stage
reads its experts once per forward either way), they only overlap, so a prompt of k forwards over S stages takes
about the sum of one forward's stages plus k - 1 times the slowest stage, instead of k times the sum. The answer
is the same, bit for bit: every stage sees the same inputs in the same order.

A failure cancels the calls in flight and raises with `done_forwards` (how many leading forwards passed every
stage) and their `outputs`: the stages before the one that failed may have taken later forwards, so the caller
marks the session for replay (recovery.py) and goes on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Sequence

from deltafin.coordinator.cluster.backend import ClusterBackend
from deltafin.runtime.features import Features, gather
from deltafin.runtime.stage_io import SeqInput, SeqOutput

Progress = Callable[[float], None] | None


async def forward_pipelined(backend: ClusterBackend, items: Sequence[SeqInput],
                            progress: Sequence[Progress] | None = None) -> list[SeqOutput]:
    """`items`, one sequence's consecutive forwards, through every stage of `backend` at once (the module
    docstring); `progress[k]` hears forward k's fraction of the model's layers done. Their last stage's outputs,
    each with the features every stage answered."""
    stages, layers = backend.stages, backend.stages[-1].end
    requests = [uuid.uuid4().hex for _ in items]
    calls: list[list[asyncio.Task[list[SeqOutput]]]] = []
    features: list[Features] = [{} for _ in items]
    hand = [backend.hand_to(item.num_tokens) for item in items]  # each hop relayed or handed over (backend.py)

    async def call(k: int, i: int) -> list[SeqOutput]:
        inputs, handed = [items[k]], ""
        if i > 0:
            before = await calls[k][i - 1]
            if before[0].state is None:  # the stage before handed its outputs to this one's worker
                handed = requests[k]
            else:
                inputs = [items[k].carrying(before[0].state)]
        if k > 0:
            await calls[k - 1][i]  # this stage's forwards in order (a failed one fails this one too)
        heard = progress[k] if progress is not None else None
        hop = None if heard is None else (lambda d, _n, at=stages[i].start: heard((at + d) / layers))
        outputs = await stages[i].forward(inputs, False, requests[k], hop, hand_to=hand[k][i], handed_from=handed)
        gather([o.features for o in outputs], features[k:k + 1])
        if heard is not None and i == len(stages) - 1:
            heard(1.0)  # through (a worker says how far it is every few seconds at most)
        return outputs

    for k in range(len(items)):
        calls.append([asyncio.ensure_future(call(k, i)) for i in range(len(stages))])
    try:
        await asyncio.gather(*(row[-1] for row in calls))
    except BaseException as e:
        await _stopped(backend, calls, requests)
        done = next((k for k, row in enumerate(calls) if not _succeeded(row[-1])), len(calls))
        e.done_forwards = done  # type: ignore[attr-defined]
        e.outputs = [_with(calls[k][-1].result()[0], features[k]) for k in range(done)]  # type: ignore[attr-defined]
        raise
    return [_with(row[-1].result()[0], f) for row, f in zip(calls, features, strict=True)]


def _with(out: SeqOutput, features: Features) -> SeqOutput:
    return SeqOutput(out.session_id, out.state, out.logits, features)


def _succeeded(task: asyncio.Task[list[SeqOutput]]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


async def _stopped(backend: ClusterBackend, calls: list[list[asyncio.Task[list[SeqOutput]]]],
                   requests: list[str]) -> None:
    """Every call still running cancelled, here and on its worker (best effort: a worker also stops at the call's
    deadline)."""
    running = [(k, i) for k, row in enumerate(calls) for i, t in enumerate(row) if not t.done()]
    for k, i in running:
        calls[k][i].cancel()
    await asyncio.gather(*(ClusterBackend.cancel_call(backend.stages[i], requests[k]) for k, i in running),
                         return_exceptions=True)
    for row in calls:
        for t in row:
            with contextlib.suppress(BaseException):
                await t
