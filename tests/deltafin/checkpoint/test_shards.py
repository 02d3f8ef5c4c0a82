"""Checkpoint index from headers: locations match safetensors' own reader; every corruption is named."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint, scan_checkpoint
from deltafin.cli.commands import main
from deltafin.errors import ModelFormatError


def test_locations_match_safetensors_reader(tiny_dir: Path):
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    assert not ckpt.problems
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(ckpt.tensors) == set(index)
    for fname in set(index.values()):
        with safe_open(tiny_dir / fname, "pt") as f, open(tiny_dir / fname, "rb") as raw:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                loc = ckpt.tensors[name]
                raw.seek(loc.offset)
                expected = f.get_tensor(name)
                assert list(expected.shape) == list(loc.shape)
                assert raw.read(loc.nbytes) == expected.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_experts_are_contiguous_in_spec_order(tiny_dir: Path):
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            loc = ckpt.expert(layer, e)
            assert loc.contiguous and loc.nbytes == cfg.bytes_per_expert
            offsets = [t.offset for t in loc.tensors]
            assert offsets == sorted(offsets)  # w1p|w1s|w2p|w2s|w3p|w3s
            assert [t.name.split(".")[-2] + "." + t.name.split(".")[-1] for t in loc.tensors] == [
                "w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale",
                "w3.weight_packed", "w3.weight_scale"]
            path, start, end = loc.span
            assert end - start == cfg.bytes_per_expert and path.name == f"model-{layer + 1:05d}-of-00007.safetensors"


def test_scattered_expert_is_detected(tiny_dir: Path, tmp_path: Path):
    d = _copy(tiny_dir, tmp_path)
    shard = d / "model-00002-of-00007.safetensors"
    # move expert 0's w3 scale to the end of the file: its six tensors no longer form one span
    header, n = _header(shard)
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w3.weight_scale"
    begin, end = header[name]["data_offsets"]
    last = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header[name]["data_offsets"] = [last, last + (end - begin)]
    _write_header(shard, header, n, extra_data=b"\0" * (end - begin))
    ckpt = scan_checkpoint(d, load_config(d))
    assert not ckpt.expert(1, 0).contiguous and ckpt.expert(1, 1).contiguous


def _copy(src: Path, tmp: Path) -> Path:
    dst = tmp / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), n


def _write_header(path: Path, header: dict, n: int, extra_data: bytes = b"") -> None:
    """Replace the header of a shard (keeping its data), re-padding it to 8 bytes."""
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:] + extra_data)


def _corrupt_truncate(d: Path) -> None:
    shard = d / "model-00003-of-00007.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])


def _corrupt_missing_tensor(d: Path) -> None:
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["language_model.model.layers.3.self_attn.kv_b_proj.weight"]
    index_path.write_text(json.dumps(index))


def _corrupt_dtype(d: Path) -> None:
    shard = d / "model-00002-of-00007.safetensors"
    header, n = _header(shard)
    header["language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight_packed"]["dtype"] = "I8"
    header["language_model.model.layers.1.self_attn.dt_bias"]["dtype"] = "I32"
    _write_header(shard, header, n)


def _corrupt_json(d: Path) -> None:
    shard = d / "model-00004-of-00007.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"{not json!!}"
    shard.write_bytes(bytes(data))


def _corrupt_header_length(d: Path) -> None:
    shard = d / "model-00005-of-00007.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", len(data) + 1000) + data[8:])


def _corrupt_missing_shard(d: Path) -> None:
    (d / "model-00006-of-00007.safetensors").unlink()


CORRUPTIONS = {
    "truncated shard": (_corrupt_truncate, ["shard model-00003-of-00007.safetensors is truncated: ",
                                            "tensors are cut off (layers 2): copy or download it again"]),
    "missing tensor": (_corrupt_missing_tensor, ["missing tensor language_model.model.layers.3.self_attn."
                                                 "kv_b_proj.weight"]),
    "wrong dtype": (_corrupt_dtype, ["tensor language_model.model.layers.1.block_sparse_moe.experts.5.w2."
                                     "weight_packed has dtype I8, expected U8",
                                     "tensor language_model.model.layers.1.self_attn.dt_bias has dtype I32, "
                                     "expected a float dtype"]),
    "bad JSON header": (_corrupt_json, ["shard model-00004-of-00007.safetensors has a corrupt JSON header"]),
    "header length past end": (_corrupt_header_length, ["shard model-00005-of-00007.safetensors declares a "]),
    "missing shard": (_corrupt_missing_shard, ["shard model-00006-of-00007.safetensors is listed in "
                                               "model.safetensors.index.json but missing"]),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupted_checkpoint_is_rejected_by_name(tiny_dir: Path, tmp_path: Path, kind: str, capsys):
    corrupt, expected = CORRUPTIONS[kind]
    d = _copy(tiny_dir, tmp_path)
    corrupt(d)
    with pytest.raises(ModelFormatError) as e:
        open_checkpoint(d, load_config(d))
    for text in expected:
        assert text in str(e.value)
    # The same problems through the CLI: exit 1, the problem named, no traceback.
    assert main(["inspect", "--model", str(d)]) == 1
    out = capsys.readouterr()
    for text in expected:
        assert text in out.out
    assert "Traceback" not in out.out + out.err


def test_problems_are_attributed_to_layers(tiny_dir: Path, tmp_path: Path):
    d = _copy(tiny_dir, tmp_path)
    _corrupt_missing_shard(d)  # layer 5's shard
    ckpt = scan_checkpoint(d, load_config(d))
    assert ckpt.layers_available() == (0, 1, 2, 3, 4)
    assert ckpt.top_available
    ckpt.raise_problems(layers=[0, 1])  # a stage that does not need layer 5 can still load


def test_a_truncated_shard_is_one_problem_naming_its_layers(tiny_dir: Path, tmp_path: Path, capsys):
    """A shard cut in half: one problem for the file (not one a tensor, and none saying a tensor is "not in that
    shard's header", which it is), with the layers it leaves out, which are then not available; inspect prints
    that one line."""
    d = _copy(tiny_dir, tmp_path)
    shard = d / "model-00003-of-00007.safetensors"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    ckpt = scan_checkpoint(d, load_config(d))
    assert len(ckpt.problems) == 1 and ckpt.problems[0].damage
    p = ckpt.problems[0]
    assert p.message.startswith("shard model-00003-of-00007.safetensors is truncated") and "(layers 2)" in p.message
    assert 2 not in ckpt.layers_available() and 1 in ckpt.layers_available()
    assert main(["inspect", "--model", str(d)]) == 1
    out = capsys.readouterr().out
    assert "1 problem(s):" in out and "not in that shard's header" not in out


def test_inspect_cli_subprocess_has_no_traceback(tmp_path: Path):
    r = subprocess.run([sys.executable, "-m", "deltafin", "inspect", "--model", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "no config.json in" in r.stderr and "Traceback" not in r.stderr


def test_inspect_json_on_tiny(tiny_dir: Path, capsys):
    assert main(["inspect", "--model", str(tiny_dir), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["num_layers"] == 6 and r["kda_layers"] == [0, 1, 2, 4] and r["mla_layers"] == [3, 5]
    assert [x["ffn"] for x in r["layers"]] == ["dense"] + ["moe"] * 5
    assert [x["attn_res_blocks"] for x in r["layers"]] == [0, 1, 1, 2, 2, 3]
    ex = r["experts"]
    # tiny: experts of 32x32 (w1, w3) and 32x32 (w2) MXFP4: 512 packed + 32 scale bytes per matrix
    assert ex["bytes_per_expert"] == 3 * (32 * 16 + 32 * 1)
    assert ex["contiguous"] == 5 * 16 and ex["all_contiguous"]
    assert ex["bytes_per_token"] == 5 * 4 * ex["bytes_per_expert"]
    # the sum of spine bytes equals the bytes of every non-expert tensor in the shards
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    ckpt = open_checkpoint(tiny_dir, load_config(tiny_dir))
    non_expert = sum(ckpt.tensors[n].nbytes for n in index if ".experts." not in n)
    assert r["spine_bytes"]["total"] == non_expert
    assert r["problems"] == []
