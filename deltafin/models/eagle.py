"""An EAGLE-3 draft head: one Llama decoder layer over the target's own hidden states (Li et al. 2025).

    N = rows, H = the head's hidden size, F = len(aux_layers) * target hidden, V = draft vocabulary
    nh, nkv = query and key/value heads, d = head_dim

The target's features at position t are the hidden states entering its aux layers as it runs token x_t
(`decoder.layer_input`; `decoder.final_hidden` for aux layer == num_layers), concatenated [N, F]. The head
runs one layer on rows of

    x = concat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))            [N, 2H]
    g_t = fc(f_t) on verified rows; the head's own previous output on drafted rows
    h = g_t + o_proj(attention(q/k/v_proj(x), rotary at the row's position))
    out = h + down(silu(gate(norm(h))) * up(norm(h)))      out: the next drafted row's g
    logits = lm_head(norm(out)) [V] -> argmax -> target id = d + d2t[d]

so the head sees the token the target chose and the state the target was in, and predicts the token after it.
Its own KV cache (`DraftCache`) holds one row per verified position; drafting appends temporary rows.

The layout is the one published EAGLE-3 heads use (LlamaForCausalLMEagle3: yuhuili/EAGLE3-*, SpecForge,
sglang, vLLM): tensors `fc.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, optional `t2d` and `embed_tokens.weight`. config.json fields read (`parse_config`):
hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps,
rope_theta, rope_scaling (none, "default" or "llama3"), vocab_size, draft_vocab_size, target_hidden_size,
norm_before_residual, eagle_config.eagle_aux_hidden_state_layer_ids; refused: num_hidden_layers != 1,
hidden_act other than silu, attention or MLP biases, other rope_scaling types. The files are read by
weights/draft_head.py (`load_eagle`); this module is the math, the checks and the runtime API.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from deltafin.errors import ConfigError, ModelFormatError
from deltafin.models.common import rms_norm

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
ROPE_TYPES = ("default", "llama3")
EMBED = "embed_tokens.weight"


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3's rotary frequency rescaling (rope_scaling type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # target layers whose input hidden states are the features (num_layers: final)
    target_hidden_size: int
    norm_before_residual: bool = False  # SpecForge's variant: the residual is the normed hidden
    rope_scaling: Llama3Rope | None = None

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * self.target_hidden_size


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and SpecForge's default: a low, a middle and a late layer."""
    return (2, num_layers // 2, num_layers - 3)


def parse_config(raw: Mapping[str, Any], target_layers: int | None = None) -> EagleConfig:
    """EagleConfig from a head's config.json; `target_layers` (the target's layer count) checks the aux layers and
    gives the default ones. ConfigError names the first field Deltafin does not support."""
    arch = raw.get("architectures") or []
    if arch and not any(a in ARCHITECTURES for a in arch):
        raise ConfigError(f"draft head architectures {arch}: Deltafin runs {' or '.join(ARCHITECTURES)} heads")
    _require(raw.get("num_hidden_layers", 1) == 1, "num_hidden_layers", raw.get("num_hidden_layers"), "1")
    _require(raw.get("hidden_act", "silu") == "silu", "hidden_act", raw.get("hidden_act"), "silu")
    for bias in ("attention_bias", "mlp_bias"):
        _require(not raw.get(bias, False), bias, raw.get(bias), "false")
    for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(raw.get(name), int) or raw[name] <= 0:
            raise ConfigError(f"draft head config.json: {name} is missing or not a positive integer")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    aux = tuple((raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ())
    if not aux:
        if target_layers is None:
            raise ConfigError("draft head config.json has no eagle_config.eagle_aux_hidden_state_layer_ids and "
                              "no target was given to take the default from")
        aux = default_aux_layers(target_layers)
    if target_layers is not None and not all(0 <= a <= target_layers for a in aux):
        raise ConfigError(f"draft head aux layers {list(aux)} are not all in 0..{target_layers} (the target's layers)")
    return EagleConfig(
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads, intermediate_size=raw["intermediate_size"],
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(raw.get("rope_theta", 10000.0)),
        vocab_size=raw["vocab_size"], draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        aux_layers=tuple(int(a) for a in aux), target_hidden_size=raw.get("target_hidden_size") or hidden,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        rope_scaling=_rope_scaling(raw.get("rope_scaling")))


def _require(ok: bool, name: str, value: Any, supported: str) -> None:
    if not ok:
        raise ConfigError(f"draft head config.json: {name}={value!r} is not supported (Deltafin runs {supported})")


def _rope_scaling(raw: Mapping[str, Any] | None) -> Llama3Rope | None:
    kind = (raw or {}).get("rope_type", (raw or {}).get("type", "default"))
    _require(kind in ROPE_TYPES, "rope_scaling.rope_type", kind, " or ".join(ROPE_TYPES))
    if raw is None or kind == "default":
        return None
    try:
        return Llama3Rope(float(raw["factor"]), float(raw["low_freq_factor"]), float(raw["high_freq_factor"]),
                          int(raw["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"draft head config.json: rope_scaling (llama3) has no {e.args[0]}") from None


def to_config_json(cfg: EagleConfig) -> dict[str, Any]:
    """The config.json fields of a head, as published heads write them."""
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers), "use_aux_hidden_state": True}}
    if cfg.norm_before_residual:
        out["norm_before_residual"] = True
    return out


# ---- weights ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EagleWeights:
    fc: torch.Tensor  # [H, F]
    input_norm: torch.Tensor  # [H], on the embedding
    hidden_norm: torch.Tensor  # [H], on the hidden
    q: torch.Tensor  # [nh*d, 2H]
    k: torch.Tensor  # [nkv*d, 2H]
    v: torch.Tensor  # [nkv*d, 2H]
    o: torch.Tensor  # [H, nh*d]
    post_norm: torch.Tensor  # [H]
    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]
    norm: torch.Tensor  # [H], the final norm
    lm_head: torch.Tensor  # [V, H]
    embed: torch.Tensor  # [vocab, H], the target's
    d2t: torch.Tensor  # [V] int64: target id = draft id + d2t[draft id]


# tensor name -> EagleWeights field
NAMES = {"fc.weight": "fc", "midlayer.input_layernorm.weight": "input_norm",
         "midlayer.hidden_norm.weight": "hidden_norm", "midlayer.self_attn.q_proj.weight": "q",
         "midlayer.self_attn.k_proj.weight": "k", "midlayer.self_attn.v_proj.weight": "v",
         "midlayer.self_attn.o_proj.weight": "o", "midlayer.post_attention_layernorm.weight": "post_norm",
         "midlayer.mlp.gate_proj.weight": "gate", "midlayer.mlp.up_proj.weight": "up",
         "midlayer.mlp.down_proj.weight": "down", "norm.weight": "norm", "lm_head.weight": "lm_head",
         EMBED: "embed", "d2t": "d2t"}


def tensor_shapes(cfg: EagleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, as the checkpoint stores it (`t2d` is optional, the others required)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return {"fc.weight": (h, cfg.feature_size), "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (cfg.num_attention_heads * d, 2 * h),
            "midlayer.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            "midlayer.post_attention_layernorm.weight": (h,), "midlayer.mlp.gate_proj.weight": (i, h),
            "midlayer.mlp.up_proj.weight": (i, h), "midlayer.mlp.down_proj.weight": (h, i), "norm.weight": (h,),
            "lm_head.weight": (cfg.draft_vocab_size, h), EMBED: (cfg.vocab_size, h), "d2t": (cfg.draft_vocab_size,),
            "t2d": (cfg.vocab_size,)}


def eagle_weights(cfg: EagleConfig, tensors: Mapping[str, torch.Tensor], device: torch.device | str,
                  dtype: torch.dtype = torch.float32) -> EagleWeights:
    """Typed weights from a head's tensors (and the target's `embed_tokens.weight`): every missing, unexpected
    or misshapen tensor is reported at once (ModelFormatError), as is a d2t that maps outside the vocabulary."""
    shapes = tensor_shapes(cfg)
    problems = [f"draft head tensor {n} is missing" for n in NAMES if n not in tensors]
    problems += [f"draft head tensor {n} is not one of an EAGLE-3 head's (one midlayer)"
                 for n in tensors if n not in shapes]
    problems += [f"draft head tensor {n} has shape {list(t.shape)}, expected {list(shapes[n])} from config.json"
                 for n, t in tensors.items() if n in shapes and tuple(t.shape) != shapes[n]]
    if not problems:
        targets = torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long().cpu()
        if int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size:
            problems.append(f"draft head tensor d2t maps draft ids outside the target vocabulary "
                            f"0..{cfg.vocab_size - 1}")
    if problems:
        raise ModelFormatError(problems)
    kw: dict[str, torch.Tensor] = {}
    for name, attr in NAMES.items():
        t = tensors[name].to(device)
        kw[attr] = t.long() if name == "d2t" else t.to(dtype).contiguous()
    return EagleWeights(**kw)


# ---- the math -----------------------------------------------------------------------------------------------


def inverse_frequencies(cfg: EagleConfig) -> torch.Tensor:
    """Rotary inverse frequencies [d/2] (fp32), with Llama 3's rescaling when the config asks for it."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    s = cfg.rope_scaling
    if s is None:
        return inv
    wavelen, old = 2 * math.pi / inv, s.original_max_position_embeddings
    low, high = old / s.low_freq_factor, old / s.high_freq_factor
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * inv / s.factor + smooth * inv
    return torch.where(wavelen > low, inv / s.factor, torch.where(wavelen < high, inv, mid))


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (halves, not interleaved) of x [..., N, heads, d] at positions pos [..., N]."""
    angles = pos.to(torch.float32).unsqueeze(-1) * inv_freq.to(pos.device)  # [..., N, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(-2).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(-2).to(x.dtype)
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], -1) * sin


