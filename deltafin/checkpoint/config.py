"""Kimi K3 (and Kimi Linear) configuration: config.json -> one frozen dataclass with derived facts.

A K3 `config.json` has `model_type: kimi_k3` with the text model under `text_config` and tensor names
prefixed `language_model.`; a bare Kimi Linear config is the text model itself. Both parse into
`ModelConfig`; the K3 extras (AttnRes, latent MoE, SiTU, output gates, lower-bounded decay) are switches.

Layer indices are 0-based everywhere in Deltafin. `linear_attn_config`'s lists are 1-based.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from deltafin.errors import ConfigError
from deltafin.formats.mxfp4 import GROUP as MXFP4_GROUP  # values per E8M0 scale (checked against the config)
from deltafin.formats.mxfp4 import MXFP4 as MXFP4_FORMAT

NAMES_HINT = "--model also takes k3-mini or a model name that `deltafin models` lists"


class LayerKind(str, enum.Enum):
    KDA = "kda"
    MLA = "mla"


class ExpertFormat(str, enum.Enum):
    MXFP4 = MXFP4_FORMAT.name  # compressed-tensors mxfp4-pack-quantized: uint8 packed nibbles + uint8 E8M0 scales
    DENSE = "dense"  # plain float weights (Kimi Linear, or a dequantized "exact twin")


DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "F64": 8, "I32": 4, "I64": 8, "BOOL": 1,
               "I16": 2, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a config implies: the name, shape and dtype `deltafin synth` writes.

    `accepts` lists other shapes a valid checkpoint may use for the same tensor (e.g. Kimi Linear's
    A_log is [1,1,H,1], K3's a padded [128]); `aliases` lists other names for it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    layer: int | None = None
    expert: int | None = None
    accepts: tuple[tuple[int, ...], ...] = ()
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def dtype_ok(self, dtype: str) -> bool:
        """Packed/scale tensors must be exactly uint8; float tensors may be any float type."""
        return dtype == "U8" if self.dtype == "U8" else dtype in FLOAT_DTYPES


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "kimi_k3" | "kimi_linear"
    prefix: str  # "language_model." for K3, "" for Kimi Linear
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int  # dense (layer-0) MLP width
    rms_norm_eps: float
    layer_kinds: tuple[LayerKind, ...]
    # KDA
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None  # K3: g = lb*sigmoid(...); None: Kimi Linear's -exp(A)*softplus(...)
    kda_full_rank_gate: bool  # K3: g_proj [P,D]; Kimi Linear: g_b_proj @ g_a_proj
    # MLA (NoPE)
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool
    # FFN / MoE
    first_k_dense: int
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    renormalize: bool
    latent_dim: int | None  # routed experts run at this width (K3 latent MoE); None: at hidden_size
    latent_norm: bool
    hidden_act: str  # "situ" | "silu"
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int  # 0: plain residual stream (Kimi Linear)
    expert_format: ExpertFormat
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    max_context: int | None = None  # max_position_embeddings: the longest sequence the model was made for
    # Two epsilons the references disagree on (K3_SPEC §8). Default: the HF/fla reference code, 1e-6 for the
    # MLA q_a/kv_a layernorms and for the KDA q/k L2 norm; llama.cpp uses 1e-5 (rms_norm_eps) for both.
    # `with_eps_convention(cfg, "llama.cpp")` switches, for exact comparisons with llama.cpp.
    mla_norm_eps: float = 1e-6
    qk_norm_eps: float = 1e-6

    # ---- layer structure -------------------------------------------------------------------------

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.MLA)

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    @cached_property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe(i))

    def blocks_entering(self, layer: int) -> int:
        """AttnRes blocks banked before `layer` runs: n = ceil(l/S) (K3_SPEC §2); layer = L for the head."""
        if self.attn_res_block_size == 0:
            return 0
        return -(-layer // self.attn_res_block_size)

    @property
    def expert_dim(self) -> int:
        """Width the routed experts read and write (latent width for K3)."""
        return self.latent_dim or self.hidden_size

    @property
    def kda_dim(self) -> int:
        return self.kda_heads * self.kda_head_dim

    # ---- tensors ---------------------------------------------------------------------------------

    def _name(self, rest: str) -> str:
        return f"{self.prefix}{rest}"

    def expert_tensor_specs(self, layer: int, expert: int) -> tuple[TensorSpec, ...]:
        """Tensors of one routed expert, in on-disk order w1|w2|w3 (packed then scale for MXFP4)."""
        base = self._name(f"model.layers.{layer}.block_sparse_moe.experts.{expert}.")
        i, d = self.moe_intermediate_size, self.expert_dim
        logical = {"w1": (i, d), "w2": (d, i), "w3": (i, d)}  # w1 = gate, w2 = down, w3 = up
        specs = []
        for w, (rows, cols) in logical.items():
            if self.expert_format is ExpertFormat.MXFP4:
                specs.append(TensorSpec(f"{base}{w}.weight_packed", (rows, cols // 2), "U8", layer, expert))
                specs.append(TensorSpec(f"{base}{w}.weight_scale", (rows, cols // MXFP4_GROUP), "U8",
                                        layer, expert))
            else:
                specs.append(TensorSpec(f"{base}{w}.weight", (rows, cols), "BF16", layer, expert))
        return tuple(specs)

    @property
    def expert_matrices(self) -> tuple[tuple[int, int], ...]:
        """[rows, cols] of a routed expert's w1 (gate), w2 (down) and w3 (up)."""
        i, d = self.moe_intermediate_size, self.expert_dim
        return (i, d), (d, i), (i, d)

    @cached_property
    def bytes_per_expert(self) -> int:
        return sum(s.nbytes for s in self.expert_tensor_specs(self.first_k_dense, 0))

    def layer_tensor_specs(self, layer: int) -> tuple[TensorSpec, ...]:
        """Non-expert ("spine") tensors of one decoder layer."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        p = self._name(f"model.layers.{layer}.")
        out: list[TensorSpec] = []

        def add(rest: str, shape: tuple[int, ...], dtype: str = "BF16", **kw: Any) -> None:
            out.append(TensorSpec(p + rest, tuple(shape), dtype, layer, **kw))

        d = self.hidden_size
        add("input_layernorm.weight", (d,))
        add("post_attention_layernorm.weight", (d,))
        if self.attn_res_block_size:
            for which in ("self_attention_res", "mlp_res"):
                add(f"{which}_norm.weight", (d,))
                add(f"{which}_proj.weight", (1, d))
        if self.layer_kinds[layer] is LayerKind.KDA:
            self._kda_specs(add)
        else:
            self._mla_specs(add)
        if self.is_moe(layer):
            self._moe_specs(add)
        else:
            for name, shape in (("gate_proj", (self.intermediate_size, d)),
                                ("up_proj", (self.intermediate_size, d)),
                                ("down_proj", (d, self.intermediate_size))):
                # transformers' save_pretrained writes Kimi Linear's dense MLP under block_sparse_moe.
                add(f"mlp.{name}.weight", shape, aliases=(p + f"block_sparse_moe.{name}.weight",))
        return tuple(out)

    def _kda_specs(self, add: Any) -> None:
        d, h, hd, pd = self.hidden_size, self.kda_heads, self.kda_head_dim, self.kda_dim
        for x in "qkv":
            add(f"self_attn.{x}_proj.weight", (pd, d))
            add(f"self_attn.{x}_conv1d.weight", (pd, 1, self.conv_kernel), "F32")
        add("self_attn.f_a_proj.weight", (hd, d))
        add("self_attn.f_b_proj.weight", (pd, hd))
        add("self_attn.b_proj.weight", (h, d))
        a_log_shapes = ((max(h, hd),), (h,), (1, 1, h, 1))  # K3 pads A_log to [128]; Kimi Linear: [1,1,H,1]
        if self.model_type == "kimi_k3":
            add("self_attn.A_log", a_log_shapes[0], "F32", accepts=a_log_shapes[1:])
        else:
            add("self_attn.A_log", a_log_shapes[2], "F32", accepts=a_log_shapes[:2])
        add("self_attn.dt_bias", (pd,), "F32")
        if self.kda_full_rank_gate:
            add("self_attn.g_proj.weight", (pd, d))
        else:
            add("self_attn.g_a_proj.weight", (hd, d))
            add("self_attn.g_b_proj.weight", (pd, hd))
        add("self_attn.o_norm.weight", (hd,), "F32")
        add("self_attn.o_proj.weight", (d, pd))

    def _mla_specs(self, add: Any) -> None:
        d, h = self.hidden_size, self.num_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            add("self_attn.q_a_proj.weight", (self.q_lora_rank, d))
            add("self_attn.q_a_layernorm.weight", (self.q_lora_rank,))
            add("self_attn.q_b_proj.weight", (h * qk, self.q_lora_rank))
        else:
            add("self_attn.q_proj.weight", (h * qk, d))
        add("self_attn.kv_a_proj_with_mqa.weight", (self.kv_lora_rank + self.qk_rope_head_dim, d))
        add("self_attn.kv_a_layernorm.weight", (self.kv_lora_rank,))
        add("self_attn.kv_b_proj.weight", (h * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank))
        if self.mla_output_gate:
            add("self_attn.g_proj.weight", (h * self.v_head_dim, d))
        add("self_attn.o_proj.weight", (d, h * self.v_head_dim))

    def _moe_specs(self, add: Any) -> None:
        d, e = self.hidden_size, self.num_experts
        add("block_sparse_moe.gate.weight", (e, d))
        add("block_sparse_moe.gate.e_score_correction_bias", (e,), "F32")
        if self.latent_dim:
            add("block_sparse_moe.routed_expert_down_proj.weight", (self.latent_dim, d))
            if self.latent_norm:
                add("block_sparse_moe.routed_expert_norm.weight", (self.latent_dim,))
            add("block_sparse_moe.routed_expert_up_proj.weight", (d, self.latent_dim))
        shared = self.moe_intermediate_size * self.num_shared_experts
        if shared:
            add("block_sparse_moe.shared_experts.gate_proj.weight", (shared, d))
            add("block_sparse_moe.shared_experts.up_proj.weight", (shared, d))
            add("block_sparse_moe.shared_experts.down_proj.weight", (d, shared))

    def top_tensor_specs(self) -> tuple[TensorSpec, ...]:
        """Embedding, head and final norms (held by the first and last stage)."""
        d, v = self.hidden_size, self.vocab_size
        specs = [
            TensorSpec(self._name("model.embed_tokens.weight"), (v, d), "BF16"),
            TensorSpec(self._name("lm_head.weight"), (v, d), "BF16"),
            TensorSpec(self._name("model.norm.weight"), (d,), "BF16"),
        ]
        if self.attn_res_block_size:
            specs.append(TensorSpec(self._name("model.output_attn_res_norm.weight"), (d,), "BF16"))
            specs.append(TensorSpec(self._name("model.output_attn_res_proj.weight"), (1, d), "BF16"))
        return tuple(specs)

    # ---- sizes -----------------------------------------------------------------------------------

    def spine_bytes(self, layer: int) -> dict[str, int]:
        """Bytes of a layer's non-expert tensors, by stored dtype ({"BF16": n, "F32": m})."""
        return _bytes_by_dtype(self.layer_tensor_specs(layer))

    def top_spine_bytes(self) -> dict[str, int]:
        return _bytes_by_dtype(self.top_tensor_specs())

    def expert_bytes_per_token(self) -> int:
        """MXFP4/dense expert bytes one token reads with every routed expert missed."""
        return len(self.moe_layers) * self.experts_per_token * self.bytes_per_expert


