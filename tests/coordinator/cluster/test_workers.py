"""The cluster with real worker processes on 127.0.0.1: 1, 2 and 3 workers give exactly what
single-machine mode gives; a worker refuses a coordinator with another model; workers that share a name
form a cluster; pipelined batches equal solo runs; a 16K prompt through workers equals local."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
import torch

from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.cluster.recovery import connect_cluster
from deltafin.coordinator.cluster.workers import ClusterSpec
from deltafin.coordinator.engine.events import Finished
from deltafin.coordinator.engine.generation import Generation
from deltafin.coordinator.engine.token_loop import Request, generate
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from tests.support.cluster import COORDINATOR, workers

PROMPT = [5, 100, 300, 7, 9, 700, 12, 44]


async def _run(backend, steps: int = 6, close: bool = True) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """Prefill logits for every prompt position, then a greedy continuation with its logits (and the backend
    closed, unless `close` is False)."""
    try:
        prefill = (await backend.forward([SeqInput("p", 0, ids=torch.tensor(PROMPT))], all_logits=True))[0].logits
        await backend.release(["p"])
        ids, rows = [], []
        async def forward(seq: SeqInput):
            return (await backend.forward([seq]))[0]

        async def release(session_id: str, keep_as: str | None = None, keep_length: int = 0) -> None:
            await backend.release([session_id])

        async for event in generate(forward, release, None, Request(PROMPT, steps, return_logits=True)):
            if not isinstance(event, Finished):
                ids.append(event.token_id)
                rows.append(event.logits)
        return prefill, ids, rows
    finally:
        if close:
            await backend.close()


@pytest.fixture(scope="module")
def local_result(small_dir):
    return asyncio.run(_run(LocalBackend(LocalPipeline.load(small_dir, 1, device="cpu"))))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_cluster_equals_local(small_dir, local_result, n):
    with workers(small_dir, n) as procs:  # the pipeline: each stage its own experts (wide: test_workers_wide.py)
        spec = ClusterSpec(small_dir, addresses=[p.address for p in procs], discover=False, experts="local")

        async def run():
            backend, plan = await connect_cluster(spec, show_progress=False)
            assert len(plan.stages) == n and plan.stages[0].start == 0 and plan.stages[-1].end == 8
            return await _run(backend)

        prefill, ids, rows = asyncio.run(run())
    want_prefill, want_ids, want_rows = local_result
    assert torch.equal(prefill, want_prefill)  # fp32 on the CPU: bit-identical
    assert ids == want_ids
    assert all(torch.equal(a, b) for a, b in zip(rows, want_rows, strict=True))


def _coordinator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COORDINATOR, *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_generate_and_plan_match_local(tiny_dir):
    local = _coordinator("--model", str(tiny_dir), "--local", "generate", "Hello world", "--max-tokens", "6",
                         "--json")
    assert local.returncode == 0, local.stderr
    with workers(tiny_dir, 2, announce=True, prefix="cli") as procs:
        r = _coordinator("--model", str(tiny_dir), "--interface", "127.0.0.1", "--expect", "2", "generate",
                         "Hello world", "--max-tokens", "6", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["ids"] == json.loads(local.stdout)["ids"]
        assert "cli0" in r.stderr and "cli1" in r.stderr  # the plan table
        plan = _coordinator("--model", str(tiny_dir), "--no-discover", "--worker", procs[0].address, "plan")
        assert plan.returncode == 0 and "0-5" in plan.stdout
        assert plan.stdout.splitlines()[-1].endswith(": deltafin download SOURCE --out DIR --layers 0-5")
    gone = _coordinator("--model", str(tiny_dir), "--no-discover", "--worker", "127.0.0.1:1", "plan")
    assert gone.returncode == 1 and "Traceback" not in gone.stderr and "127.0.0.1:1" in gone.stderr


def test_worker_refuses_a_coordinator_with_another_model(tiny_dir, small_dir):
    with workers(tiny_dir, 1) as procs:
        r = _coordinator("--model", str(small_dir), "--no-discover", "--worker", procs[0].address, "plan")
    assert r.returncode == 1 and "no usable workers" in r.stderr


def test_workers_with_the_same_name_on_one_host_form_a_cluster(tiny_dir):
    """Default names are the host name: two workers on one machine share it, yet each keeps its own stage
    (workers are told apart by the id each makes at start)."""
    from tests.support.cluster import WorkerProcess

    procs = [WorkerProcess(tiny_dir, None) for _ in range(2)]
    try:
        addresses = [p.wait_ready() for p in procs]
        local = asyncio.run(_run(LocalBackend(LocalPipeline.load(tiny_dir, 1, device="cpu"))))

        async def run():
            backend, plan = await connect_cluster(ClusterSpec(tiny_dir, addresses=addresses, discover=False,
                                                              experts="local"),
                                                  show_progress=False)
            assert len(plan.stages) == 2 and plan.stages[0].worker == plan.stages[1].worker  # one name ...
            assert len({s.key for s in plan.stages}) == 2  # ... two workers
            assert sorted(w.address for w in backend.stages) == sorted(addresses)
            assert backend.parallel_stages == 1  # CPU workers on one host share its cores: one batch in flight
            return await _run(backend)

        prefill, ids, rows = asyncio.run(run())
    finally:
        for p in procs:
            p.stop()
    assert torch.equal(prefill, local[0]) and ids == local[1]


def test_pipelined_batches_match_solo_runs(small_dir):
    """One batch per stage in flight (--pipeline-depth 2: CPU workers on one host would get 1 by default);
    every request still gets its own greedy tokens."""
    from deltafin.checkpoint.config import load_config
    from deltafin.coordinator.engine.engine import Engine
    from deltafin.coordinator.engine.serving_options import ServingOptions
    from deltafin.text.tokenizer import K3Tokenizer

    prompts = ["alpha beta", "the experts stream", "tokens are bytes", "a Mac cluster"]
    tok = K3Tokenizer.load(small_dir)

    async def run(addresses: list[str], depth: int, which: list[str]):
        backend, _ = await connect_cluster(ClusterSpec(small_dir, addresses=addresses, discover=False),
                                           show_progress=False)
        engine = Engine(backend, tok, load_config(small_dir), "small", ServingOptions(max_active=8,
                                                                                      pipeline_depth=depth))

        async def one(prompt: str) -> list[int]:
            return [e.token_id async for e in engine.run(tok.encode(prompt), None, Generation(12, ignore_eos=True))
                    if not isinstance(e, Finished)]

        try:
            return await asyncio.gather(*(one(p) for p in which)), engine.scheduler.stats
        finally:
            await engine.close()

    with workers(small_dir, 2) as procs:
        addresses = [p.address for p in procs]
        solo = [asyncio.run(run(addresses, 1, [p]))[0][0] for p in prompts]
        together, stats = asyncio.run(run(addresses, 2, prompts))
    assert together == solo
    assert stats.max_in_flight == 2  # two batches, one per stage


@pytest.mark.parametrize("n", [2, 3])
def test_a_16k_prompt_through_workers_equals_local(tiny_dir, n):
    """16,384 prompt tokens through n worker processes in one forward (the stages are planned for the context),
    with a 1 MB gRPC message cap: the hidden states cross every boundary in parts (ForwardParts), not in smaller
    forwards; the last position's logits and 4 greedy steps equal single-machine mode fed the same forward, bit
    for bit; each worker's peak memory stays within what its stage was planned for."""
    from deltafin.plan.memory.sizing import SizingInput

    length = 16384
    prompt = (torch.arange(length) % 700 + 5).tolist()

    async def drive(backend, chunk: int) -> tuple[torch.Tensor, list[int]]:
        out = None
        for pos in range(0, length, chunk):
            out = (await backend.forward([SeqInput("long", pos, ids=torch.tensor(prompt[pos:pos + chunk]))]))[0]
        first, ids = out.logits.clone(), []
        for step in range(4):
            ids.append(int(out.logits[-1].argmax()))
            out = (await backend.forward([SeqInput("long", length + step, ids=torch.tensor(ids[-1:]))]))[0]
        await backend.release(["long"])
        return first, ids

    with workers(tiny_dir, n) as procs:
        spec = ClusterSpec(tiny_dir, addresses=[p.address for p in procs], discover=False,
                           sizing=SizingInput(sequences=1, context=length + 8), max_message_bytes=1 << 20,
                           experts="local")

        async def run():
            backend, plan = await connect_cluster(spec, show_progress=False)
            try:
                chunk = backend.max_forward_tokens
                result = await drive(backend, chunk)
                return chunk, result, await backend.stats()
            finally:
                await backend.close()

        chunk, (logits, ids), stats = asyncio.run(run())
    assert chunk >= length  # the stages' sizing set it: the message cap only splits the messages
    local = LocalBackend(LocalPipeline.load(tiny_dir, 1, device="cpu"))

    async def run_local():
        try:
            return await drive(local, chunk)
        finally:
            await local.close()

    want_logits, want_ids = asyncio.run(run_local())
    assert torch.equal(logits, want_logits) and ids == want_ids
    for s in stats:
        print(f"{s.name}: layers {s.layers}, peak RSS {s.rss_peak_bytes / 1e9:.2f} GB, "
              f"planned {s.plan.total / 1e9:.2f} GB")
        assert s.rss_peak_bytes < s.plan.total


