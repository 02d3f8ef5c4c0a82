"""A draft head for a test model, in the Hub's EAGLE-3 layout, with seeded random weights: its drafts are
mostly wrong, which is what exactness tests want (every rejection path taken). It claims they are always taken
(its config.json's `deltafin_trained.calibration`), so that an engine drafts with it from its first step whatever
a pass costs on the machine the tests run on, then learns from the rejections."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deltafin.checkpoint.config import load_config
from deltafin.models.eagle import EMBED, EagleConfig, tensor_shapes, to_config_json
from deltafin.text.drafting import Calibration


def write_random_head(out: Path, model_dir: Path, aux_layers: tuple[int, ...] | None = None, seed: int = 0,
                      draft_vocab: int | None = None, claims: float | None = 1.0) -> Path:
    """A head for the model at `model_dir` (its embedding read from there) at `out`; `draft_vocab`: a reduced
    draft vocabulary of the target's first ids, mapped by d2t; `claims`: the share of its drafts taken that its
    calibration claims in every confidence slice (None: it ships none)."""
    cfg = load_config(model_dir)
    layers = aux_layers or (1, cfg.num_layers // 2, cfg.num_layers)
    h = 32
    head = EagleConfig(hidden_size=h, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                       rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=cfg.vocab_size,
                       draft_vocab_size=draft_vocab or cfg.vocab_size, aux_layers=tuple(layers),
                       target_hidden_size=cfg.hidden_size)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in tensor_shapes(head).items():
        if name in ("t2d", EMBED):
            continue
        if name == "d2t":
            tensors[name] = torch.zeros(shape, dtype=torch.long)
        elif len(shape) == 1:
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    if head.hidden_size != cfg.hidden_size:  # the target's embedding is [vocab, D]: a head this narrow brings its own
        tensors[EMBED] = torch.randn(cfg.vocab_size, h, generator=g)
    out.mkdir(parents=True, exist_ok=True)
    config = to_config_json(head)
    if claims is not None:
        config["deltafin_trained"] = {"calibration": Calibration(prior=[claims] * Calibration.bins).describe()}
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors")
    return out
