"""Synthetic checkpoints: exact K3 layout, determinism, scaled tokenizer files, k3-slice real widths."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import tiktoken

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.errors import DeltafinError
from deltafin.mini.synth import synthesize
from deltafin.text import vocab


def _digest(d: Path) -> dict[str, str]:
    # every file: nothing (a derived tokenizer, say) may be written into a model directory
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_is_byte_identical(tiny_dir: Path, tmp_path: Path):
    again = synthesize("tiny", tmp_path / "again", seed=0, show_progress=False)
    other = synthesize("tiny", tmp_path / "other", seed=1, show_progress=False)
    assert _digest(again) == _digest(tiny_dir)
    a, b = _digest(tiny_dir), _digest(other)
    assert a["config.json"] == b["config.json"]
    assert all(a[n] != b[n] for n in a if n.endswith(".safetensors"))


def test_k3_layout(tiny_dir: Path):
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["architectures"] == ["KimiK3ForConditionalGeneration"]
    text = raw["text_config"]
    assert {"linear_attn_config", "quantization_config"} <= set(text)
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(name.startswith("language_model.") for name in index)
    assert len(set(index.values())) == 7  # one shard per layer + embedding/head
    # the dtypes the real model stores
    cfg = load_config(tiny_dir)
    from deltafin.checkpoint.shards import open_checkpoint

    ckpt = open_checkpoint(tiny_dir, cfg)
    dtypes = {name.split("layers.1.")[-1]: loc.dtype for name, loc in ckpt.tensors.items()
              if ".layers.1." in name and ".experts." not in name}
    assert dtypes["self_attn.q_conv1d.weight"] == "F32" and dtypes["self_attn.A_log"] == "F32"
    assert dtypes["self_attn.dt_bias"] == "F32" and dtypes["self_attn.o_norm.weight"] == "F32"
    assert dtypes["block_sparse_moe.gate.e_score_correction_bias"] == "F32"
    assert dtypes["self_attn.q_proj.weight"] == "BF16" and dtypes["block_sparse_moe.gate.weight"] == "BF16"
    assert ckpt.tensors["language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"].dtype == "U8"


def test_tokenizer_files_scale_k3_specials(tiny_dir: Path):
    cfg = load_config(tiny_dir)
    base = cfg.vocab_size - 256
    tok_cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert len(tok_cfg) == 256
    # same offsets from the base vocabulary as K3's 163584..163839
    for k3_id, text in [(163584, "[BOS]"), (163585, "[EOS]"), (163586, "<|end_of_msg|>"), (163587, "<|open|>"),
                        (163588, "<|close|>"), (163589, "<|sep|>"), (163838, "[UNK]"), (163839, "[PAD]")]:
        assert tok_cfg[str(k3_id - 163584 + base)]["content"] == text
    assert tok_cfg[str(base + 100)]["content"] == f"<|reserved_token_{base + 100}|>"
    assert cfg.eos_token_id == base + 2 and cfg.bos_token_id == base and cfg.pad_token_id == base + 255
    ranks = vocab.read_tiktoken(tiny_dir / "tiktoken.model")
    assert len(ranks) == base and sorted(ranks.values()) == list(range(base))
    # every merged token is reachable: BPE with lower ranks splits it into exactly two tokens
    for token, rank in ranks.items():
        if len(token) > 1:
            assert len(vocab.bpe_split(ranks, token, rank)) == 2, token
    enc = tiktoken.Encoding("synthetic", pat_str=r"\s+|\S+", mergeable_ranks=ranks, special_tokens={})
    text = "The quick brown fox 人工智能 🙂 def forward(self):"
    assert enc.decode(enc.encode(text)) == text
    assert len(enc.encode(text)) < len(text.encode())  # merges happen


def test_k3_slice_has_real_widths():
    cfg = parse_config(preset_config("k3-slice", layers=3))
    assert cfg.hidden_size == 7168 and cfg.num_heads == 96 and cfg.kda_heads == 96
    assert cfg.num_experts == 896 and cfg.latent_dim == 3584 and cfg.moe_intermediate_size == 3072
    assert cfg.bytes_per_expert == 17_547_264
    assert [k.value for k in cfg.layer_kinds] == ["kda", "kda", "mla"]
    assert cfg.expert_bytes_per_token() == 2 * 16 * 17_547_264  # 561.5 MB, as docs/PERF.md's slice
    two = parse_config(preset_config("k3-slice", layers=2))
    assert [k.value for k in two.layer_kinds] == ["kda", "mla"] and two.moe_layers == (1,)


def test_bad_preset_arguments():
    with pytest.raises(DeltafinError, match="unknown preset 'huge'"):
        preset_config("huge")
    with pytest.raises(DeltafinError, match="at least 2"):
        preset_config("k3-slice", layers=1)


def test_canonical_order_is_what_safetensors_writes(tiny_dir: Path, tmp_path: Path):
    """The shards' tensor order is safetensors' own: re-saving a shard with `save_file` gives the same header."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(tiny_dir.glob("*.safetensors"))[:2]:
        again = tmp_path / shard.name
        save_file(load_file(shard), again, metadata={"format": "pt"})
        assert _header(again) == _header(shard)
        assert _data(again) == _data(shard)  # and the same bytes in the same places


