"""Streaming experts and spine from the disk: byte-identical weights, identical logits, clear errors for
shards that change under a running stage, hit counters, int8 and streamed spines, no leaked buffers."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.errors import ModelFormatError
from deltafin.plan.memory.sizing import Placement, SizingInput, size_stage
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights.reader import layer_spans
from deltafin.weights.store import ExpertStore

CPU = torch.device("cpu")


IDS = torch.tensor([5, 100, 300, 7, 9, 700, 12, 44, 3, 1000, 2, 17])


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_store_returns_the_bytes_safetensors_reads(tiny_dir: Path, io: str):
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    store = ExpertStore(ckpt, cfg.moe_layers, device=CPU, cache_bytes=0, io=io, threads=3)
    try:
        for layer in cfg.moe_layers:
            shard = tiny_dir / f"model-{layer + 1:05d}-of-00007.safetensors"
            seen = set()
            with safe_open(shard, "pt") as f:
                # an expert's weights are valid until the generator moves on (its slot is then reused)
                for e, got in store.experts(layer, list(range(cfg.num_experts))):
                    seen.add(e)
                    p = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
                    for w, mat in (("w1", got.w1), ("w2", got.w2), ("w3", got.w3)):
                        assert torch.equal(mat.packed, f.get_tensor(p + w + ".weight_packed"))
                        assert torch.equal(mat.scales, f.get_tensor(p + w + ".weight_scale"))
            assert seen == set(range(cfg.num_experts))
        stats = store.snapshot_stats()
        assert stats.misses == len(cfg.moe_layers) * cfg.num_experts and stats.reads == stats.misses
    finally:
        store.close()


def _pipelines(model: Path, stages: int, cache_bytes: int, **opts):
    resident = LocalPipeline.load(model, 1, device="cpu")
    streaming = LocalPipeline.load(model, stages, device="cpu",
                                   options=StageOptions().replace(expert_cache_bytes=cache_bytes, read_threads=3,
                                                                  **opts))
    return resident, streaming


def _decode(pipe: LocalPipeline, sid: str, steps: int = 4) -> list[torch.Tensor]:
    out = [pipe.forward([SeqInput(sid, 0, ids=IDS)], all_logits=True)[0].logits]
    for i in range(steps):
        out.append(pipe.forward([SeqInput(sid, len(IDS) + i, ids=torch.tensor([11 * i + 3]))])[0].logits)
    return out


@pytest.mark.parametrize("preset, stages, opts", [("tiny", 1, {}), ("tiny", 3, {"prefetch_layers": 1}),
                                                  ("small", 2, {}), ("small", 1, {"prefetch": False}),
                                                  ("small", 2, {"cache_policy": "pinned"})])
def test_streaming_logits_equal_resident(tiny_dir, small_dir, preset, stages, opts):
    model = tiny_dir if preset == "tiny" else small_dir
    cfg = load_config(model)
    # a cache far smaller than the experts: a couple of them
    resident, streaming = _pipelines(model, stages, 2 * cfg.bytes_per_expert, **opts)
    try:
        for a, b in zip(_decode(resident, "r"), _decode(streaming, "s"), strict=True):
            assert torch.equal(a, b)
        stats = [s.stats().experts for s in streaming.stages]
        assert sum(s.misses for s in stats) > 0 and sum(s.bytes_read for s in stats) > 0
        if opts.get("prefetch", True):
            assert sum(s.prefetch_hits for s in stats) > 0
    finally:
        resident.close()
        streaming.close()


def test_expert_store_counts_hits_with_a_big_cache(small_dir):
    cfg = load_config(small_dir)
    pipe = LocalPipeline.load(small_dir, 1, device="cpu",
                              options=StageOptions(prefetch=False, sizing=SizingInput(expert_cache_bytes=10**9,
                                                                                        read_threads=2)))
    try:
        _decode(pipe, "a", steps=1)
        _decode(pipe, "b", steps=1)  # the same tokens again: every expert is cached now
        s = pipe.stages[0].stats().experts
        assert s.hits >= s.lookups / 2 - 1 and s.misses <= len(cfg.moe_layers) * cfg.num_experts
    finally:
        pipe.close()


def _stage(model: Path) -> Stage:
    cfg = load_config(model)
    return Stage(open_checkpoint(model, cfg), 0, cfg.num_layers, device=CPU,
                 options=StageOptions(prefetch=False, sizing=SizingInput(expert_cache_bytes=0, read_threads=2)))


def test_truncated_shard_fails_the_request_and_the_stage_recovers(tiny_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    stage = _stage(model)
    good = stage.forward([SeqInput("ok", 0, ids=IDS)])[0].logits
    shard = model / "model-00004-of-00007.safetensors"
    data = shard.read_bytes()
    os.truncate(shard, len(data) - 5000)
    with pytest.raises(ModelFormatError, match="model-00004-of-00007.safetensors is truncated"):
        stage.forward([SeqInput("s", 0, ids=IDS)])
    assert "s" not in stage.sessions or stage.sessions["s"].length == 0
    with open(shard, "r+b") as f:  # the same file restored in place
        f.write(data)
    assert torch.equal(stage.forward([SeqInput("s", 0, ids=IDS)])[0].logits, good)
    stage.close()


def test_vanished_and_replaced_shards_are_named(tiny_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    stage = _stage(model)
    stage.forward([SeqInput("warm", 0, ids=IDS)])  # every shard opened
    shard = model / "model-00003-of-00007.safetensors"
    shard.rename(tmp_path / "away")
    with pytest.raises(ModelFormatError, match="model-00003-of-00007.safetensors vanished"):
        stage.forward([SeqInput("s", 0, ids=IDS)])
    (tmp_path / "away").rename(shard)
    stage.forward([SeqInput("s", 0, ids=IDS)])  # back: served again
    shutil.copy(shard, tmp_path / "copy")
    (tmp_path / "copy").rename(shard)  # a different file under the same name
    with pytest.raises(ModelFormatError, match="was replaced while running"):
        stage.forward([SeqInput("t", 0, ids=IDS)])
    stage.close()


def test_streamed_and_int8_spines(tiny_dir):
    resident = LocalPipeline.load(tiny_dir, 1, device="cpu")
    # a forward size given: the budget below is sized at the forward the stage plans (none lent to prompts)
    options = StageOptions(sizing=SizingInput(spine="bf16", expert_cache_bytes=10**7, prefill_chunk=512))
    cfg = resident.config
    # a budget below the all-resident stage's: the stage keeps what fits and streams the rest
    sizing = options.sizing_for(cfg, layer_spans(resident.stages[0].ckpt))
    totals = [size_stage(cfg, 0, cfg.num_layers, Placement("cpu"), "bf16", 10**7, k, sizing).total
              for k in range(cfg.num_layers + 1)]
    budget = max(t for t in totals if t < totals[-1])
    expect = max(k for k, t in enumerate(totals) if t <= budget)
    streamed = LocalPipeline.load(tiny_dir, 1, device="cpu", options=dataclasses.replace(options,
                                                                                        memory_bytes=budget))
    int8 = LocalPipeline.load(tiny_dir, 1, device="cpu", options=StageOptions(sizing=SizingInput(spine="int8")))
    try:
        assert streamed.stages[0].spine.plan.resident == tuple(range(expect)) and expect < cfg.num_layers
        for a, b in zip(_decode(resident, "r"), _decode(streamed, "s"), strict=True):
            assert torch.equal(a, b)
        assert streamed.stages[0].stats().spine_streamed_bytes > 0
        # int8 computes exactly the model whose matrices are their row-int8 round trips (a random tiny model
        # amplifies the ~0.4% weight error into ~17% logit changes, so compare against that model instead)
        stage = resident.stages[0]
        for w in stage.spine.resident.values():
            _roundtrip_int8(w)
        _roundtrip_int8(stage.top)
        a, q = _decode(resident, "r2", 0)[0], _decode(int8, "q", 0)[0]
        # the same function (the int8 round trips), computed by the int8 kernel or by dequantized fp32 matmuls
        assert float(((q - a).norm(dim=-1) / a.norm(dim=-1)).max()) < 1e-4
        assert int8.stages[0].spine.plan.resident_bytes < 0.75 * resident.stages[0].spine.plan.resident_bytes
    finally:
        for p in (resident, streamed, int8):
            p.close()


def _roundtrip_int8(obj) -> None:
    """Replace every matrix that --spine int8 quantizes by its dequantized row-int8 version, in place."""
    from deltafin.kernels.quant import dequantize_int8_rows, quantize_int8_rows

    for name, value in vars(obj).items():
        quantized = isinstance(value, torch.Tensor) and value.dim() == 2 and min(value.shape) > 1
        if quantized and name not in ("embed", "router") and value.dtype == torch.bfloat16:
            object.__setattr__(obj, name, dequantize_int8_rows(quantize_int8_rows(value), torch.float32))
        elif hasattr(value, "__dataclass_fields__") and not isinstance(value, torch.Tensor):
            _roundtrip_int8(value)


def test_no_expert_buffer_leaks_over_many_steps(small_dir):
    """Every slot is accounted for after a long run with guesses dropped, aborted and late."""
    import time as _time

    pipe = LocalPipeline.load(small_dir, 1, device="cpu",
                              options=StageOptions(sizing=SizingInput(expert_cache_bytes=0, read_threads=4)))
    store = pipe.stages[0].experts
    try:
        pipe.forward([SeqInput("s", 0, ids=IDS)])
        g = torch.Generator().manual_seed(0)
        for i in range(40):
            pipe.forward([SeqInput("s", len(IDS) + i, ids=torch.randint(0, 3000, (1,), generator=g))])
        for _ in range(200):  # let in-flight prefetches land
            if not store._pending:
                break
            _time.sleep(0.01)
        held = len(store.cache.entries) + len(store._staged)
        assert store.pool.free.qsize() + held == store.pool.count
    finally:
        pipe.close()


@pytest.mark.parametrize("order", ["canonical", "grouped"])
def test_streamed_reads_are_the_tensors_bytes_in_any_order(tmp_path, tiny_dir, order):
    """Whatever order the shards store tensors in, a stage that streams every layer's spine and every expert
    computes the resident logits exactly, and each pass reads each streamed layer's tensors once (no bytes of
    neighbouring experts: at most the alignment of one contiguous run, 2 x 4 KiB, per layer)."""
    from deltafin.mini.synth import synthesize

    model = tiny_dir if order == "canonical" else synthesize("tiny", tmp_path / order, order=order,
                                                             show_progress=False)
    cfg = load_config(model)
    ckpt = open_checkpoint(model, cfg)
    resident = LocalPipeline.load(tiny_dir, 1, device="cpu")
    options = StageOptions(sizing=SizingInput(spine="bf16", expert_cache_bytes=0, read_threads=2, prefill_chunk=512))
    # the budget of the stage with no layer resident: the smallest there is, so it is the one chosen
    budget = size_stage(cfg, 0, cfg.num_layers, Placement("cpu"), "bf16", 0, 0,
                        options.sizing_for(ckpt.config, layer_spans(ckpt))).total
    stage = Stage(ckpt, 0, cfg.num_layers, device=CPU, options=dataclasses.replace(options, memory_bytes=budget))
    assert stage.plan.streamed_layers == tuple(range(cfg.num_layers))
    try:
        want = resident.forward([SeqInput("r", 0, ids=IDS)], all_logits=True)[0].logits
        got = stage.forward([SeqInput("s", 0, ids=IDS)], all_logits=True)[0].logits
        assert torch.equal(got, want)
        # a pass in steady state: its layers, and the first one again for the next pass (read ahead)
        stage.spine.settle()
        before = stage.spine.streamed_bytes
        nxt = torch.tensor([int(want[-1].argmax())])
        got = stage.forward([SeqInput("s", len(IDS), ids=nxt)])[0].logits
        assert torch.equal(got, resident.forward([SeqInput("r", len(IDS), ids=nxt)])[0].logits)
        stored = sum(s.nbytes for i in range(cfg.num_layers) for s in cfg.layer_tensor_specs(i))
        stage.spine.settle()
        read = stage.spine.streamed_bytes - before
        assert stored <= read <= stored + cfg.num_layers * 2 * 4096
    finally:
        stage.close()
        resident.close()


def test_several_disks_split_the_reads_by_their_speed(tiny_dir, tmp_path):
    """A copy of the checkpoint on a second "disk" three times as fast: it reads three quarters of every layer's
    experts, and every expert still has its bytes."""
    cfg = load_config(tiny_dir)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    ckpt = open_checkpoint(tiny_dir, cfg)
    store = ExpertStore(ckpt, cfg.moe_layers, device=CPU, cache_bytes=0, threads=2,
                        copies=[open_checkpoint(copy, cfg)], disk_gbps=[1.0, 3.0])
    try:
        for layer in cfg.moe_layers:
            for e, got in store.experts(layer, list(range(cfg.num_experts))):
                loc = ckpt.expert(layer, e).tensors[0]
                with open(loc.file, "rb") as f:
                    f.seek(loc.offset)
                    want = torch.frombuffer(bytearray(f.read(loc.nbytes)), dtype=torch.uint8)
                assert torch.equal(got.w1.packed.reshape(-1), want)
        first, second = (d.bytes_read for d in store.disk_stats())
        assert second / (first + second) == pytest.approx(0.75, abs=0.05)
        assert {d.dir for d in store.disk_stats()} == {str(tiny_dir), str(copy)}
    finally:
        store.close()


def test_a_guess_another_thread_waits_for_is_never_dropped(tiny_dir, monkeypatch):
    """Thread A waits for an expert whose prefetch is being read; thread B then asks for other experts of the same
    layer (which drops that layer's guesses it does not want): A's read goes on, and nothing is read twice."""
    import threading
    import time

    from deltafin.weights.reader import SlotPool

    cfg = load_config(tiny_dir)
    layer = cfg.moe_layers[0]
    reading, gate, fill = threading.Event(), threading.Event(), SlotPool.fill

    def slow_fill(self, files, plan, slot, abort=None):
        if plan.tensors[0].name.endswith(f"layers.{layer}.block_sparse_moe.experts.0.w1.weight_packed"):
            reading.set()
            gate.wait(10)
        fill(self, files, plan, slot, abort)

    monkeypatch.setattr(SlotPool, "fill", slow_fill)
    store = ExpertStore(open_checkpoint(tiny_dir, cfg), cfg.moe_layers, device=CPU, cache_bytes=0, threads=2)
    try:
        store.prefetch(layer, [0])
        assert reading.wait(10)  # the guess is being read
        got: list[int] = []
        a = threading.Thread(target=lambda: got.extend(e for e, _ in store.experts(layer, [0])))
        a.start()
        deadline = time.monotonic() + 10
        while store.stats.prefetch_hits < 1 and time.monotonic() < deadline:  # A now waits for that read
            time.sleep(0.01)
        assert [e for e, _ in store.experts(layer, [1, 2])] == [1, 2]  # B drops the layer's guesses it does not want
        gate.set()
        a.join(10)
        assert got == [0] and store.stats.prefetch_cancelled == 0
        assert store.stats.layer(layer).expert_bytes == 3 * cfg.bytes_per_expert  # 0 once, 1 and 2
    finally:
        gate.set()
        store.close()


def test_one_machine_with_two_disks_reads_from_both(tiny_dir, tmp_path):
    """`--local --expert-dir COPY` (one Mac, two SSDs): the speeds are measured, the experts read from both disks,
    the logits those of one disk."""
    copy = tmp_path / "ssd2"
    shutil.copytree(tiny_dir, copy)
    resident = LocalPipeline.load(tiny_dir, 1, device="cpu")
    two = LocalPipeline.load(tiny_dir, 1, device="cpu", options=StageOptions(expert_dir=(str(copy),),
                                                                             sizing=SizingInput(expert_cache_bytes=0,
                                                                                                  read_threads=2)))
    try:
        want = resident.forward([SeqInput("a", 0, ids=IDS)], all_logits=True)[0].logits
        assert torch.equal(two.forward([SeqInput("a", 0, ids=IDS)], all_logits=True)[0].logits, want)
        disks = two.stages[0].stats().disks
        assert [d.dir for d in disks] == [str(tiny_dir), str(copy)]
        assert all(d.gbps > 0 and d.bytes_read > 0 for d in disks)
    finally:
        resident.close()
        two.close()
