"""Exporting trained parameters: the K3 layout back, every tensor as the parameters say (MXFP4 experts
decoded to the same values), the config marked as trained instead of synthetic."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import scan_checkpoint
from deltafin.mini.export import export
from deltafin.mini.train import load_parameters
from deltafin.text.vocab import read_tiktoken


def _tensors(model_dir):
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(model_dir / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def test_export_of_a_checkpoints_parameters_gives_the_checkpoint_back(tiny_dir, tmp_path):
    cfg = load_config(tiny_dir)
    raw = json.loads((tiny_dir / "config.json").read_text())
    params = load_parameters(cfg, tiny_dir, torch.device("cpu"))
    out = export(raw, params, read_tiktoken(tiny_dir / "tiktoken.model"), tmp_path / "out", {"steps": 0})
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tiny_dir.iterdir())
    assert scan_checkpoint(out, cfg).problems == []
    for name in ("tiktoken.model", "tokenizer_config.json", "model.safetensors.index.json"):
        assert (out / name).read_bytes() == (tiny_dir / name).read_bytes()
    written = json.loads((out / "config.json").read_text())
    assert "deltafin_synthetic" not in written and written["deltafin_trained"] == {"steps": 0}
    assert written["text_config"] == raw["text_config"]
    before, after = _tensors(tiny_dir), _tensors(out)
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype and after[name].shape == t.shape, name
        if name.endswith("weight_packed"):  # E2M1 has two zeros (codes 0 and 8): compare the values
            scale = name.replace("weight_packed", "weight_scale")
            from deltafin.kernels.quant import MXFP4Weight, dequantize_mxfp4

            assert torch.equal(dequantize_mxfp4(MXFP4Weight(after[name], after[scale])),
                               dequantize_mxfp4(MXFP4Weight(t, before[scale]))), name
        else:
            assert torch.equal(after[name], t), name