def test_grouped_order_puts_the_spine_first_then_each_expert(tmp_path: Path):
    grouped = synthesize("tiny", tmp_path / "grouped", seed=0, show_progress=False, order="grouped")
    header = _header(grouped / "model-00002-of-00007.safetensors")
    names = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    first_expert = next(i for i, n in enumerate(names) if ".experts." in n)
    assert all(".experts." in n for n in names[first_expert:])
    assert names[first_expert:first_expert + 6] == [
        f"language_model.model.layers.1.block_sparse_moe.experts.0.{w}.{p}"
        for w in ("w1", "w2", "w3") for p in ("weight_packed", "weight_scale")]
    canonical = _header(synthesize("tiny", tmp_path / "canonical", seed=0, show_progress=False)
                        / "model-00002-of-00007.safetensors")
    assert set(canonical) == set(header) and canonical != header  # the same tensors, placed differently


def test_bytes_do_not_depend_on_the_cpu_path(tiny_dir: Path, tmp_path: Path):
    """Same files with torch's and numpy's SIMD dispatch forced to their portable paths: nothing in synth
    depends on the vector instructions a CPU has (AVX2 and AVX-512 machines must agree)."""
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default",
           "NPY_DISABLE_CPU_FEATURES": "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX2 FMA3"}
    out = tmp_path / "portable"
    subprocess.run([sys.executable, "-m", "deltafin", "-q", "synth", "--preset", "tiny", "--quiet", "--out",
                    str(out)], check=True, env=env, capture_output=True)
    assert _digest(out) == _digest(tiny_dir)


def _data(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[8 + int.from_bytes(raw[:8], "little"):]


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


# sha256 over `sha256sum *` of seed 0's files: the same on every machine (AVX2, AVX-512, Arm), as recorded
# when these presets were written; `mini` is where k3-mini's training starts (deltafin/mini/recipe.py)
PINNED = {"tiny": "37c536e59024c7a0e62455e20c8d6b38a14b25cd37e6dd58418f79fcb312e341",
          "mini": "cab041dcccdea4fb23b7703b4c3a4aa957fef42be2729cb0cb719c3987dfe59c"}


def test_presets_are_the_same_bytes_everywhere(tiny_dir: Path, tmp_path: Path):
    mini = synthesize("mini", tmp_path / "mini", seed=0, show_progress=False)
    for name, d in (("tiny", tiny_dir), ("mini", mini)):
        listing = "".join(f"{digest}  {file}\n" for file, digest in _digest(d).items())
        assert hashlib.sha256(listing.encode()).hexdigest() == PINNED[name], name
