"""The EAGLE-3 draft head (models/eagle.py) and its loader (weights/draft_head.py): the layer against
transformers' Llama modules fed the same weights, the cache (commit in pieces == at once, propose == from
scratch, rollback exact), and the loader's checks on a Hub-layout head written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from deltafin.errors import ConfigError, DeltafinError, ModelFormatError
from deltafin.models import eagle
from deltafin.paths import bundled_model
from deltafin.weights.draft_head import load_eagle

CFG = eagle.EagleConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=100,
                        draft_vocab_size=40, aux_layers=(1, 2, 3), target_hidden_size=24)


def random_tensors(cfg: eagle.EagleConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) * (0.3 if len(s) == 2 else 0.1) + (1.0 if len(s) == 1 else 0.0)
           for n, s in eagle.tensor_shapes(cfg).items() if n not in ("d2t", "t2d")}
    to_target = torch.randperm(cfg.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values
    out["d2t"] = to_target - torch.arange(cfg.draft_vocab_size)
    return out


def make_head(cfg: eagle.EagleConfig = CFG) -> eagle.EagleHead:
    return eagle.head_from_tensors(eagle.to_config_json(cfg), random_tensors(cfg), "cpu")


def rows(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, CFG.feature_size, generator=g), torch.randint(0, CFG.vocab_size, (n,), generator=g)


def test_the_layer_matches_transformers_llama_modules():
    """commit() of n rows from an empty cache == transformers' LlamaAttention (eager) + LlamaMLP + RMSNorms on the
    same weights: q/k/v take [norm(embed), norm(fc(f))] (2H), the residual is fc(f). fp32 on both sides; the
    bound (1e-5 relative) leaves room for the two attention paths' different summation order."""
    head = make_head()
    w, n = head.weights, 7
    f, ids = rows(n)
    cache = head.new_cache()
    head.commit(cache, f, ids)

    hf = LlamaConfig(hidden_size=2 * CFG.hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=CFG.intermediate_size, rms_norm_eps=CFG.rms_norm_eps, rope_theta=10000.0,
                     attention_bias=False, mlp_bias=False)
    hf._attn_implementation = "eager"
    attn = LlamaAttention(hf, 0)
    attn.o_proj = torch.nn.Linear(32, CFG.hidden_size, bias=False)
    mlp_cfg = LlamaConfig(hidden_size=CFG.hidden_size, intermediate_size=CFG.intermediate_size)
    mlp = LlamaMLP(mlp_cfg)
    norms = {k: LlamaRMSNorm(CFG.hidden_size, CFG.rms_norm_eps) for k in ("in", "hid", "post", "final")}
    with torch.no_grad():
        for mod, t in ((attn.q_proj, w.q), (attn.k_proj, w.k), (attn.v_proj, w.v), (attn.o_proj, w.o),
                       (mlp.gate_proj, w.gate), (mlp.up_proj, w.up), (mlp.down_proj, w.down),
                       (norms["in"], w.input_norm), (norms["hid"], w.hidden_norm), (norms["post"], w.post_norm),
                       (norms["final"], w.norm)):
            mod.weight.copy_(t)
        g = f @ w.fc.T
        x = torch.cat([norms["in"](w.embed[ids]), norms["hid"](g)], -1).unsqueeze(0)
        pos = torch.arange(n).unsqueeze(0)
        cos_sin = LlamaRotaryEmbedding(hf)(x, pos)
        mask = torch.full((n, n), float("-inf")).triu(1).view(1, 1, n, n)
        h = g + attn(x, position_embeddings=cos_sin, attention_mask=mask)[0][0]
        out = h + mlp(norms["post"](h))
        logits = norms["final"](out) @ w.lm_head.T
    assert torch.linalg.norm(cache.hiddens - out) / torch.linalg.norm(out) < 1e-5
    ours = eagle.logits_of(CFG, w, cache.hiddens)
    assert torch.linalg.norm(ours - logits) / torch.linalg.norm(logits) < 1e-5


def test_commit_in_pieces_equals_commit_at_once_and_rollback_is_exact():
    """fp32: a row's output depends only on the rows before it, whichever commit they came in (1e-5: only the
    attention's reduction lengths differ)."""
    head = make_head()
    f, ids = rows(9)
    whole, pieces = head.new_cache(), head.new_cache()
    head.commit(whole, f, ids)
    for a, b in ((0, 1), (1, 5), (5, 6), (6, 9)):
        head.commit(pieces, f[a:b], ids[a:b])
    assert pieces.length == whole.length == 9
    for x, y in ((whole.keys, pieces.keys), (whole.values, pieces.values), (whole.hiddens, pieces.hiddens)):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    assert head.propose(whole, 5).tokens == head.propose(pieces, 5).tokens

    short = head.new_cache()
    head.commit(short, f[:6], ids[:6])
    expected = head.propose(short, 4).tokens
    snapshot = [t.clone() for t in (short.keys, short.values, short.hiddens)]
    head.commit(short, f[6:], ids[6:])
    head.rollback(short, 6)
    assert short.length == 6
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (short.keys, short.values, short.hiddens), strict=True))
    assert head.propose(short, 4).tokens == expected
    with pytest.raises(ValueError):
        head.rollback(short, 7)


