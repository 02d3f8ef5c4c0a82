"""An EAGLE-3 draft head off the disk (models/eagle.py is its math): config.json and its safetensors, and, when
the head ships no embedding, the target checkpoint's `model.embed_tokens.weight`.

Published heads keep everything in one `model.safetensors` (or an index of shards); heads saved only as
`pytorch_model.bin` are refused with what to do, since a pickle is not safe to open.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import INDEX_NAME, SINGLE_NAME
from deltafin.errors import ConfigError, ModelFormatError
from deltafin.models.eagle import EMBED, EagleHead, head_from_tensors


def read_draft_files(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json's fields, every tensor) of the head in directory `path`."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"no config.json in {path}: point at an EAGLE-3 draft head's directory")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
    return raw, _tensors(path, _shards(path))


def _shards(path: Path) -> list[str]:
    if (path / INDEX_NAME).is_file():
        try:
            return sorted(set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError) as e:
            raise ModelFormatError(f"{path / INDEX_NAME} is not a valid safetensors index: {e}") from None
    if (path / SINGLE_NAME).is_file():
        return [SINGLE_NAME]
    if (path / "pytorch_model.bin").is_file():
        raise ModelFormatError(f"{path} holds pytorch_model.bin only: convert it to {SINGLE_NAME} (safetensors) "
                               "first, e.g. with `safetensors.torch.save_file(torch.load(..., weights_only=True))`")
    raise ModelFormatError(f"no {SINGLE_NAME} or {INDEX_NAME} in {path}")


def _tensors(path: Path, shards: list[str], names: set[str] | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not (path / shard).is_file():
            raise ModelFormatError(f"{path / shard} is missing")
        try:
            with safe_open(str(path / shard), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys() if names is None or k in names})  # noqa: SIM118
        except OSError as e:
            raise ModelFormatError(f"{path / shard} is not a readable safetensors file: {e}") from None
    return out


def read_target_embedding(target: Path, need_embedding: bool = True) -> tuple[torch.Tensor | None, int]:
    """(the target's token embedding [vocab, D] or None when not needed, the target's layer count)."""
    cfg = load_config(target)
    if not need_embedding:
        return None, cfg.num_layers
    name = f"{cfg.prefix}model.embed_tokens.weight"
    if (target / INDEX_NAME).is_file():
        weight_map = json.loads((target / INDEX_NAME).read_text())["weight_map"]
        shards = [weight_map[name]] if name in weight_map else []
    else:
        shards = [SINGLE_NAME]
    found = _tensors(target, shards, {name}) if shards else {}
    if name not in found:
        raise ModelFormatError(f"the target checkpoint {target} has no {name} for the draft head's embedding")
    return found[name], cfg.num_layers


def load_eagle(path: Path, target_checkpoint: Path | None, device: torch.device | str,
               dtype: torch.dtype = torch.float32) -> EagleHead:
    """A head from `path` (config.json + safetensors); its embedding from the head when it ships one, else the
    target checkpoint's `model.embed_tokens.weight`; the target's layer count checks the aux layers."""
    raw, tensors = read_draft_files(Path(path))
    target_layers = None
    if target_checkpoint is not None:
        embed, target_layers = read_target_embedding(Path(target_checkpoint), need_embedding=EMBED not in tensors)
        if embed is not None:
            tensors[EMBED] = embed
    elif EMBED not in tensors:
        raise ModelFormatError(f"draft head {path} has no {EMBED}: give the target checkpoint to read it from")
    return head_from_tensors(raw, tensors, device, dtype, target_layers)
