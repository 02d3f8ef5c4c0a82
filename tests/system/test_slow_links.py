"""A busy link is not a dead worker: two workers of `small` behind a slow simulated link (tests/support/links.py),
where one forward's residual state takes nearly twice --worker-timeout to cross each way. The forward finishes with
the tokens single-machine mode gives (before, the first stage was declared lost while its state came back); a
worker frozen mid-transfer is still lost within about --worker-timeout.

linkproxy forwards one connection's backlog before it serves any other, so while a state crosses even the probes'
own connection waits and they time out: the parts sent and received keep the stage alive. gRPC runs ahead of the
link by its flow-control window (~4 MB here), which must cross within the timeout: hence 20 Mbit/s for 3 s."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import torch

from deltafin.coordinator.cluster.recovery import RecoveryOptions, ResilientCluster, connect_cluster
from deltafin.coordinator.cluster.worker_client import Timeouts
from deltafin.coordinator.cluster.workers import ClusterSpec
from deltafin.errors import WorkerLost
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from tests.support.cluster import workers
from tests.support.links import slow_links
from tests.support.serving import argmax_loop

LOST_AFTER = 3.0  # --worker-timeout 3
TIMEOUTS = Timeouts(lost_after=LOST_AFTER, probe_interval=1.0)  # as connect.cluster_spec makes them
RTT_MS, MBPS = 40, 20  # 2.5 MB/s each way
PROMPT = [(7 * i + 3) % 3000 + 10 for i in range(2000)]  # ~13 MB of state each way between the stages: ~5 s a crossing
STEPS = 4


async def _greedy(backend, ids: list[int], n: int) -> list[int]:
    logits = (await backend.forward([SeqInput("s", 0, ids=torch.tensor(ids))]))[0].logits
    out = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        if i + 1 < n:
            logits = (await backend.forward([SeqInput("s", len(ids) + i, ids=torch.tensor(out[-1:]))]))[0].logits
    return out


async def _connect(small_dir: Path, addresses: list[str]) -> ResilientCluster:
    """The two stages, pipelined; without recovery, so that a worker taken for lost fails the forward."""
    spec = ClusterSpec(small_dir, addresses=addresses, discover=False, timeouts=TIMEOUTS, experts="local")
    backend, plan = await connect_cluster(spec, show_progress=False,
                                          recovery=RecoveryOptions(enabled=False, rejoin_interval=0))
    assert len(plan.stages) == 2
    return backend


def test_a_slow_link_is_not_a_lost_worker(small_dir: Path) -> None:
    want, _ = argmax_loop(LocalPipeline.load(small_dir, 1, device="cpu"), PROMPT, STEPS, set())
    with workers(small_dir, 2) as procs, slow_links([p.address for p in procs], RTT_MS, MBPS) as proxy:
        async def run() -> tuple[list[int], float]:
            backend = await _connect(small_dir, proxy.addresses)
            try:
                t0 = time.monotonic()
                return await _greedy(backend, PROMPT, STEPS), time.monotonic() - t0
            finally:
                await backend.close()

        got, seconds = asyncio.run(run())
    assert got == want
    state = len(PROMPT) * 4096  # at least the narrowest boundary's bytes a token (fp32), one way to each stage
    to, back = proxy.carried[procs[1].address].to, proxy.carried[procs[0].address].back
    assert to > state and back > state, proxy.carried
    assert seconds > 2 * LOST_AFTER, seconds  # the link was as slow as meant: each crossing past the timeout
    print(f"\nover {RTT_MS} ms / {MBPS} Mbit/s with --worker-timeout {LOST_AFTER:g}: prompt and {STEPS} tokens in "
          f"{seconds:.1f}s, {to / 1e6:.1f} MB to the second stage, {back / 1e6:.1f} MB back from the first")


def test_a_frozen_worker_behind_a_slow_link_is_still_lost(small_dir: Path) -> None:
    """SIGSTOP of the second stage a second into its state's crossing: bytes stop, probes go unanswered."""
    with workers(small_dir, 2) as procs, slow_links([p.address for p in procs], RTT_MS, MBPS) as proxy:
        frozen = procs[1].proc

        async def run() -> float:
            backend = await _connect(small_dir, proxy.addresses)
            second, stopped = backend.stages[1], []
            forward = second.forward

            async def freezing(*args, **kwargs):
                loop = asyncio.get_running_loop()
                loop.call_later(1.0, lambda: (frozen.send_signal(signal.SIGSTOP), stopped.append(time.monotonic())))
                return await forward(*args, **kwargs)

            second.forward = freezing
            try:
                with pytest.raises(WorkerLost, match="w1"):
                    await backend.forward([SeqInput("s", 0, ids=torch.tensor(PROMPT))])
                assert stopped, "a worker was taken for lost before any was frozen"
                return time.monotonic() - stopped[0]
            finally:
                await backend.close()

        try:
            seconds = asyncio.run(run())
        finally:
            frozen.send_signal(signal.SIGCONT)
    print(f"\nfrozen behind {RTT_MS} ms / {MBPS} Mbit/s: lost {seconds:.1f}s after SIGSTOP (--worker-timeout "
          f"{LOST_AFTER:g})")
    assert seconds < LOST_AFTER + 3 * TIMEOUTS.probe_interval + 1.5, seconds  # probes fail once a probe timeout