EPS_CONVENTIONS = ("hf", "llama.cpp")


def with_eps_convention(cfg: ModelConfig, convention: str) -> ModelConfig:
    """`hf` (default: 1e-6, as the HF/fla reference) or `llama.cpp` (rms_norm_eps) for the MLA LoRA
    norms and the KDA q/k L2 norm."""
    if convention == "hf":
        return dataclasses.replace(cfg, mla_norm_eps=1e-6, qk_norm_eps=1e-6)
    if convention == "llama.cpp":
        return dataclasses.replace(cfg, mla_norm_eps=cfg.rms_norm_eps, qk_norm_eps=cfg.rms_norm_eps)
    raise ConfigError(f"unknown eps convention {convention!r}: use one of {', '.join(EPS_CONVENTIONS)}")


def _bytes_by_dtype(specs: tuple[TensorSpec, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in specs:
        out[s.dtype] = out.get(s.dtype, 0) + s.nbytes
    return out


# ---- parsing ---------------------------------------------------------------------------------------


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        hint = "" if Path(model_dir).is_dir() else f" ({model_dir} is not a directory; {NAMES_HINT})"
        raise ConfigError(f"no config.json in {model_dir}: point --model at a Kimi K3 checkpoint directory{hint}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return parse_config(raw)


class _Keys:
    """Reads required/optional keys from one JSON object, naming the key in every error."""

    def __init__(self, raw: dict[str, Any], where: str):
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a JSON object")
        self.raw, self.where = raw, where

    def get(self, *names: str, default: Any = ...) -> Any:
        for n in names:
            if n in self.raw and self.raw[n] is not None:
                return self.raw[n]
        if default is ...:
            raise ConfigError(f"{self.where} has no '{names[0]}'")
        return default

    def int(self, *names: str, default: Any = ...) -> int:
        v = self.get(*names, default=default)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{self.where}.{names[0]} must be a non-negative integer, got {v!r}")
        return v


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    top = _Keys(raw, "config.json")
    model_type = top.get("model_type", default=None)
    if model_type == "kimi_k3":
        text, prefix, where = top.get("text_config"), "language_model.", "config.json text_config"
        if _Keys(text, where).get("model_type", default="kimi_linear") != "kimi_linear":
            raise ConfigError(f"{where}.model_type must be 'kimi_linear', got {text.get('model_type')!r}")
    elif model_type == "kimi_linear":
        text, prefix, where = raw, "", "config.json"
    else:
        raise ConfigError(f"unsupported model_type {model_type!r}: Deltafin runs 'kimi_k3' checkpoints "
                          "(and bare 'kimi_linear' ones such as Kimi-Linear-48B-A3B)")
    t = _Keys(text, where)
    num_layers = t.int("num_hidden_layers")
    lac = _Keys(t.get("linear_attn_config"), f"{where}.linear_attn_config")
    kinds = _layer_kinds(lac, num_layers)
    expert_format = _expert_format(text.get("quantization_config"), where)
    _check_supported(t)
    hidden_act = t.get("hidden_act", default="silu")
    if hidden_act not in ("situ", "silu"):
        raise ConfigError(f"{where}.hidden_act {hidden_act!r} is not supported (expected 'situ' or 'silu')")
    eos = t.get("eos_token_id", default=raw.get("eos_token_id"))
    first_dense = _first_k_dense(t, num_layers)
    cfg = ModelConfig(
        model_type=model_type, prefix=prefix,
        vocab_size=t.int("vocab_size"), hidden_size=t.int("hidden_size"), num_layers=num_layers,
        intermediate_size=t.int("intermediate_size"), rms_norm_eps=float(t.get("rms_norm_eps", default=1e-5)),
        layer_kinds=kinds,
        kda_heads=lac.int("num_heads"), kda_head_dim=lac.int("head_dim"),
        conv_kernel=lac.int("short_conv_kernel_size", default=4),
        gate_lower_bound=lac.get("gate_lower_bound", default=None),
        kda_full_rank_gate=bool(lac.get("use_full_rank_gate", default=False)),
        num_heads=t.int("num_attention_heads"), q_lora_rank=t.int("q_lora_rank", default=None),
        kv_lora_rank=t.int("kv_lora_rank"), qk_nope_head_dim=t.int("qk_nope_head_dim"),
        qk_rope_head_dim=t.int("qk_rope_head_dim"), v_head_dim=t.int("v_head_dim"),
        mla_output_gate=bool(t.get("mla_use_output_gate", default=False)),
        first_k_dense=first_dense,
        num_experts=t.int("num_experts", "num_local_experts"),
        experts_per_token=t.int("num_experts_per_token", "num_experts_per_tok"),
        moe_intermediate_size=t.int("moe_intermediate_size"),
        num_shared_experts=t.int("num_shared_experts", "n_shared_experts", default=0),
        routed_scaling_factor=float(t.get("routed_scaling_factor", default=1.0)),
        renormalize=bool(t.get("moe_renormalize", "norm_topk_prob", default=True)),
        latent_dim=t.int("routed_expert_hidden_size", default=None),
        latent_norm=bool(t.get("latent_moe_use_norm", default=False)),
        hidden_act=hidden_act,
        situ_beta=float(t.get("activation_situ_beta", default=4.0)),
        situ_linear_beta=float(t.get("activation_situ_linear_beta", default=0.0)),
        attn_res_block_size=t.int("attn_res_block_size", default=0),
        expert_format=expert_format,
        bos_token_id=t.get("bos_token_id", default=raw.get("bos_token_id")),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        pad_token_id=t.get("pad_token_id", default=raw.get("pad_token_id")),
        max_context=t.int("max_position_embeddings", default=None),
    )
    _check_shapes(cfg, where)
    return cfg


def _layer_kinds(lac: _Keys, num_layers: int) -> tuple[LayerKind, ...]:
    """0-based kinds from the 1-based `full_attn_layers` / `kda_layers` lists."""
    mla, kda = lac.get("full_attn_layers"), lac.get("kda_layers")
    kinds: list[LayerKind | None] = [None] * num_layers
    for kind, ids, key in ((LayerKind.MLA, mla, "full_attn_layers"), (LayerKind.KDA, kda, "kda_layers")):
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ConfigError(f"linear_attn_config.{key} must be a list of 1-based layer numbers")
        for i in ids:
            if not 1 <= i <= num_layers:
                raise ConfigError(f"inconsistent layer lists: linear_attn_config.{key} names layer {i} "
                                  f"(1-based) but the model has {num_layers} layers")
            if kinds[i - 1] is not None:
                raise ConfigError(f"inconsistent layer lists: layer {i} (1-based) is listed more than once "
                                  "in full_attn_layers/kda_layers")
            kinds[i - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise ConfigError(f"inconsistent layer lists: layers {missing[:8]} (1-based) are in neither "
                          "full_attn_layers nor kda_layers")
    return tuple(kinds)  # type: ignore[arg-type]


def _first_k_dense(t: _Keys, num_layers: int) -> int:
    """Leading dense layers: `first_k_dense_replace`, or the `mlp_layer_types` list transformers writes."""
    types = t.get("mlp_layer_types", default=None)
    if types is None:
        return t.int("first_k_dense_replace", default=1)
    k = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
    if len(types) != num_layers or any(kind != "sparse" for kind in types[k:]):
        raise ConfigError(f"{t.where}.mlp_layer_types must be {num_layers} entries: dense layers first, then "
                          f"sparse ones (got {types})")
    return k


def _expert_format(qc: dict[str, Any] | None, where: str) -> ExpertFormat:
    if qc is None:
        return ExpertFormat.DENSE
    q = _Keys(qc, f"{where}.quantization_config")
    method, fmt = q.get("quant_method", default=None), q.get("format", default=None)
    if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise ConfigError(f"unsupported quantization {method!r}/{fmt!r}: Deltafin reads compressed-tensors "
                          "'mxfp4-pack-quantized' experts (or unquantized checkpoints)")
    for name, group in (q.get("config_groups", default={}) or {}).items():
        w = group.get("weights") or {}
        ok = (w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == MXFP4_GROUP
              and str(w.get("scale_dtype", "torch.uint8")) == "torch.uint8")
        if not ok:
            raise ConfigError(f"unsupported quantization group {name!r}: expected 4-bit float weights with "
                              f"group_size {MXFP4_GROUP} and uint8 (E8M0) scales, got {w}")
    return ExpertFormat.MXFP4


def _check_supported(t: _Keys) -> None:
    if not t.get("mla_use_nope", default=True):
        raise ConfigError("MLA with RoPE (mla_use_nope: false) is not supported; Kimi K3 is NoPE")
    if t.get("moe_router_activation_func", default="sigmoid") != "sigmoid":
        raise ConfigError("only the sigmoid MoE router is supported "
                          f"(got {t.get('moe_router_activation_func')!r})")
    if t.int("num_expert_group", "n_group", default=1) != 1:
        raise ConfigError("grouped expert routing with num_expert_group > 1 is not supported")
    if t.int("moe_layer_freq", default=1) != 1:
        raise ConfigError("moe_layer_freq other than 1 is not supported")


def _check_shapes(cfg: ModelConfig, where: str) -> None:
    if cfg.num_layers == 0 or cfg.hidden_size == 0 or cfg.vocab_size == 0:
        raise ConfigError(f"{where}: num_hidden_layers, hidden_size and vocab_size must be positive")
    if cfg.experts_per_token > cfg.num_experts:
        raise ConfigError(f"{where}: num_experts_per_token ({cfg.experts_per_token}) exceeds num_experts "
                          f"({cfg.num_experts})")
    if cfg.expert_format is ExpertFormat.MXFP4:
        for name, width in (("routed expert input", cfg.expert_dim), ("moe_intermediate_size",
                                                                      cfg.moe_intermediate_size)):
            if width % MXFP4_GROUP:
                raise ConfigError(f"{where}: {name} width {width} is not a multiple of the MXFP4 group "
                                  f"({MXFP4_GROUP})")
