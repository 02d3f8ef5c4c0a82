"""A trained draft head written as published EAGLE-3 heads are (models/eagle.py's layout): config.json with a
`deltafin_trained` provenance block, and one model.safetensors (bf16 matrices and norms, int64 d2t, bool t2d). The
embedding is the target's (frozen in training), so it is left out: the loader reads the target's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deltafin.models.eagle import EMBED, NAMES, EagleConfig, EagleWeights, to_config_json


def write_head(out: Path, cfg: EagleConfig, w: EagleWeights, trained: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, attr in NAMES.items():
        if name == EMBED:
            continue
        t = getattr(w, attr).detach().cpu()
        tensors[name] = t.long() if name == "d2t" else t.to(torch.bfloat16).contiguous()
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(cfg.draft_vocab_size) + tensors["d2t"]] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    (out / "model.safetensors").chmod(0o644)  # package data, readable by all as the model's own files are
    config = to_config_json(cfg)
    if trained:
        config["deltafin_trained"] = trained
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
