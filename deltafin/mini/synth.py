"""Synthetic checkpoints in the exact Hugging Face Kimi K3 layout (K3_SPEC §1), with random weights.

Presets:
  tiny      a few MB: dense layer 0, KDA, MLA, MoE and three AttnRes blocks; what the tests use
  small     tens of MB: the same structure, wider
  mini      k3-mini's geometry (27 MB, 64 experts of 4 active): its seed-0 weights are where k3-mini's training
            starts (deltafin/mini/); the trained model ships in deltafin/assets/k3-mini
  k3-slice  real K3 widths (hidden 7168, 96 heads, 896 experts of 3584x3072 MXFP4, 17,547,264 bytes
            each) for the first N layers, vocabulary reduced: what the streaming benchmarks use
  k3        K3's full geometry: 93 layers, vocabulary 163,840, the release's vision shards (95-96); with
            `sparse`, 1.56 TB apparent in a few GB of disk

Layout: one shard per decoder layer, one for embedding/head/norms (and for k3 the projector and the vision
tower), names prefixed `language_model.`, BF16/F32/U8 where the real model has them, `tiktoken.model` +
`tokenizer_config.json` whose 256 specials sit at the same offsets from the base vocabulary as K3's.
Tensor order inside a shard: `canonical` is what safetensors' `save_file` writes (F32, then BF16, then U8,
each group sorted by name; a layer's spine then precedes its experts, each expert's six tensors adjacent);
`grouped` is spine tensors in spec order, then the experts (another valid order, to keep readers honest).
`sparse` leaves bulk tensors (experts, large matrices other than the embedding and routers) as holes that
read as zeros: memory, planning and compute at full size, no disk. Weights are scaled so activations stay
O(1) through depth and the router spreads tokens over many experts.

Same seed -> byte-identical files on every machine: random values come from integer arithmetic alone
(PCG64 draws, sums, one IEEE multiply and add, integer rounding to bf16), never from math whose last bits
depend on the CPU's SIMD path (torch.randn and log/sin/cos differ between AVX2 and AVX-512 builds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from deltafin.checkpoint.config import MXFP4_GROUP, ExpertFormat, ModelConfig, TensorSpec, parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.errors import DeltafinError
from deltafin.progress import Progress
from deltafin.text import vocab
from deltafin.weights.directio import DirectWriter

log = logging.getLogger(__name__)

E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)
CHUNK_VALUES = 1 << 22  # float values generated per step (16 MB as f32)
ORDERS = ("canonical", "grouped")
# safetensors' Dtype enum order (save_file sorts by dtype, largest first, then by name)
_SAFETENSORS_DTYPES = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32",
                       "U32", "F32", "F64", "I64", "U64")
TensorBytes = Callable[[TensorSpec], Iterable[bytes | memoryview]]  # a tensor's bytes, in pieces, as stored
_BULK_VALUES = 1 << 20  # with `sparse`, matrices above this many values are holes (but embedding and routers)


def vision_tensor_specs(vision: dict[str, Any], text_hidden: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The release's 168 vision tensors (projector, tower), BF16: carried by the checkpoint, unused by the text
    model, so a reader must skip them."""
    d, inner, qkv = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["qkv_hidden_size"]
    merged = d * math.prod(vision["merge_kernel_size"])
    patch = vision["patch_size"]
    projector = [TensorSpec("mm_projector.pre_norm.weight", (d,), "BF16"),
                 TensorSpec("mm_projector.proj.0.weight", (merged, merged), "BF16"),
                 TensorSpec("mm_projector.proj.2.weight", (text_hidden, merged), "BF16")]
    tower = [TensorSpec("vision_tower.patch_embed.proj.weight", (d, 3, patch, patch), "BF16"),
             TensorSpec("vision_tower.patch_embed.pos_emb.weight",
                        (vision["init_pos_emb_height"], vision["init_pos_emb_width"], d), "BF16"),
             TensorSpec("vision_tower.encoder.final_layernorm.weight", (d,), "BF16")]
    for i in range(vision["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        tower += [TensorSpec(b + "norm0.weight", (d,), "BF16"), TensorSpec(b + "norm1.weight", (d,), "BF16"),
                  TensorSpec(b + "wqkv.weight", (3 * qkv, d), "BF16"), TensorSpec(b + "wo.weight", (d, qkv), "BF16"),
                  TensorSpec(b + "mlp.fc0.weight", (inner, d), "BF16"),
                  TensorSpec(b + "mlp.fc1.weight", (d, inner), "BF16")]
    return projector, tower


def synthesize(preset: str, out: str | Path, seed: int = 0, layers: int | None = None,
               show_progress: bool = True, sparse: bool = False, order: str = "canonical") -> Path:
    """Write a synthetic checkpoint to `out`; returns the directory."""
    raw = preset_config(preset, layers)
    cfg = parse_config(raw)
    base = cfg.vocab_size - vocab.N_SPECIAL
    init = _Init(cfg, seed)
    return write_checkpoint(raw, out, init.chunks, vocab.synthetic_ranks(base, seed), sparse=sparse, order=order,
                            label=f"synth {preset}{' (sparse)' if sparse else ''}", show_progress=show_progress)


def write_checkpoint(raw: dict[str, Any], out: str | Path, tensor_bytes: TensorBytes,
                     ranks: dict[bytes, int], *, sparse: bool = False, order: str = "canonical",
                     label: str = "write", show_progress: bool = True) -> Path:
    """Write a checkpoint of config `raw` in the K3 layout described above: `tensor_bytes(spec)` gives each
    tensor's bytes (in pieces, in the spec's dtype), `ranks` the BPE vocabulary. Returns the directory."""
    if order not in ORDERS:
        raise DeltafinError(f"unknown tensor order {order!r}: use {' or '.join(ORDERS)}")
    cfg = parse_config(raw)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(cfg, raw.get("vision_config"), order)
    apparent = sum(s.nbytes for _, specs in shards for s in specs)
    written = sum(s.nbytes for _, specs in shards for s in specs if not (sparse and _is_bulk(s)))
    _check_room(out, written, apparent, sparse)
    weight_map: dict[str, str] = {}
    with Progress(written, label, enabled=show_progress) as bar:
        for fname, specs in shards:
            _write_shard(out / fname, specs, tensor_bytes, bar, sparse)
            weight_map.update({s.name: fname for s in specs})
    index = {"metadata": {"total_size": apparent}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    base = cfg.vocab_size - vocab.N_SPECIAL
    vocab.write_tiktoken(out / "tiktoken.model", ranks)
    vocab.write_tokenizer_config(out / "tokenizer_config.json", base)
    log.info("wrote %s: %d layers, %.1f GB apparent, %.1f GB written", out, cfg.num_layers, apparent / 1e9,
             written / 1e9)
    return out


def _check_room(out: Path, written: int, apparent: int, sparse: bool) -> None:
    free = shutil.disk_usage(out).free
    if written + (64 << 20) > free:
        hint = "" if sparse else f" (--sparse writes {apparent / 1e9:.0f} GB apparent as holes)"
        raise DeltafinError(f"{out} has {free / 1e9:.1f} GB free; this checkpoint writes {written / 1e9:.1f} GB"
                            + hint)


def _plan_shards(cfg: ModelConfig, vision: dict[str, Any] | None, order: str) -> list[tuple[str, list[TensorSpec]]]:
    groups = []
    for layer in range(cfg.num_layers):
        specs = list(cfg.layer_tensor_specs(layer))
        if cfg.is_moe(layer):
            for e in range(cfg.num_experts):
                specs.extend(cfg.expert_tensor_specs(layer, e))
        groups.append(specs)
    groups.append(list(cfg.top_tensor_specs()))
    if vision is not None:
        groups.extend(vision_tensor_specs(vision, cfg.hidden_size))
    if order == "canonical":
        groups = [canonical_order(g) for g in groups]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def canonical_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """The order safetensors' `save_file` stores tensors in: larger dtypes first, then by name."""
    rank = {d: i for i, d in enumerate(_SAFETENSORS_DTYPES)}
    return sorted(specs, key=lambda s: (-rank[s.dtype], s.name))


def _is_bulk(spec: TensorSpec) -> bool:
    """What `sparse` leaves as holes: experts and big matrices, but the embedding and the routers, whose
    values make each token route differently."""
    if spec.expert is not None:
        return True
    if spec.name.endswith(("embed_tokens.weight", "block_sparse_moe.gate.weight")):
        return False
    return len(spec.shape) >= 2 and spec.numel > _BULK_VALUES


def _write_shard(path: Path, specs: list[TensorSpec], tensor_bytes: TensorBytes,
                 bar: Progress, sparse: bool) -> None:
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
            if sparse and _is_bulk(s):
                f.skip(s.nbytes)
                continue
            for chunk in tensor_bytes(s):
                f.write(chunk)
                bar.update(len(chunk))
    os.replace(tmp, path)


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _rng(*parts: object) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(_seed(*parts)))


_IH_TERMS = 4  # Irwin-Hall: the sum of 4 uniform draws, standardized, is close to N(0, 1) (|z| < 3.47)
_IH_MEAN = _IH_TERMS * 65535 / 2
_IH_SCALE = 1.0 / math.sqrt(_IH_TERMS * (65536**2 - 1) / 12)


def standard_normal(rng: np.random.Generator, n: int) -> np.ndarray:
    """n approximately standard-normal float32 values from integers: PCG64 draws of 16 bits, summed in int64,
    centred (exact), times one float64 constant (one IEEE rounding), to float32 (another). The same bytes on
    every CPU."""
    u = rng.integers(0, 1 << 16, size=(n, _IH_TERMS), dtype=np.uint16)
    centred = u.sum(axis=1, dtype=np.int64).astype(np.float64) - _IH_MEAN
    return (centred * _IH_SCALE).astype(np.float32)


def uniform(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """n float64 values in [lo, hi): 24-bit integer draws scaled exactly, one multiply and one add."""
    return rng.integers(0, 1 << 24, size=n, dtype=np.int64).astype(np.float64) * ((hi - lo) / (1 << 24)) + lo


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
        rng = _rng(self.seed, spec.name)
        if spec.name.endswith("A_log"):
            # log of a decay rate in [0.5, 2) per head, drawn directly in log space (no log() call)
            values = np.zeros(spec.numel, dtype=np.float64)
            values[: self.cfg.kda_heads] = uniform(rng, self.cfg.kda_heads, -0.6931471805599453, 0.6931471805599453)
            yield _encode(values.astype(np.float32), spec.dtype)
            return
        mean, std = self._normal(spec)
        if spec.numel <= 4 * CHUNK_VALUES:
            yield _encode(_affine(standard_normal(rng, spec.numel), std, mean), spec.dtype)
            return
        # Real-width matrices (hundreds of millions of values): windows of a normal pool at seeded offsets,
        # sign-flipped per chunk, so generation keeps up with the disk.
        pool = standard_normal(rng, 2 * CHUNK_VALUES)
        remaining = spec.numel
        while remaining:
            n = min(remaining, CHUNK_VALUES)
            start = int(rng.integers(0, CHUNK_VALUES))
            sign = 1.0 if int(rng.integers(0, 2)) else -1.0
            yield _encode(_affine(pool[start:start + n], sign * std, mean), spec.dtype)
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
        rng = _rng(self.seed, spec.layer, spec.expert, kind)
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
            rng = _rng(self.seed, "pool", layer, kind)
            size = 2 * spec.nbytes
            if kind.endswith("weight_packed"):
                self._pools[key] = rng.integers(0, 256, size=size, dtype=np.uint8)
            else:
                in_width = spec.shape[1] * MXFP4_GROUP
                exp = 127 + round(-math.log2(E2M1_RMS * math.sqrt(in_width)))
                self._pools[key] = rng.integers(exp - 1, exp + 1, size=size, dtype=np.uint8)
        return self._pools[key]


def _affine(values: np.ndarray, scale: float, shift: float) -> np.ndarray:
    """values * scale + shift in float32, as two separate IEEE operations (never a fused multiply-add)."""
    out = values * np.float32(scale)
    if shift:
        out += np.float32(shift)
    return out


def _encode(values: np.ndarray, dtype: str) -> bytes:
    """float32 values as the stored dtype's little-endian bytes; bf16 by integer round-to-nearest-even."""
    if dtype == "F32":
        return values.astype("<f4").tobytes()
    if dtype == "F16":
        return values.astype("<f2").tobytes()
    if dtype != "BF16":
        raise DeltafinError(f"synthetic float tensors are F32, F16 or BF16, not {dtype}")
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()
