"""K3 at its real width: the sparse full-geometry checkpoint (cut to 4 layers so CI stays fast) has the
release's layout, and a worker with no sizing flags under a memory cap plans it, loads it, decodes, and
holds what it planned."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import torch

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.runtime.worker_stats import StageStats
from tests.support.cluster import TOOLS, WorkerProcess

GB = 10**9
CAP = "12G"  # under what the 4-layer cut needs with a bf16 spine (~15 GB): the worker must choose int8 and stream
CAP_BYTES = 12 * 2**30
MEMLIMIT = TOOLS / "memlimit"


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__")
    return header


def test_the_cut_has_the_release_layout(k3_cut: Path, k3_config_raw: dict):
    """Every text tensor at its real name, shape and dtype (the real config's, for these layers), the
    release's shard plan (a shard per layer, embedding/head, projector, vision tower), canonical order,
    sparse files."""
    real = parse_config(k3_config_raw)
    cfg = load_config(k3_cut)
    ckpt = open_checkpoint(k3_cut, cfg)  # strict: no problems, the vision tensors are skipped
    for layer in range(4):
        for spec in real.layer_tensor_specs(layer):
            loc = ckpt.tensors[spec.name]
            assert (loc.shape, loc.dtype) == (spec.shape, spec.dtype), spec.name
        assert cfg.expert_tensor_specs(layer, 895) == real.expert_tensor_specs(layer, 895) or layer == 0
    for spec in real.top_tensor_specs():
        assert (ckpt.tensors[spec.name].shape, ckpt.tensors[spec.name].dtype) == (spec.shape, spec.dtype)
    assert cfg.bytes_per_expert == 17_547_264 and cfg.vocab_size == 163_840
    shards = sorted(k3_cut.glob("*.safetensors"))
    assert len(shards) == 7
    vision = {**_header(shards[5]), **_header(shards[6])}
    assert len(vision) == 168 and all(n.startswith(("mm_projector.", "vision_tower.")) for n in vision)
    layer1 = _header(shards[1])
    by_offset = sorted(layer1, key=lambda n: layer1[n]["data_offsets"][0])
    dtypes = [layer1[n]["dtype"] for n in by_offset]
    assert dtypes == sorted(dtypes, key=["F32", "BF16", "U8"].index)  # F32, then BF16, then U8
    apparent = sum(p.stat().st_size for p in shards)
    on_disk = sum(p.stat().st_blocks * 512 for p in shards)
    assert apparent > 58 * GB and on_disk < 0.05 * apparent


def _memlimit_usable() -> bool:
    return (MEMLIMIT.is_file() and hasattr(os, "geteuid") and os.geteuid() == 0
            and os.access("/sys/fs/cgroup/memory", os.W_OK) and shutil.which("numfmt") is not None)


def _decode(model: Path, address: str) -> tuple[torch.Tensor, list[StageStats]]:
    from deltafin.coordinator.cluster.recovery import connect_cluster
    from deltafin.coordinator.cluster.workers import ClusterSpec
    from deltafin.runtime.stage_io import SeqInput

    async def run():
        backend, plan = await connect_cluster(ClusterSpec(model, addresses=[address], discover=False),
                                              show_progress=False)
        try:
            await backend.forward([SeqInput("s", 0, ids=torch.tensor([5, 100]))])
            out = await backend.forward([SeqInput("s", 2, ids=torch.tensor([7]))])
            return out[0].logits, await backend.stats()
        finally:
            await backend.close()

    return asyncio.run(run())


def test_a_worker_with_no_sizing_flags_fits_its_cap(k3_cut: Path, monkeypatch):
    """No --memory-gb, --expert-cache-gb or --spine: the worker finds its cap, plans int8 with streamed experts
    (a 4-layer cut holds its int8 spine: streaming layer 0 would need more for its buffers), loads, decodes a
    token, and holds what it planned: its peak resident memory is at most the plan and at least the plan less the
    parts a short decode does not fill (workspace, sessions, the runtime's allowance)."""
    if not _memlimit_usable():
        _in_process_under_a_stand_in_cap(k3_cut, monkeypatch)
        return
    worker = WorkerProcess(k3_cut, None, "--threads", "4", memory_gb=None, prefix=(str(MEMLIMIT), CAP, "--"))
    try:
        worker.wait_ready(timeout=120)
        logits, stats = _decode(k3_cut, worker.address)
    finally:
        code = worker.stop()
    assert code == 0
    assert logits.shape == (1, 163_840) and bool(torch.isfinite(logits).all())
    (stage,) = stats
    plan = stage.plan
    assert plan is not None
    assert plan.spine == "int8" and not plan.experts_resident and plan.device_total <= 0.9 * CAP_BYTES
    peak = stage.rss_peak_bytes
    slack = plan.workspace + plan.sessions + plan.overhead
    assert plan.total - slack <= peak <= plan.total, (peak, plan)
    cap = re.search(r"memlimit: limit \S+ peak (\S+)", worker.log())
    assert cap is not None


def _in_process_under_a_stand_in_cap(model: Path, monkeypatch) -> None:
    """Where no cgroup can be made (not root, cgroup v2 only): the worker's option parsing and memory discovery
    in this process, the cgroup limit read from a stand-in; planned == allocated by the stage's own tensors."""
    from deltafin.cli.flags import stage_from_args
    from deltafin.cli.worker import build_parser
    from deltafin.runtime import memory
    from deltafin.runtime.stage import Stage
    from deltafin.runtime.stage_io import SeqInput
    from deltafin.runtime.stage_options import with_memory_found
    from tests.support.sizing import held, plan_of

    monkeypatch.setattr(memory, "cgroup_limit", lambda *a, **k: CAP_BYTES)
    args = build_parser().parse_args(["--model", str(model), "--threads", "4"])
    options = with_memory_found(stage_from_args(args), torch.device("cpu"))
    cfg = load_config(model)
    stage = Stage(open_checkpoint(model, cfg), 0, cfg.num_layers, device=torch.device("cpu"), options=options)
    try:
        assert stage.plan.spine == "int8" and stage.plan.streaming
        assert stage.plan.device_total <= options.memory_bytes <= 0.9 * CAP_BYTES
        stage.forward([SeqInput("s", 0, ids=torch.tensor([5, 100]))])
        logits = stage.forward([SeqInput("s", 2, ids=torch.tensor([7]))])[0].logits
        assert logits.shape == (1, 163_840) and bool(torch.isfinite(logits).all())
        planned, allocated = plan_of(stage), held(stage)
        assert abs(allocated["spine"] - planned["spine"]) <= 0.01 * planned["spine"]
        assert allocated["experts"] == planned["experts"] and allocated["buffers"] <= planned["buffers"]
    finally:
        stage.close()
