"""The CUDA path, where there is a GPU (the lent H200; skipped elsewhere): planned == allocated at K3's real
width, the bf16 spine held as bf16, logits equal to the CPU's."""

from __future__ import annotations

import gc

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.devices import exact_fp32
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GB = 10**9
CUDA = torch.device("cuda") if torch.cuda.is_available() else None


@pytest.mark.parametrize("spine", ["bf16", "int8"])
def test_planned_equals_allocated_at_full_width(k3_cut, spine):
    """After loading, the GPU holds the plan's resident parts (weights, expert slots) to 0.5% + 64 MB (the
    allocator rounds each of ~150 tensors); the peak of a prefill and a decode step stays within the plan."""
    exact_fp32()
    cfg = load_config(k3_cut)
    gc.collect()  # nothing of an earlier test's stages left to be freed while this one loads
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    stage = Stage(open_checkpoint(k3_cut, cfg), 0, cfg.num_layers, device=CUDA,
                  options=StageOptions(memory_bytes=40 * GB, host_memory_bytes=40 * GB,
                                       sizing=SizingOptions(spine=spine)))
    try:
        z = stage.plan
        assert z.spine == spine and z.streaming and not z.streamed_layers
        loaded = torch.cuda.memory_allocated() - base
        static = z.layers + z.top + z.expert_cache + z.expert_landing
        assert abs(loaded - static) <= 0.005 * static + (64 << 20), (loaded, static)
        if spine == "bf16":
            assert stage.spine.resident[1].attn.q.dtype == torch.bfloat16  # kept as stored, no fp32 copy
        torch.cuda.reset_peak_memory_stats()
        stage.forward([SeqInput("s", 0, ids=torch.tensor([5, 100, 7, 9]))])
        logits = stage.forward([SeqInput("s", 4, ids=torch.tensor([11]))])[0].logits
        assert bool(torch.isfinite(logits).all())
        assert torch.cuda.max_memory_allocated() - base <= z.device_total
    finally:
        stage.close()


def test_cuda_logits_equal_the_cpus(tiny_dir):
    """fp32 on both: the same model to float rounding (different kernels sum in different orders)."""
    exact_fp32()
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    ids = torch.tensor([5, 100, 300, 7, 9, 700, 12, 44])
    out = []
    for device in (torch.device("cpu"), CUDA):
        stage = Stage(ckpt, 0, cfg.num_layers, device=device,
                      options=StageOptions(sizing=SizingOptions(expert_cache_bytes=10**6)))
        out.append(stage.forward([SeqInput("s", 0, ids=ids)], all_logits=True)[0].logits.cpu())
        stage.close()
    rel = (out[0] - out[1]).norm(dim=-1) / out[0].norm(dim=-1)
    assert float(rel.max()) < 1e-4  # TF32 off; cuBLAS/Triton vs the CPU kernels sum differently: measured ~1e-5


def test_host_slots_return_to_the_pool_only_after_the_copy(small_dir, monkeypatch):
    """Pinned staging slots and non-blocking copies on a copy stream: a reader that poisons each host slot the
    moment it is freed corrupts no expert; take away the wait for the copy and it does (each copy is held back
    25 ms on its stream, so an early release always loses the race)."""
    from safetensors import safe_open

    from deltafin.weights.store import ExpertStore

    cfg = load_config(small_dir)

    def run(wait: bool) -> int:
        store = ExpertStore(open_checkpoint(small_dir, cfg), cfg.moe_layers, device=CUDA, cache_bytes=0, threads=4)
        assert store.pool.buf.is_pinned()
        release = store.pool.release

        def poisoned(slot: int) -> None:
            store.pool.memory(slot)[:] = b"\xab" * store.pool.size
            release(slot)

        copy = store.slots._copy_to_device

        def late(target: torch.Tensor, source: torch.Tensor) -> None:
            with torch.cuda.stream(store.slots._copy_stream):
                torch.cuda._sleep(50_000_000)
            copy(target, source)

        monkeypatch.setattr(store.pool, "release", poisoned)
        monkeypatch.setattr(store.slots, "_copy_to_device", late)
        if not wait:
            monkeypatch.setattr(store.slots, "_wait", lambda event: None)
        bad = 0
        shard = small_dir / "model-00002-of-00009.safetensors"
        try:
            with safe_open(shard, "pt") as f, store.hold(1, list(range(8))) as held:
                torch.cuda.synchronize()
                for e, w in held.items():
                    p = f"language_model.model.layers.1.block_sparse_moe.experts.{e}.w1.weight_packed"
                    bad += not torch.equal(w.w1.packed.cpu(), f.get_tensor(p))
        finally:
            store.close()
        return bad

    assert run(wait=True) == 0
    assert run(wait=False) > 0
