"""Synthetic checkpoints in the exact Hugging Face Kimi K3 layout (K3_SPEC §1), with random weights.

Presets:
  tiny      a few MB: dense layer 0, KDA, MLA, MoE and three AttnRes blocks; what the tests use
  small     tens of MB: the same structure, wider
  k3-slice  real K3 widths (hidden 7168, 96 heads, 896 experts of 3584x3072 MXFP4, 17,547,264 bytes
            each) for the first N layers, vocabulary reduced: what the streaming benchmarks use

Layout: one shard per decoder layer plus one for embedding/head/norms (as the real checkpoint), names
prefixed `language_model.`, each expert's six MXFP4 tensors back to back (w1p|w1s|w2p|w2s|w3p|w3s),
BF16/F32 where the real model has them, `tiktoken.model` + `tokenizer_config.json` whose 256 specials
sit at the same offsets from the base vocabulary as K3's. Weights are scaled so activations stay O(1)
through depth and the router spreads tokens over many experts. Same seed -> byte-identical files.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltafin import vocab
from deltafin.config import MXFP4_GROUP, ExpertFormat, ModelConfig, TensorSpec, parse_config
from deltafin.errors import DeltafinError
from deltafin.presets import K3_LINEAR, K3_TEXT, PRESETS
from deltafin.progress import Progress
from deltafin.weights.directio import DirectWriter

log = logging.getLogger(__name__)

E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)
CHUNK_VALUES = 1 << 22  # float values generated per step (16 MB as f32)




def k3_layer_kinds(num_layers: int) -> list[str]:
    """K3's pattern cut to `num_layers`: MLA at 0-based l % 4 == 3 and at the last layer."""
    return ["mla" if (l % 4 == 3 or l == num_layers - 1) else "kda" for l in range(num_layers)]


def preset_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """The full `config.json` (top-level kimi_k3 with text_config) of a preset."""
    if name not in PRESETS:
        raise DeltafinError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    n = preset.layers if layers is None else layers
    if n < 2:
        raise DeltafinError("--layers must be at least 2 (a dense layer 0 and at least one MoE layer)")
    text = copy.deepcopy(K3_TEXT)
    overrides = dict(preset.text)
    linear = {**K3_LINEAR, **overrides.pop("linear", {})}
    text.update(overrides)
    kinds = k3_layer_kinds(n)
    linear["full_attn_layers"] = [l + 1 for l, k in enumerate(kinds) if k == "mla"]
    linear["kda_layers"] = [l + 1 for l, k in enumerate(kinds) if k == "kda"]
    base = preset.vocab_size - vocab.N_SPECIAL
    specials = vocab.special_tokens(base)
    text.update({"num_hidden_layers": n, "vocab_size": preset.vocab_size, "linear_attn_config": linear,
                 "bos_token_id": specials["[BOS]"], "eos_token_id": specials["<|end_of_msg|>"],
                 "pad_token_id": specials["[PAD]"], "quantization_config": _quantization_config()})
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": specials["[BOS]"], "eos_token_id": specials["<|end_of_msg|>"],
        "pad_token_id": specials["[PAD]"], "media_placeholder_token_id": specials["<|kimi_image_placeholder|>"],
        "tie_word_embeddings": False, "dtype": "bfloat16", "deltafin_synthetic": {"preset": name},
        "text_config": text,
    }


def _quantization_config() -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
               "group_size": MXFP4_GROUP, "scale_dtype": "torch.uint8", "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": weights}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                       "re:.*vision_tower.*", "re:.*mm_projector.*"]}


def synthesize(preset: str, out: str | Path, seed: int = 0, layers: int | None = None,
               show_progress: bool = True) -> Path:
    """Write a synthetic checkpoint to `out`; returns the directory."""
    raw = preset_config(preset, layers)
    cfg = parse_config(raw)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(cfg)
    total = sum(s.nbytes for _, specs in shards for s in specs)
    weight_map: dict[str, str] = {}
    with Progress(total, f"synth {preset}", enabled=show_progress) as bar:
        for fname, specs in shards:
            _write_shard(out / fname, specs, _Init(cfg, seed), bar)
            weight_map.update({s.name: fname for s in specs})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    base = cfg.vocab_size - vocab.N_SPECIAL
    vocab.write_tiktoken(out / "tiktoken.model", vocab.synthetic_ranks(base, seed))
    vocab.write_tokenizer_config(out / "tokenizer_config.json", base)
    log.info("wrote %s: %d layers, %.1f MB", out, cfg.num_layers, total / 1e6)
    return out