def project(cfg: EagleConfig, w: EagleWeights, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
            inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [..., N, nh, d], k and v [..., N, nkv, d] (q and k rotated) of rows with token embeddings `emb` and
    hiddens `hidden` [..., N, H]."""
    x = torch.cat([rms_norm(emb, w.input_norm, cfg.rms_norm_eps),
                   rms_norm(hidden, w.hidden_norm, cfg.rms_norm_eps)], dim=-1)  # [..., N, 2H]
    shape = (*x.shape[:-1], -1, cfg.head_dim)
    q, k, v = (F.linear(x, m).reshape(shape) for m in (w.q, w.k, w.v))
    return rotate(q, pos, inv_freq), rotate(k, pos, inv_freq), v


def attend(cfg: EagleConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [..., N, nh, d] over k, v [..., M, nkv, d] where mask [..., N, M] is True ->
    [..., N, nh*d]. Key/value heads are shared by nh/nkv query heads each (grouped-query attention)."""
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    q, k, v = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)  # heads first: [..., heads, rows, d]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(cfg.head_dim)  # [..., nh, N, M]
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    out = scores.softmax(-1).to(v.dtype) @ v  # [..., nh, N, d]
    return out.transpose(-3, -2).flatten(-2)


def complete(cfg: EagleConfig, w: EagleWeights, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's output hidden [..., N, H] (before the final norm) from the attention's [..., N, nh*d]."""
    residual = rms_norm(hidden, w.hidden_norm, cfg.rms_norm_eps) if cfg.norm_before_residual else hidden
    h = residual + F.linear(attn, w.o)
    x = rms_norm(h, w.post_norm, cfg.rms_norm_eps)
    return h + F.linear(F.silu(F.linear(x, w.gate)) * F.linear(x, w.up), w.down)


def logits_of(cfg: EagleConfig, w: EagleWeights, out: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary logits [..., V] (fp32) of output hiddens [..., H]."""
    return F.linear(rms_norm(out, w.norm, cfg.rms_norm_eps), w.lm_head).float()


# ---- the runtime API ----------------------------------------------------------------------------------------


@dataclass
class DraftCache:
    """One sequence's draft state: a row per verified position (keys, values, output hiddens)."""

    keys: torch.Tensor  # [M, nkv, d]
    values: torch.Tensor  # [M, nkv, d]
    hiddens: torch.Tensor  # [M, H], each row's output (the last one seeds propose)
    length: int = field(default=0)


@dataclass(frozen=True)
class Chain:
    """A proposed chain: target token ids, and the head's probability of each given the ones before it."""

    tokens: list[int]
    confidence: list[float]


class EagleHead:
    """A loaded head: `commit` verified rows, `propose` a greedy chain after them, `rollback` rejected ones."""

    def __init__(self, config: EagleConfig, weights: EagleWeights):
        self.config, self.weights = config, weights
        self.device, self.dtype = weights.fc.device, weights.fc.dtype
        self.inv_freq = inverse_frequencies(config).to(self.device)

    def new_cache(self) -> DraftCache:
        c = self.config
        kv = torch.empty(0, c.num_key_value_heads, c.head_dim, device=self.device, dtype=self.dtype)
        return DraftCache(kv, kv.clone(), torch.empty(0, c.hidden_size, device=self.device, dtype=self.dtype))

    def _rows(self, cache: DraftCache, ids: torch.Tensor, hidden: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows after the cache (causal over it and among themselves): their outputs [n, H], keys, values."""
        n, at = len(ids), cache.length
        pos = torch.arange(at, at + n, device=self.device)
        q, k, v = project(self.config, self.weights, self.weights.embed[ids], hidden, pos, self.inv_freq)
        keys, values = torch.cat([cache.keys, k]), torch.cat([cache.values, v])
        mask = torch.arange(at + n, device=self.device) <= pos.unsqueeze(-1)  # [n, at+n]
        return complete(self.config, self.weights, attend(self.config, q, keys, values, mask), hidden), keys, values

    def commit(self, cache: DraftCache, features: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Append n verified positions: row i has the target's features f_t at position t ([n, F]) and the
        token x_{t+1} that followed it ([n] int64). The draft layer runs on these rows (causal over the cache);
        the cache keeps the last row's output hidden and draft logits for propose()."""
        ids = next_ids.to(self.device, torch.long)
        hidden = F.linear(features.to(self.device, self.dtype), self.weights.fc)
        out, cache.keys, cache.values = self._rows(cache, ids, hidden)
        cache.hiddens = torch.cat([cache.hiddens, out])
        cache.length += len(ids)

    def propose(self, cache: DraftCache, k: int) -> Chain:
        """Greedy chain of k target token ids continuing after the last committed row, each with the head's
        probability for it (its softmax over the draft vocabulary); does not change the committed cache
        (temporary positions are dropped)."""
        if cache.length == 0:
            raise ValueError("propose() needs at least one committed row")
        work = DraftCache(cache.keys, cache.values, cache.hiddens[-1:], cache.length)
        out: list[int] = []
        confidence: list[float] = []
        hidden = cache.hiddens[-1:]
        for step in range(k):
            probs = torch.softmax(logits_of(self.config, self.weights, hidden[-1]).float(), dim=-1)
            draft = int(probs.argmax())
            out.append(draft + int(self.weights.d2t[draft]))
            confidence.append(float(probs[draft]))
            if step == k - 1:
                break
            ids = torch.tensor([out[-1]], device=self.device)
            hidden, work.keys, work.values = self._rows(work, ids, hidden)
            work.length += 1
        return Chain(out, confidence)

    def rollback(self, cache: DraftCache, length: int) -> None:
        """Keep only the first `length` positions."""
        if not 0 <= length <= cache.length:
            raise ValueError(f"rollback to {length} of a draft cache of {cache.length} positions")
        cache.keys, cache.values = cache.keys[:length], cache.values[:length]
        cache.hiddens, cache.length = cache.hiddens[:length], length


def head_from_tensors(raw_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                      device: torch.device | str, dtype: torch.dtype = torch.float32,
                      target_layers: int | None = None) -> EagleHead:
    """A head from its config.json's fields and its tensors (with the target's embedding among them)."""
    cfg = parse_config(raw_config, target_layers)
    return EagleHead(cfg, eagle_weights(cfg, tensors, device, dtype))
