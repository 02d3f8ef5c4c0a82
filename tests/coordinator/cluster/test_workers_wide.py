"""Wide experts with real worker processes on 127.0.0.1: every worker computes its share of every layer's experts
for every stage, worker to worker. 1, 2 and 3 wide workers give what one process gives (one worker and local
experts bit for bit, wide workers to fp32 rounding: tests/support/wide.py's WIDE_CLOSE, with the same greedy
tokens); so do a worker with no layers of its own (an expert holder only), drafting and the prefix cache; a worker
with two disks reads from both; the counters and the -v log say who read and computed what."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.cluster.recovery import connect_cluster
from deltafin.coordinator.cluster.workers import ClusterSpec
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from tests.coordinator.cluster.test_workers import PROMPT, _run
from tests.support.cluster import COORDINATOR, WorkerProcess, workers
from tests.support.wide import wide_close


@pytest.fixture(scope="module")
def local_result(small_dir):
    return asyncio.run(_run(LocalBackend(LocalPipeline.load(small_dir, 1, device="cpu"))))


def without_top(model: Path, out: Path) -> Path:
    """A copy of `model` without the shard of the embedding and head: it can be no first or last stage."""
    shutil.copytree(model, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    (out / index["weight_map"]["language_model.lm_head.weight"]).unlink()
    return out


@pytest.mark.parametrize("n, experts", [(1, "wide"), (2, "wide"), (3, "wide"), (2, "local")])
def test_wide_workers_equal_one_process(small_dir, local_result, n, experts):
    with workers(small_dir, n) as procs:
        spec = ClusterSpec(small_dir, addresses=[p.address for p in procs], discover=False, experts=experts)

        async def run():
            backend, plan = await connect_cluster(spec, show_progress=False)
            assert plan.wide == (experts == "wide" and n > 1) and len(plan.stages) == n  # one worker: local
            if plan.wide:
                assert sorted(plan.experts.holders) == sorted(s.key for s in plan.stages)
            result = await _run(backend, close=False)
            stats = await backend.stats()
            await backend.close()
            return result, stats

        (prefill, ids, rows), stats = asyncio.run(run())
    want_prefill, want_ids, want_rows = local_result
    same = torch.equal if not (experts == "wide" and n > 1) else wide_close  # fp32 on the CPU: bit-identical
    assert same(prefill, want_prefill)
    assert ids == want_ids and all(same(a, b) for a, b in zip(rows, want_rows, strict=True))
    if experts == "wide" and n > 1:  # every worker computed other stages' experts, and read for them
        assert all(s.wide.calls_served > 0 and s.wide.others_expert_bytes > 0 for s in stats), stats


def test_a_worker_without_layers_serves_its_share(small_dir, local_result, tmp_path):
    """The third worker lacks the embedding/head shard, so no stage can be its: it serves experts only, and a
    generation over the three equals one process."""
    holder_dir = without_top(small_dir, tmp_path / "no-top")
    with workers(small_dir, 2) as procs:
        extra = WorkerProcess(holder_dir, "holder", "-v")
        try:
            extra.wait_ready()
            spec = ClusterSpec(small_dir, addresses=[p.address for p in procs] + [extra.address], discover=False,
                               experts="wide")

            async def run():
                backend, plan = await connect_cluster(spec, show_progress=False)
                assert [h.worker for h in plan.holders] == ["holder"] and len(plan.stages) == 2
                assert plan.experts.count(plan.experts.holders.index(plan.holders[0].key)) > 0
                result = await _run(backend, close=False)
                stats = await backend.stats()
                await backend.close()
                return result, stats

            (prefill, ids, _), stats = asyncio.run(run())
        finally:
            extra.stop()
        log = extra.log()
    assert wide_close(prefill, local_result[0]) and ids == local_result[1]
    holder = next(s for s in stats if s.name == "holder")
    assert holder.layers == (0, 0) and holder.wide.calls_served > 0 and holder.plan.sessions == 0
    assert "expert holder on cpu" in log


async def _speculate_and_resume(backend) -> list[torch.Tensor]:
    """A prompt kept as a prefix, a speculative forward of 4 drafts, a step from its second position (the stages
    rewind), and a new session resumed from the kept prefix: every logit."""
    ids = torch.tensor(PROMPT)
    try:
        kept = SeqInput("s", 0, ids=ids, save_at=((len(ids), "kept"),))
        out = [(await backend.forward([kept], all_logits=True))[0].logits]
        out.append((await backend.forward([SeqInput("s", 8, ids=torch.tensor([3, 4, 5, 6]), speculative=True)]))[0]
                   .logits)
        out.append((await backend.forward([SeqInput("s", 10, ids=torch.tensor([9]))]))[0].logits)
        out.append((await backend.forward([SeqInput("r", 8, ids=torch.tensor([1, 2]), resume_from="kept")],
                                          all_logits=True))[0].logits)
        return out
    finally:
        await backend.close()


def test_drafting_and_the_prefix_cache_through_wide_workers(small_dir):
    want = asyncio.run(_speculate_and_resume(LocalBackend(LocalPipeline.load(small_dir, 1, device="cpu"))))
    with workers(small_dir, 2) as procs:
        spec = ClusterSpec(small_dir, addresses=[p.address for p in procs], discover=False, experts="wide")

        async def run():
            backend, plan = await connect_cluster(spec, show_progress=False)
            assert plan.wide
            return await _speculate_and_resume(backend)

        got = asyncio.run(run())
    assert len(got) == len(want) and all(wide_close(a, b) for a, b in zip(got, want, strict=True))


def test_a_worker_reads_its_experts_from_two_disks(tiny_dir, tmp_path):
    """A worker with a copy of the checkpoint on a second disk (said to be 3x as fast) reads from both, about a
    quarter and three quarters, and generates what one process does."""
    copy = tmp_path / "ssd2"
    shutil.copytree(tiny_dir, copy)
    local = subprocess.run([*COORDINATOR, "--model", str(tiny_dir), "--local", "generate", "two disks",
                            "--max-tokens", "6", "--json"], capture_output=True, text=True, timeout=120)
    w = WorkerProcess(tiny_dir, "two", "--expert-dir", str(copy), "--disk-gbps", "1,3")
    try:
        w.wait_ready()
        r = subprocess.run([*COORDINATOR, "--model", str(tiny_dir), "--no-discover", "--worker", w.address, "-v",
                            "--expert-cache-gb", "0", "generate", "two disks", "--max-tokens", "6", "--json"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    finally:
        w.stop()
    assert json.loads(r.stdout)["ids"] == json.loads(local.stdout)["ids"]
    (row,) = json.loads(r.stdout)["workers"]
    first, second = row["disks"]
    assert first["dir"] == str(tiny_dir) and second["dir"] == str(copy) and (first["gbps"], second["gbps"]) == (1, 3)
    assert second["bytes_read"] / (first["bytes_read"] + second["bytes_read"]) == pytest.approx(0.75, abs=0.15)
    assert "plan (local experts, 1 workers answered)" in r.stderr  # -v: the plan decision


def test_counters_and_the_per_holder_log(small_dir):
    """generate --json lists every worker's reads for its own layers and for others', and each worker's -v log
    has a line a forward with every holder's experts and time."""
    with workers(small_dir, 2, "-v") as procs:
        r = subprocess.run([*COORDINATOR, "--model", str(small_dir), "--no-discover",
                            *(a for p in procs for a in ("--worker", p.address)), "--experts", "wide", "generate",
                            "counted", "--max-tokens", "4", "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    logs = [p.log() for p in procs]
    rows = json.loads(r.stdout)["workers"]
    assert [row["name"] for row in rows] == ["w0", "w1"]
    for row in rows:
        assert row["own_expert_bytes"] > 0 and row["others_expert_bytes"] > 0 and row["calls_served"] > 0
        assert row["experts"].endswith(f"x{7}") and row["peer_wait_s"] >= 0
    for log in logs:
        lines = [line for line in log.splitlines() if "wide:" in line]
        assert lines and all("w0" in line and "w1" in line and "(self)" in line for line in lines[-2:]), log[-2000:]


def _link_bytes(model: Path, tokens: int) -> int:
    """Bytes two wide workers' links carried (coordinator and peers through the proxies, probes included) for a
    4-token prompt and `tokens` greedy tokens."""
    import deltafin
    from tests.support.links import slow_links

    with workers(model, 2) as procs, slow_links([p.address for p in procs], rtt_ms=0, mbps=0) as proxy, \
            deltafin.connect(model, proxy.addresses, discover=False, progress=False, experts="wide",
                             rejoin_interval=0) as m:
        assert m.engine.backend.plan.wide
        assert m.generate([5, 9, 2, 7], max_tokens=tokens).usage.completion_tokens == tokens
    return sum(c.to + c.back for c in proxy.carried.values())


def test_a_decoded_token_moves_a_row_each_way_per_moe_layer(small_dir):
    """Two wide workers behind proxies (the coordinator and the peers reach each worker through them): a token's
    link bytes, measured as the difference of two runs, are at most the hops (ids in; the state out of the first
    stage and into the second; the last position's logits back) and, per MoE layer, the token's row to the other
    holder and one summed row back (before: a row back per pair there), with a little room for gRPC's framing."""
    from deltafin.checkpoint.config import load_config

    cfg = load_config(small_dir)
    per_token = (_link_bytes(small_dir, 18) - _link_bytes(small_dir, 2)) / 16
    state = (1 + 1) * cfg.hidden_size * 4  # the residual state at the split (one banked block), fp32
    hops = 4 + 2 * state + cfg.vocab_size * 4
    calls = len(cfg.moe_layers) * 2 * cfg.expert_dim * 4  # a row out, its sum back
    pairs_back = len(cfg.moe_layers) * (cfg.experts_per_token / 2) * cfg.expert_dim * 4  # before: per pair, ~k/2
    assert per_token <= 1.1 * (hops + calls) + 6000, (per_token, hops, calls)
    assert per_token < hops + len(cfg.moe_layers) * cfg.expert_dim * 4 + pairs_back  # less than before