def test_parallel_stages_count_cpu_workers_on_one_host_once():
    from deltafin.coordinator.cluster.workers import parallel_stages
    from deltafin.transport.worker_info import WorkerDescription

    def worker(address: str, device: str, wid: str) -> WorkerDescription:
        return WorkerDescription("mac", address, device, 1 << 36, 5.0, "fp", ((0, 8),), True, worker_id=wid)

    assert parallel_stages([worker("10.0.0.1:1", "cpu", "a"), worker("10.0.0.1:2", "cpu", "b")]) == 1
    assert parallel_stages([worker("10.0.0.1:1", "cpu", "a"), worker("10.0.0.2:1", "cpu", "b")]) == 2
    assert parallel_stages([worker("10.0.0.1:1", "cuda:0", "a"), worker("10.0.0.1:2", "cuda:1", "b"),
                            worker("10.0.0.1:3", "cuda:0", "c")]) == 3  # GPUs, even one shared, overlap work
    assert parallel_stages([worker("10.0.0.1:1", "mps", "a"), worker("10.0.0.2:1", "mps", "b")]) == 2


def test_a_worker_s_own_spine_is_the_plan_s_or_the_plan_is_refused(tiny_dir):
    """A worker started with --spine q4: an auto coordinator plans q4 and says why; one that asks for int8 is
    refused with both formats named (before: the worker's flag was silently replaced by the plan's)."""
    with workers(tiny_dir, 1, "--spine", "q4", prefix="q4w") as procs:
        base = ("--model", str(tiny_dir), "--no-discover", "--worker", procs[0].address)
        r = _coordinator(*base, "plan")
        assert r.returncode == 0, r.stderr
        assert "spine q4: as the workers were started (--spine q4 on q4w0)" in r.stdout + r.stderr
        r = _coordinator(*base, "--spine", "int8", "plan")
        assert r.returncode == 1 and "asks for --spine int8, but q4w0 (--spine q4) started with another" in r.stderr


def test_a_13k_prompt_through_two_workers_with_the_defaults(tiny_dir):
    """No --max-context: the plan holds the longest context the workers' memory holds beside their plans (before:
    4,096 tokens for every deployment, and a 13,520-token prompt through two workers was refused); the prompt's
    greedy continuation equals single-machine mode's."""
    import deltafin

    prompt = (torch.arange(13_520) % 700 + 5).tolist()
    with workers(tiny_dir, 2) as procs, deltafin.connect(tiny_dir, [p.address for p in procs], discover=False,
                                                         progress=False) as model:
        assert model.engine.max_context > 13_520 + 4
        got = model.generate(prompt, max_tokens=4)
    assert got.usage.prompt_tokens == 13_520 and got.usage.completion_tokens == 4
    with deltafin.load(tiny_dir, device="cpu", progress=False, max_context=13_600) as model:
        assert model.generate(prompt, max_tokens=4).text == got.text
