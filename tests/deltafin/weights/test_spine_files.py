"""A converted spine: written once (resumable, checksummed, keyed to its source), loaded without quantizing, equal
to the spine quantized as it loads; missing, stale and corrupt files are rebuilt or refused, never used."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.cli import commands as cli
from deltafin.errors import CorruptSpine, SpineNotConverted
from deltafin.kernels import quant
from deltafin.kernels.quant import Int8Weight, Q4Weight, dequantize_q4
from deltafin.runtime import stage_build
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights import spine_convert
from deltafin.weights.spine_convert import convert_checkpoint
from deltafin.weights.spine_files import SpineFiles, default_root
from deltafin.weights.tensors import read_tensor

IDS = torch.tensor([5, 9, 2, 7, 11, 3])


@pytest.fixture
def model(tiny_dir, tmp_path):
    """A copy of tiny of this test's own (its fingerprint, so its converted spines, are this test's)."""
    out = tmp_path / "tiny"
    shutil.copytree(tiny_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["deltafin_test"] = str(tmp_path)  # another fingerprint than every other copy
    (out / "config.json").write_text(json.dumps(config))
    return out


def _logits(model, spine: str, **options) -> torch.Tensor:
    pipe = LocalPipeline.load(model, 1, device="cpu", options=StageOptions().replace(spine=spine, **options))
    try:
        return pipe.forward([SeqInput("s", 0, ids=IDS)], all_logits=True)[0].logits
    finally:
        pipe.close()


@pytest.mark.parametrize("spine", ["q4", "int8"])
def test_converted_spine_is_the_spine_quantized_at_load(model, spine, monkeypatch):
    summary = convert_checkpoint(model, spine, progress=False)
    layers = load_config(model).num_layers
    assert summary["converted"] == summary["units"] == layers + 2  # its layers, the embedding, the head
    loaded = _logits(model, spine)
    shutil.rmtree(default_root(model, spine))
    monkeypatch.setattr(spine_convert, "free_bytes", lambda folder: 0)  # no room: quantized as it loads
    assert torch.equal(loaded, _logits(model, spine))


def test_without_room_a_streaming_plan_runs_as_asked_without_a_copy(model, monkeypatch, caplog):
    """No room to convert and a q4 plan that streams layers: the stage keeps the q4 it was asked for, quantized as
    its resident layers load, and reads the streamed ones as stored (no copy, no bf16 plan it was not asked for)."""
    monkeypatch.setattr(spine_convert, "free_bytes", lambda folder: 0)
    options = StageOptions(memory_bytes=4 * 10**9).replace(spine="q4", expert_cache_bytes=10**6,
                                                          max_resident_layers=3)  # the other 3 stream
    with caplog.at_level(logging.WARNING):
        pipe = LocalPipeline.load(model, 1, device="cpu", options=options)
    try:
        stage = pipe.stages[0]
        assert stage.plan.spine == "q4" and not stage.plan.converted and stage.spine_files is None
        assert "no room to write one" in caplog.text and "quantized as the resident layers load" in caplog.text
        assert stage_build.spine_layout(stage.plan) == "q4 0-2, stored 3-5"
        assert not default_root(model, "q4").exists() or not list(default_root(model, "q4").glob("*.bin"))
    finally:
        pipe.close()


def test_a_converted_spine_loads_without_quantizing(model, monkeypatch):
    convert_checkpoint(model, "q4", progress=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a converted spine was quantized again")

    monkeypatch.setattr(quant, "quantize_q4", refuse)  # the formats' quantizers, wherever they are called from
    monkeypatch.setattr(quant, "quantize_int8_rows", refuse)
    pipe = LocalPipeline.load(model, 1, device="cpu", options=StageOptions().replace(spine="q4"))
    try:
        stage = pipe.stages[0]
        kinds = {type(w) for lw in stage.spine.resident.values() for w in vars(lw.attn).values()}
        assert Q4Weight in kinds and Int8Weight in kinds  # q4 bulk, the 8-bit projections row-int8
    finally:
        pipe.close()


def test_converted_q4_is_within_half_a_step_of_the_stored_weights(model):
    convert_checkpoint(model, "q4", progress=False)
    pipe = LocalPipeline.load(model, 1, device="cpu", options=StageOptions().replace(spine="q4"))
    try:
        cfg, stage = pipe.config, pipe.stages[0]
        q = stage.spine.resident[0].attn.q
        stored = read_tensor(stage.ckpt.location(next(s for s in cfg.layer_tensor_specs(0)
                                                      if s.name.endswith("self_attn.q_proj.weight")))).float()
        assert isinstance(q, Q4Weight)
        # the nearest of a group's 16 levels over the range its clipping search chose, [bias, bias + 15 steps]: a
        # value inside that range within half a step of it, one outside clipped to the nearer end, so each within
        # half a step of itself clamped to the range (fp16 scale and bias rounding: the 1e-3 step)
        step = q.scales.float().repeat_interleave(64, dim=1)
        lo = q.biases.float().repeat_interleave(64, dim=1)
        clamped = torch.minimum(torch.maximum(stored, lo), lo + 15 * step)
        assert bool(((dequantize_q4(q, torch.float32) - clamped).abs() <= 0.5 * step + 1e-3 * step).all())
    finally:
        pipe.close()


def test_an_interrupted_conversion_resumes(model, monkeypatch):
    real, calls = spine_convert._convert_unit, []

    def fail_third(ckpt, fmt, folder, unit, done, device=None):
        calls.append(unit)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(ckpt, fmt, folder, unit, done, device)

    monkeypatch.setattr(spine_convert, "_convert_unit", fail_third)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(model, "q4", progress=False)
    folder = default_root(model, "q4")
    assert sorted(SpineFiles.open(folder, "q4").manifest["units"]) == sorted(calls[:2])
    assert not list(folder.glob("*.tmp"))  # the unit being written went away with the interruption
    monkeypatch.setattr(spine_convert, "_convert_unit", real)
    summary = convert_checkpoint(model, "q4", progress=False)
    assert (summary["converted"], summary["verified"], summary["rebuilt"]) == (summary["units"] - 2, 2, 0)


def _corrupt(model, unit: str = "layer-001") -> None:
    path = default_root(model, "q4") / f"{unit}.bin"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_unit_is_rebuilt_or_refused_never_used(model, caplog):
    convert_checkpoint(model, "q4", progress=False)
    want = _logits(model, "q4")
    _corrupt(model)
    with pytest.raises(CorruptSpine, match="layer-001.bin is corrupt"):
        _logits(model, "q4", convert=False)
    with caplog.at_level(logging.WARNING, logger="deltafin.weights.spine_convert"):
        assert torch.equal(_logits(model, "q4"), want)
    assert "rebuilding" in caplog.text
    _corrupt(model, "head")
    summary = convert_checkpoint(model, "q4", progress=False)
    assert (summary["rebuilt"], summary["verified"], summary["converted"]) == (1, summary["units"] - 1, 0)


def test_missing_or_stale_spines_are_converted_or_refused(model):
    with pytest.raises(SpineNotConverted, match="deltafin convert --model .* --spine q4"):
        _logits(model, "q4", convert=False)
    want = _logits(model, "q4")  # converted first, by itself
    assert SpineFiles.open(default_root(model, "q4"), "q4").has("layer-000")
    folder = default_root(model, "q4")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["source"] = "0" * 16
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpineNotConverted, match="converted from another checkpoint"):
        _logits(model, "q4", convert=False)
    assert torch.equal(_logits(model, "q4"), want)
    assert SpineFiles.open(folder, "q4").manifest["source"] != "0" * 16


def test_conversion_never_writes_into_the_model_directory(model, tmp_path):
    before = sorted(p.name for p in model.iterdir())
    out = tmp_path / "elsewhere"
    summary = convert_checkpoint(model, "int8", out, progress=False)
    assert summary["dir"] == str(out) and (out / "manifest.json").is_file()
    assert sorted(p.name for p in model.iterdir()) == before
    assert torch.equal(_logits(model, "int8", spine_dir=str(out)), _logits(model, "int8"))


def test_download_then_convert_a_workers_part(model, tmp_path, capsys):
    """`deltafin download --convert q4` fetches layers 3-5 (the last stage) and converts what it holds: its
    layers, the head and (tiny keeps them in one shard) the embedding; `deltafin convert` then checks them."""
    out = tmp_path / "part"
    assert cli.main(["download", str(model), "--out", str(out), "--layers", "3-5", "--convert", "q4",
                     "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["units"], summary["converted"]) == (3 + 2, 3 + 2)
    files = SpineFiles.open(default_root(out, "q4"), "q4")
    assert sorted(files.manifest["units"]) == ["embed", "head", "layer-003", "layer-004", "layer-005"]
    assert cli.main(["convert", "--model", str(out), "--quiet"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["converted"], again["verified"], again["rebuilt"]) == (0, 5, 0)


def test_a_convert_that_only_waited_for_the_lock_reports_it_converted_nothing(model, tmp_path, caplog):
    """Another process holds the folder's lock and completes the copy meanwhile: this `convert` waited, converted
    nothing itself, and says so (it reported every part as converted by itself)."""
    done = tmp_path / "done"
    convert_checkpoint(model, "q4", out=done, progress=False)  # what the other process will have written
    folder = default_root(model, "q4")
    folder.mkdir(parents=True)
    result: dict = {}
    with caplog.at_level(logging.INFO, logger="deltafin.weights"), spine_convert.folder_lock(folder):
        waiter = threading.Thread(target=lambda: result.update(convert_checkpoint(model, "q4", progress=False)))
        waiter.start()
        deadline = time.monotonic() + 60
        while "waiting for another process" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiter.is_alive() and "waiting for another process" in caplog.text
        for f in done.iterdir():
            if f.name != ".lock":
                shutil.copy(f, folder / f.name)
    waiter.join(60)
    units = result["units"]
    assert (result["converted"], result["converted_by_another"], result["verified"]) == (0, units, 0)
    assert result["note"] == (f"another process converted {units} of the parts while this one waited for the lock: "
                              "the copy was already complete")


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["convert", "--model", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err
