"""`deltafin download` from a local directory: a stage's share loads and holds exactly its bytes, the shares
together are the source, an interrupted run resumes without reading again what it verified, and a small disk,
a damaged source or bad arguments fail clearly before anything is written."""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.manifest import MANIFEST, check_held, read_record
from deltafin.checkpoint.shards import INDEX_NAME, open_checkpoint
from deltafin.cli import commands as cli
from deltafin.cli.inspection import inspect_model
from deltafin.download.fetch import download
from deltafin.download.sources import LocalSource, open_source
from deltafin.errors import DeltafinError, ModelFormatError, NotHeld
from deltafin.mini.synth import synthesize
from deltafin.plan.cluster.expert_placement import split
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with every layer's experts after its spine, in id order: a share is one run of bytes,
    so the holes of the others are whole blocks on disk."""
    return synthesize("tiny", tmp_path_factory.mktemp("grouped"), seed=1, order="grouped", show_progress=False)


class Counting(LocalSource):
    """A local source that counts the bytes it reads and, given `fail_after`, fails like a dropped connection
    once that many have been read."""

    def __init__(self, root: Path, fail_after: int | None = None):
        super().__init__(root)
        self.read, self.fail_after = 0, fail_after

    def read_range(self, path, start, end):
        for piece in super().read_range(path, start, end):
            if self.fail_after is not None and self.read + len(piece) > self.fail_after:
                raise ConnectionError("connection reset by peer")
            self.read += len(piece)
            yield piece


def _get(source: Path, *args, **kw):
    return download(LocalSource(source), *args, show_progress=False, **kw)


def _bytes(loc) -> bytes:
    with open(loc.file, "rb") as f:
        f.seek(loc.offset)
        return f.read(loc.nbytes)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_share_of_a_stage_loads_and_holds_its_experts_only(grouped, tmp_path, n):
    cfg = load_config(grouped)
    src = open_checkpoint(grouped, cfg)
    for k in range(n):
        out = tmp_path / f"share{k}"
        summary = _get(grouped, out, layers="1-3", experts=f"{k}/{n}")
        ckpt = open_checkpoint(out, cfg, strict=False)
        ckpt.raise_problems(layers=range(1, 4), top=False)  # what the stage of layers 1-3 checks
        lo, hi = split(0, cfg.num_experts, [1.0] * n)[k:k + 2]
        moe = [i for i in range(1, 4) if cfg.is_moe(i)]
        Stage(ckpt, 1, 4, device=CPU, serves=moe).close()  # a wide stage loads (its share is checked by assign)
        with pytest.raises(NotHeld, match=f"holds only experts {lo}-{hi - 1}"):  # local experts: all of them
            Stage(ckpt, 1, 4, device=CPU)
        check_held(out, cfg, 1, 4, {i: range(lo, hi) for i in moe})  # the plan it was downloaded for
        with pytest.raises(NotHeld, match=f"experts {lo}-{hi} of layer {moe[0]}"):  # one expert more: refused
            check_held(out, cfg, 1, 4, {i: range(lo, hi + 1) for i in moe})
        with pytest.raises(NotHeld, match="holds only layers 1-3"):
            check_held(out, cfg, 0, 4, None)
        needed = 0
        for layer in range(1, 4):
            for spec in cfg.layer_tensor_specs(layer):
                assert _bytes(ckpt.location(spec)) == _bytes(src.location(spec))
                needed += spec.nbytes
            for e in range(cfg.num_experts):
                theirs, mine = src.expert(layer, e).tensors, ckpt.expert(layer, e).tensors
                for s, m in zip(theirs, mine, strict=True):
                    assert (m.file.name, m.offset) == (s.file.name, s.offset)  # the source's layout
                    assert _bytes(m) == (_bytes(s) if lo <= e < hi else bytes(s.nbytes))
                    needed += s.nbytes if lo <= e < hi else 0
        shards = {ckpt.tensors[spec.name].file.name for layer in range(1, 4) for spec in cfg.layer_tensor_specs(layer)}
        headers = sum(_header_bytes(grouped / s) for s in shards)
        metadata = sum(f.stat().st_size for f in grouped.iterdir() if not f.name.endswith(".safetensors"))
        assert summary.bytes_read == needed + headers + metadata  # nothing outside the share was read
        for s in shards:
            assert (out / s).stat().st_size == (grouped / s).stat().st_size  # apparent: the source's
            assert (out / s).stat().st_blocks * 512 < (grouped / s).stat().st_size  # on disk: less
        assert not (out / _shard_of(cfg, grouped, 4)).exists()  # other layers' shards are left out
        assert read_record(out).experts == (lo, hi)


def test_a_whole_stage_computes_what_the_source_computes(tiny_dir, tmp_path):
    out = tmp_path / "stage"
    _get(tiny_dir, out, layers="0-2")
    cfg = load_config(tiny_dir)
    ids = torch.tensor([3, 1, 4, 1, 5])
    outputs = []
    for d in (tiny_dir, out):
        stage = Stage(open_checkpoint(d, cfg, strict=False), 0, 3, device=CPU)
        (o,) = stage.forward([SeqInput("s", 0, ids=ids)])
        outputs.append(o.state)
    assert torch.equal(outputs[0].P, outputs[1].P) and torch.equal(outputs[0].B, outputs[1].B)
    report = inspect_model(out)
    assert report["problems"] == [] and report["download"]["layers"] == [0, 3]  # the others' shards: not problems
    assert report["layers_available"] == [0, 1, 2]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_shares_together_are_the_source(tiny_dir, tmp_path, n):
    outs = [tmp_path / f"s{k}" for k in range(n)]
    for k, out in enumerate(outs):
        _get(tiny_dir, out, experts=f"{k}/{n}")
    for f in sorted(tiny_dir.iterdir()):
        union = bytearray((outs[0] / f.name).read_bytes())
        for out in outs[1:]:  # holes read as zeros: OR-ing the shares puts every share's bytes in place
            for i, b in enumerate((out / f.name).read_bytes()):
                union[i] |= b
        assert bytes(union) == f.read_bytes(), f.name


def test_an_interrupted_download_resumes_reading_only_what_is_missing(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("deltafin.download.sources.PIECE", 4096)  # several pieces per shard
    full = Counting(tiny_dir)
    whole = download(full, tmp_path / "whole", layers="1-4", experts="0/2", show_progress=False)
    out = tmp_path / "out"
    flaky = Counting(tiny_dir, fail_after=full.read // 2)
    with pytest.raises(DeltafinError, match="run the same command again to resume"):
        download(flaky, out, layers="1-4", experts="0/2", show_progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    done = sum(b - a for spans in manifest["files"].values() for a, b in spans)
    assert not manifest["complete"] and done > 0 and not (out / "config.json").exists()  # metadata comes last
    again = Counting(tiny_dir)
    second = download(again, out, layers="1-4", experts="0/2", show_progress=False)
    assert second.bytes_read == whole.bytes_read - done and second.resumed_bytes == done
    planning = full.read - whole.bytes_read  # config, index and headers: read again by every run
    assert again.read == planning + whole.bytes_read - done
    for f in (tmp_path / "whole").iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert json.loads((out / MANIFEST).read_text())["complete"]
    third = Counting(tiny_dir)
    assert download(third, out, layers="1-4", experts="0/2", show_progress=False).bytes_read == 0
    assert third.read == planning


def test_a_disk_too_small_fails_before_anything_is_written(tiny_dir, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("deltafin.download.fetch.shutil.disk_usage", lambda path: usage(10**12, 10**12 - 10**6, 10**6))
    out = tmp_path / "nowhere"
    with pytest.raises(DeltafinError, match=r"writes up to .* but the disk has 1.0 MB free"):
        _get(tiny_dir, out, layers="0-1")
    assert not out.exists()


def test_a_damaged_source_is_named(tiny_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    cfg = load_config(src)
    shard = _shard_of(cfg, src, 2)
    with open(src / shard, "r+b") as f:
        f.truncate((src / shard).stat().st_size - 10)
    with pytest.raises(ModelFormatError, match=f"{shard} is .* bytes but its header's tensors end at byte"):
        _get(src, tmp_path / "out", layers="2-2")
    with open(src / shard, "r+b") as f:
        f.seek(8)
        f.write(b"{not json")
    with pytest.raises(ModelFormatError, match=f"{shard} has a corrupt JSON header"):
        _get(src, tmp_path / "out", layers="2")
    _get(src, tmp_path / "out", layers="3")  # the damaged shard is not needed here
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"]["language_model.model.layers.3.input_layernorm.weight"] = "model-99999.safetensors"
    (src / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(DeltafinError, match="lists model-99999.safetensors but .* has no such file"):
        _get(src, tmp_path / "out2", layers="3")


def test_bad_arguments_are_one_line_errors(tiny_dir, tmp_path, capsys):
    cases = [(["--layers", "0-6"], "outside the model's 6 layers (0-5)"), (["--layers", "3-1"], "outside"),
             (["--layers", "x"], "--layers takes A-B"), (["--experts", "2/2"], "0 <= K < N"),
             (["--experts", "0/0"], "N >= 1"), (["--experts", "a/b"], "--experts takes K/N"),
             (["--experts", "0-99"], "outside the model's 16 experts")]
    for extra, message in cases:
        assert cli.main(["download", str(tiny_dir), "--out", str(tmp_path / "o"), *extra]) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, extra
    assert not (tmp_path / "o").exists()
    with pytest.raises(DeltafinError, match="is the source itself"):
        _get(tiny_dir, tiny_dir)
    for bad in ("hf:justaname", "hf:org/name@", str(tmp_path / "missing")):
        with pytest.raises(DeltafinError, match="SOURCE"):
            open_source(bad)
    assert cli.main(["download", str(tiny_dir), "--out", str(tmp_path / "o"), "--layers", "5", "--quiet"]) == 0
    assert "6 files" in capsys.readouterr().out  # layer 5's shard, the head's and 4 metadata files


def _shard_of(cfg, root: Path, layer: int) -> str:
    index = json.loads((root / INDEX_NAME).read_text())["weight_map"]
    return index[cfg.layer_tensor_specs(layer)[0].name]


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_sizes_on_disk_are_reported(grouped, tmp_path):
    summary = _get(grouped, tmp_path / "o", experts="1/4")
    files = [f for f in (tmp_path / "o").iterdir() if f.name != MANIFEST]
    assert summary.files == len(files) == len(list(grouped.iterdir()))
    assert summary.bytes_apparent == sum(f.stat().st_size for f in grouped.iterdir())
    assert summary.bytes_on_disk == sum(f.stat().st_blocks * 512 for f in files) < summary.bytes_apparent
    assert os.path.getsize(tmp_path / "o" / MANIFEST) < 4096
