"""A learned drafter: an EAGLE-3 draft head (models/eagle.py) as one request's `Drafter` (text/drafting.py).

The head reads the target's hidden states entering a few layers (`feature_layers`, from its config); every
forward of the request brings them back for the rows the text kept (runtime/features.py), and `observe` commits
them to the head's own cache with the token that followed each. `propose` is the head's greedy chain from there.
The head's weights are shared by every request; its cache is the request's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.devices import resolve_device
from deltafin.errors import DraftUnavailable, ModelFormatError
from deltafin.models.eagle import EagleHead
from deltafin.weights.draft_head import load_eagle

log = logging.getLogger(__name__)

DRAFT_DIR = "draft"  # a model's own draft head, beside its weights (k3-mini ships one)


class HeadDrafter:
    def __init__(self, head: EagleHead):
        self.head = head
        self.feature_layers = tuple(head.config.aux_layers)
        self.cache = head.new_cache()
        self.committed = 0  # rows the head's cache holds

    @torch.inference_mode()
    def observe(self, start: int, features: Mapping[int, torch.Tensor], following: Sequence[int]) -> None:
        missing = [layer for layer in self.feature_layers if layer not in features]
        if missing:
            raise ValueError(f"the forward brought no features of layers {missing}")
        rows = torch.cat([features[layer] for layer in self.feature_layers], dim=-1)
        self.head.commit(self.cache, rows, torch.tensor(list(following), dtype=torch.long))
        self.committed += len(following)

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k < 1 or not self.committed:  # nothing seen yet (a prompt resumed whole): the next forward brings some
            return []
        return self.head.propose(self.cache, k)


def open_head(path: str | Path | None, model_dir: str | Path, cfg: ModelConfig, device: str = "auto") -> EagleHead:
    """The draft head at `path` (None: the model's own `draft/` folder) for the model `cfg` of `model_dir` (whose
    embedding it reads if it brings none), on `device`; DraftUnavailable where there is none, it cannot be read or it
    is another model's."""
    where = Path(path) if path is not None else Path(model_dir) / DRAFT_DIR
    if not (where / "config.json").is_file():
        raise DraftUnavailable(f"--speculative draft needs a draft head: {where} has no config.json (give "
                            "--draft-model DIR, an EAGLE-3 head for this model)" if path is not None else
                            f"--speculative draft needs a draft head: this model has no {DRAFT_DIR}/ folder; give "
                            "--draft-model DIR (an EAGLE-3 head for this model)")
    try:
        head = load_eagle(where, Path(model_dir), resolve_device(device))
    except ModelFormatError as e:
        raise DraftUnavailable(f"the draft head at {where} cannot be used: {e}") from None
    c = head.config
    if c.target_hidden_size != cfg.hidden_size or c.vocab_size != cfg.vocab_size \
            or max(c.aux_layers) > cfg.num_layers:
        raise DraftUnavailable(f"the draft head at {where} is for another model: hidden {c.target_hidden_size}, vocab "
                            f"{c.vocab_size}, layers {list(c.aux_layers)}; this model has hidden {cfg.hidden_size}, "
                            f"vocab {cfg.vocab_size}, {cfg.num_layers} layers")
    log.info("draft head %s: layers %s, draft vocabulary %d", where, list(c.aux_layers), c.draft_vocab_size)
    return head
