"""The routed experts' low-bit copy (weights/expert_copy.py): written once, each expert where the store reads it and
as the format rounds it, resumed and refreshed, refused with what to do; and stages that read it, streamed and
resident, in every expert mode that names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.errors import DeltafinError
from deltafin.expert_modes import parse
from deltafin.formats import low_bit_format
from deltafin.kernels.quant import dequantize_mxfp4, dequantize_q3
from deltafin.models.mode_routing import mode_router
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights import expert_copy
from deltafin.weights.expert_copy import ExpertCopy, copy_bytes, layer_file, prepare_copy, whole_layers
from deltafin.weights.store import ExpertStore
from deltafin.weights.tensors import read_expert

CPU = torch.device("cpu")
Q3 = low_bit_format("q3")
IDS = torch.tensor([5, 100, 300, 7, 9, 700, 12, 44, 3, 1000, 2, 17])


def _arrays_in_file(copy: ExpertCopy, layer: int, e: int) -> list[bytes]:
    """An expert's arrays read straight from its layer's file at the documented place: expert e at e * stride, its
    arrays back to back, w1's, w2's then w3's, each of the format's part sizes."""
    data = (copy.root / layer_file(layer)).read_bytes()[e * copy.stride:(e + 1) * copy.stride]
    out, at = [], 0
    for rows, cols in copy.config.expert_matrices:
        for n in Q3.parts(rows, cols):
            out.append(data[at:at + n])
            at += n
    return out


def test_the_store_reads_each_expert_of_the_copy_where_the_file_holds_it(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    copy = prepare_copy(ckpt, "q3", whole_layers(cfg, range(cfg.num_layers)), root=tmp_path, progress=False)
    assert all(copy.written(i) == [range(cfg.num_experts)] for i in cfg.moe_layers)
    assert sum((tmp_path / layer_file(i)).stat().st_size for i in cfg.moe_layers) == \
        copy_bytes(cfg, Q3, len(cfg.moe_layers) * cfg.num_experts)
    store = ExpertStore(ckpt, cfg.moe_layers, device=CPU, cache_bytes=0, threads=2, low=copy)
    try:
        for layer in cfg.moe_layers:
            ids = [cfg.num_experts + e for e in range(cfg.num_experts)]
            for got_id, got in store.experts(layer, ids):
                e = got_id - cfg.num_experts
                mats = (got.w1, got.w2, got.w3)
                held = [bytes(a.contiguous().view(torch.uint8).flatten().numpy()) for m in mats
                        for a in Q3.arrays(m)]
                assert held == _arrays_in_file(copy, layer, e)
                stored = read_expert(ckpt, layer, e)
                for m, s in zip(mats, (stored.w1, stored.w2, stored.w3), strict=True):
                    exact = dequantize_mxfp4(s, torch.float64)
                    step = m.scales.double().repeat_interleave(m.group, 1)
                    # within a step of the stored value (half a step of rounding, a clipped end at most 20 % of a
                    # group's half range: 0.7 of its 7 steps... bounded here by the group's own range)
                    err = (dequantize_q3(m, torch.float64) - exact).abs()
                    span = exact.view(exact.shape[0], -1, m.group)
                    span = (span.amax(-1) - span.amin(-1)).repeat_interleave(m.group, 1)
                    assert bool((err <= torch.maximum(step / 2, 0.2 * span / 2) + 1e-3 * span + 1e-12).all())
        assert store.snapshot_stats().misses == len(cfg.moe_layers) * cfg.num_experts
        per_layer = store.stats.layer(cfg.moe_layers[0]).expert_bytes
        assert per_layer == cfg.num_experts * sum(Q3.matrix_bytes(r, c) for r, c in cfg.expert_matrices)
    finally:
        store.close()


def test_a_conversion_resumes_refreshes_a_stale_copy_and_says_what_to_do(tiny_dir: Path, tmp_path: Path,
                                                                         monkeypatch) -> None:
    """A worker's share first (half of one layer's experts), then whole layers: only what is missing is converted;
    the manifest names what was written; a stale copy is converted again from scratch."""
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    e_count, first = cfg.num_experts, cfg.moe_layers[0]
    done: list[tuple[int, list[int]]] = []
    real = expert_copy._convert_layer
    monkeypatch.setattr(expert_copy, "_convert_layer", lambda ckpt, copy, layer, ids, *a: done.append(
        (layer, list(ids))) or real(ckpt, copy, layer, ids, *a))
    half = range(e_count // 4, e_count // 2)
    copy = prepare_copy(ckpt, "q3", {first: half}, root=tmp_path, progress=False)
    assert done == [(first, list(half))] and copy.written(first) == [half]
    assert copy.holds(first, half.start) and not copy.holds(first, 0)
    with pytest.raises(DeltafinError, match=f"deltafin convert --model {tiny_dir} --experts q3"):
        prepare_copy(ckpt, "q3", whole_layers(cfg, cfg.moe_layers), root=tmp_path, convert=False)
    done.clear()
    copy = prepare_copy(ckpt, "q3", whole_layers(cfg, cfg.moe_layers), root=tmp_path, progress=False)
    rest = [e for e in range(e_count) if e not in half]
    assert done == [(first, rest)] + [(i, list(range(e_count))) for i in cfg.moe_layers[1:]]
    assert all(copy.written(i) == [range(e_count)] for i in cfg.moe_layers)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["layers"][str(first)] == [[0, e_count]] and manifest["source"] == copy.manifest["source"]
    manifest["recipe"] = "an older rounding"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    done.clear()
    prepare_copy(ckpt, "q3", {first: half}, root=tmp_path, progress=False)
    assert done == [(first, list(half))]  # stale: converted again, the other layers' files gone with the old manifest
    assert not (tmp_path / layer_file(cfg.moe_layers[1])).exists()
    monkeypatch.setattr(expert_copy, "free_bytes", lambda folder: 10**9)
    with pytest.raises(DeltafinError, match="free some room"):
        prepare_copy(ckpt, "q3", whole_layers(cfg, cfg.moe_layers), root=tmp_path)
    with pytest.raises(DeltafinError, match=r"unknown mode 'q9'.*\(q3\)"):
        prepare_copy(ckpt, "q9", {first: half}, root=tmp_path)


def test_an_expert_beyond_the_converted_share_is_read_as_stored(tiny_dir: Path, tmp_path: Path) -> None:
    """A wide worker converts its share; asked for the copy of another expert (a prompt's spilled one), its store
    reads the stored expert instead of a hole."""
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    layer, e_count = cfg.moe_layers[0], cfg.num_experts
    copy = prepare_copy(ckpt, "q3", {layer: range(0, 2)}, root=tmp_path, progress=False)
    store = ExpertStore(ckpt, [layer], device=CPU, cache_bytes=0, threads=2, low=copy)
    try:
        got = dict(store.experts(layer, [e_count + 1, e_count + 5]))
        assert low_bit_format("q3").weight.load() is type(got[e_count + 1].w1)
        stored = read_expert(ckpt, layer, 5)
        assert torch.equal(got[e_count + 5].w1.packed, stored.w1.packed)
    finally:
        store.close()


def _logits(model: Path, mode: str, streamed: bool, held=None, **opts) -> tuple[torch.Tensor, LocalPipeline]:
    options = StageOptions(expert_mode=mode, **opts)
    if streamed:
        options = options.replace(expert_cache_bytes=0, read_threads=2)
    pipe = LocalPipeline.load(model, 1, device="cpu", options=options)
    if held is not None:
        pipe.stages[0].router = mode_router(pipe.stages[0].cfg, parse(mode), held)
    out = pipe.forward([SeqInput("s", 0, ids=IDS)], all_logits=True)[0].logits.float()
    return out, pipe


def test_a_stage_reads_the_copy_in_the_modes_that_name_it(tiny_dir: Path) -> None:
    """q3 streamed from the converted copy computes what a resident stage computes rounding in memory (the same
    rounding, bit for bit); a tail streamed with nothing held (no cache, no read-ahead) computes what a resident stage
    computes told nothing is held; both differ from exact, and top-p composes with them."""
    exact, pipe = _logits(tiny_dir, "exact", False)
    pipe.close()
    resident, pipe = _logits(tiny_dir, "q3", False)
    pipe.close()
    streamed, pipe = _logits(tiny_dir, "q3", True)
    store = pipe.stages[0].experts
    assert store.id_count == 2 * pipe.config.num_experts and store.snapshot_stats().misses > 0
    pipe.close()
    assert torch.equal(streamed, resident) and not torch.allclose(streamed, exact, atol=1e-3)
    nothing = lambda layer: []
    tail_resident, pipe = _logits(tiny_dir, "top-p:0.9+q3-tail:0.4", False, held=nothing)
    pipe.close()
    tail_streamed, pipe = _logits(tiny_dir, "top-p:0.9+q3-tail:0.4", True, prefetch=False)
    pipe.close()
    assert torch.equal(tail_streamed, tail_resident)
    assert not torch.equal(tail_resident, resident) and not torch.allclose(tail_resident, exact, atol=1e-3)
    held_all, pipe = _logits(tiny_dir, "q3-tail:0.4", False)  # resident: every expert is held as stored
    pipe.close()
    assert torch.equal(held_all, exact)


def test_a_stage_refuses_a_missing_copy_without_conversion(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(expert_copy, "default_root", lambda model_dir, fmt: tmp_path / fmt)  # none converted there
    options = StageOptions(expert_mode="q3-tail:0.5", convert=False).replace(expert_cache_bytes=0, read_threads=2)
    with pytest.raises(DeltafinError, match="is not converted yet|leave out --no-convert"):
        LocalPipeline.load(tiny_dir, 1, device="cpu", options=options)
    assert not (tmp_path / "q3").exists()