def _plan_shards(cfg: ModelConfig) -> list[tuple[str, list[TensorSpec]]]:
    groups = []
    for layer in range(cfg.num_layers):
        specs = list(cfg.layer_tensor_specs(layer))
        if cfg.is_moe(layer):
            for e in range(cfg.num_experts):
                specs.extend(cfg.expert_tensor_specs(layer, e))
        groups.append(specs)
    groups.append(list(cfg.top_tensor_specs()))
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _write_shard(path: Path, specs: list[TensorSpec], init: _Init, bar: Progress) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    tmp = path.with_suffix(".partial")
    with DirectWriter(tmp) as f:  # keeps GBs of written shards out of the page cache
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for s in specs:
            for chunk in init.chunks(s):
                f.write(chunk)
                bar.update(len(chunk))
    os.replace(tmp, path)


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Init:
    """Deterministic random contents for each tensor of a synthetic checkpoint."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self._pools: dict[tuple[int, str], np.ndarray] = {}

    def chunks(self, spec: TensorSpec) -> Iterator[bytes | memoryview]:
        if spec.expert is not None:
            yield from self._expert_tensor(spec)
        else:
            yield from self._float_tensor(spec)

    # -- dense tensors ---------------------------------------------------------------------------

    def _float_tensor(self, spec: TensorSpec) -> Iterator[bytes | memoryview]:
        g = torch.Generator().manual_seed(_seed(self.seed, spec.name))
        name, cfg = spec.name, self.cfg
        if name.endswith("A_log"):
            values = torch.zeros(spec.numel)
            values[: cfg.kda_heads] = torch.empty(cfg.kda_heads).uniform_(0.5, 2.0, generator=g).log()
            yield _encode(values, spec.dtype)
            return
        mean, std = self._normal(spec)
        if spec.numel <= 4 * CHUNK_VALUES:
            yield _encode(torch.randn(spec.numel, generator=g).mul_(std).add_(mean), spec.dtype)
            return
        # Real-width matrices (hundreds of millions of values): windows of a normal pool at seeded offsets,
        # sign-flipped per chunk, so generation keeps up with the disk.
        pool = torch.randn(2 * CHUNK_VALUES, generator=g)
        remaining = spec.numel
        while remaining:
            n = min(remaining, CHUNK_VALUES)
            start = int(torch.randint(0, CHUNK_VALUES, (1,), generator=g))
            sign = 1.0 if int(torch.randint(0, 2, (1,), generator=g)) else -1.0
            yield _encode(pool[start:start + n] * (sign * std) + mean, spec.dtype)
            remaining -= n

    def _normal(self, spec: TensorSpec) -> tuple[float, float]:
        name, shape = spec.name, spec.shape
        if name.endswith(("dt_bias", "conv1d.weight")):
            return 0.0, 0.5
        if name.endswith("e_score_correction_bias"):
            return 0.0, 0.01
        if name.endswith("embed_tokens.weight"):
            return 0.0, 1.0
        if len(shape) == 1:  # norm weights
            return 1.0, 0.1
        if name.endswith("res_proj.weight"):
            return 0.0, 2.0 / math.sqrt(shape[-1])
        if name.endswith("gate.weight"):
            # router logits ~N(0, 1): sigmoid scores stay unsaturated, so the input (not the selection bias)
            # picks the experts and tokens spread over most of them, as a load-balanced trained router does
            return 0.0, 1.0 / math.sqrt(shape[-1])
        if name.endswith(("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")):
            # residual branches scaled down: a random net at full scale is chaotic (per-layer gain 2-6), which
            # would drown fp32-vs-reference and bf16-vs-fp32 comparisons in amplified rounding noise
            return 0.0, 0.3 / math.sqrt(shape[-1])
        return 0.0, 1.0 / math.sqrt(shape[-1])

    # -- MXFP4 experts ---------------------------------------------------------------------------

    def _expert_tensor(self, spec: TensorSpec) -> Iterator[bytes | memoryview]:
        """Each expert is a window, at a seeded offset, of a per-layer random pool, XOR-ed with a per-expert
        key (scales: windows of a pool of valid exponents). This writes at disk speed where a fresh random
        stream per expert would not, and keeps every expert distinct."""
        if self.cfg.expert_format is not ExpertFormat.MXFP4:
            raise DeltafinError("synthetic checkpoints store experts as MXFP4")
        kind = spec.name.rsplit(".", 2)[-2] + "." + spec.name.rsplit(".", 1)[-1]  # e.g. "w1.weight_packed"
        pool = self._pool(spec.layer, kind, spec)  # type: ignore[arg-type]
        rng = np.random.default_rng(_seed(self.seed, spec.layer, spec.expert, kind))
        if spec.nbytes % 8 == 0:  # 8-aligned windows: XOR a 64-bit key at memory speed
            start = 8 * int(rng.integers(0, (pool.size - spec.nbytes) // 8 + 1))
        else:
            start = int(rng.integers(0, pool.size - spec.nbytes + 1))
        window = pool[start:start + spec.nbytes]
        if kind.endswith("weight_packed"):
            key = rng.integers(0, 256, size=8, dtype=np.uint8)
            if spec.nbytes % 8 == 0:
                window = np.bitwise_xor(window.view(np.uint64), key.view(np.uint64)[0])
            else:
                window = np.bitwise_xor(window, key[0])
        yield memoryview(np.ascontiguousarray(window)).cast("B")

    def _pool(self, layer: int, kind: str, spec: TensorSpec) -> np.ndarray:
        key = (layer, kind)
        if key not in self._pools:
            if len(self._pools) >= 6:  # only the current layer's six pools are needed
                self._pools.clear()
            rng = np.random.default_rng(_seed(self.seed, "pool", layer, kind))
            size = 2 * spec.nbytes
            if kind.endswith("weight_packed"):
                self._pools[key] = rng.integers(0, 256, size=size, dtype=np.uint8)
            else:
                in_width = spec.shape[1] * MXFP4_GROUP
                exp = 127 + round(-math.log2(E2M1_RMS * math.sqrt(in_width)))
                self._pools[key] = rng.integers(exp - 1, exp + 1, size=size, dtype=np.uint8)
        return self._pools[key]


def _encode(values: torch.Tensor, dtype: str) -> bytes:
    target = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[dtype]
    return values.to(target).contiguous().view(torch.uint8).numpy().tobytes()