def test_propose_equals_recomputation_from_scratch():
    """Each drafted token, recomputed by running every row (verified and drafted so far) through the layer at
    once with a causal mask, drafted rows fed the previous row's output hidden, with its probability under the
    head (softmax over the draft vocabulary, float32: rounding only); propose() leaves the cache as it was."""
    head = make_head()
    w = head.weights
    f, ids = rows(6)
    cache = head.new_cache()
    head.commit(cache, f, ids)
    before = [t.clone() for t in (cache.keys, cache.values, cache.hiddens)]
    proposed = head.propose(cache, 5)
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.keys, cache.values, cache.hiddens), strict=True))
    assert cache.length == 6

    tokens, hiddens, drafted, probability = ids.tolist(), f @ w.fc.T, [], []
    for _ in range(5):
        n = len(tokens)
        pos = torch.arange(n)
        q, k, v = eagle.project(CFG, w, w.embed[torch.tensor(tokens)], hiddens, pos, head.inv_freq)
        out = eagle.complete(CFG, w, eagle.attend(CFG, q, k, v, pos.unsqueeze(1) >= pos), hiddens)
        logits = eagle.logits_of(CFG, w, out[-1]).double()
        d = int(logits.argmax())
        drafted.append(d + int(w.d2t[d]))
        probability.append(float(logits.exp()[d] / logits.exp().sum()))
        tokens.append(drafted[-1])
        hiddens = torch.cat([hiddens, out[-1:]])
    assert proposed.tokens == drafted
    assert proposed.confidence == pytest.approx(probability, rel=1e-5)
    assert min(probability) < 0.5  # a random head: the numbers say something, not all near 1


def test_llama3_rope_scaling_keeps_high_frequencies_and_divides_low_ones():
    scaled = eagle.parse_config({**eagle.to_config_json(CFG), "rope_theta": 500000.0, "head_dim": 128,
                                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    plain = eagle.inverse_frequencies(eagle.EagleConfig(**{**scaled.__dict__, "rope_scaling": None}))
    inv = eagle.inverse_frequencies(scaled)
    assert torch.equal(inv[:8], plain[:8])
    assert torch.allclose(inv[-8:], plain[-8:] / 8.0)


# ---- the loader -----------------------------------------------------------------------------------------------


def write_hub_head(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


TARGET_CFG = eagle.EagleConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                               intermediate_size=64, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=8192,
                               draft_vocab_size=32, aux_layers=(2, 4, 5), target_hidden_size=256)


def hub_layout(cfg: eagle.EagleConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """A head as yuhuili/EAGLE3-* and SpecForge write them: no embedding (the target's), bf16 weights, t2d."""
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
               for k, v in random_tensors(cfg, seed=3).items() if k != eagle.EMBED}
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(cfg.draft_vocab_size) + tensors["d2t"]] = True
    config = {k: v for k, v in eagle.to_config_json(cfg).items() if k != "target_hidden_size"}
    return config, {**tensors, "t2d": t2d}


def test_a_hub_layout_head_loads_with_the_targets_embedding_and_maps_draft_ids(tmp_path):
    config, tensors = hub_layout(TARGET_CFG)
    head = load_eagle(write_hub_head(tmp_path / "head", config, tensors), bundled_model(), "cpu")
    assert head.config.aux_layers == (2, 4, 5) and head.config.target_hidden_size == 256
    index = json.loads((bundled_model() / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.embed_tokens.weight"
    with safe_open(str(bundled_model() / index[name]), framework="pt") as f:
        assert torch.equal(head.weights.embed, f.get_tensor(name).float())
    cache = head.new_cache()
    g = torch.Generator().manual_seed(4)
    head.commit(cache, torch.randn(5, TARGET_CFG.feature_size, generator=g), torch.tensor([1, 2, 3, 4, 5]))
    d = int(eagle.logits_of(head.config, head.weights, cache.hiddens[-1]).argmax())
    first = head.propose(cache, 3).tokens
    assert first[0] == d + int(tensors["d2t"][d])
    allowed = set((torch.arange(TARGET_CFG.draft_vocab_size) + tensors["d2t"]).tolist())
    assert set(first) <= allowed and any(t >= TARGET_CFG.draft_vocab_size for t in allowed)


@pytest.mark.parametrize(("change", "error", "names"), [
    (lambda c, t: t.pop("midlayer.hidden_norm.weight"), ModelFormatError, "midlayer.hidden_norm.weight"),
    (lambda c, t: t.update({"fc.weight": torch.zeros(256, 512)}), ModelFormatError, "fc.weight"),
    (lambda c, t: t.update({"layers.1.mlp.up_proj.weight": torch.zeros(2, 2)}), ModelFormatError, "layers.1"),
    (lambda c, t: t.update({"d2t": t["d2t"] + 9000}), ModelFormatError, "d2t"),
    (lambda c, t: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ConfigError, "rope_scaling"),
    (lambda c, t: c.update(num_hidden_layers=2), ConfigError, "num_hidden_layers"),
    (lambda c, t: c.update(hidden_act="gelu"), ConfigError, "hidden_act"),
    (lambda c, t: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 12]}), ConfigError, "aux"),
])
def test_the_loader_names_what_it_cannot_load(tmp_path, change, error, names):
    config, tensors = hub_layout(TARGET_CFG)
    change(config, tensors)
    with pytest.raises(error) as e:
        load_eagle(write_hub_head(tmp_path / "head", config, tensors), bundled_model(), "cpu")
    assert names in str(e.value)


def test_a_head_without_an_embedding_needs_the_target(tmp_path):
    config, tensors = hub_layout(TARGET_CFG)
    with pytest.raises(DeltafinError, match="embed_tokens"):
        load_eagle(write_hub_head(tmp_path / "head", config, tensors), None, "cpu")
    with pytest.raises(ConfigError, match="config.json"):
        load_eagle(tmp_path / "nowhere", None, "cpu")
