"""A learned drafter: an EAGLE-3 draft head (models/eagle.py) as one request's `Drafter` (text/drafting.py).

The head reads the target's hidden states entering a few layers (`feature_layers`, from its config); every
forward of the request brings them back for the rows the text kept (runtime/features.py), and `observe` commits
them to the head's own cache with the token that followed each. `propose` is the head's greedy chain from there.
The head's weights are shared by every request; its cache is the request's.

A request that resumes a kept prefix (a chat's next turn, a prompt asked again) runs no forward over the resumed
tokens, so no features come for them. The engine's `DraftMemory` keeps each finished request's cache by the text
it covers; a new request starts from the longest one its own text begins with, cut back to the rows both share
(a row depends on the tokens up to its position and the one after it), and commits only the rows after those.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.devices import resolve_device
from deltafin.errors import DraftUnavailable, ModelFormatError
from deltafin.models.eagle import DraftCache, EagleHead
from deltafin.text.drafting import Calibration, Drafts
from deltafin.weights.draft_head import load_eagle

log = logging.getLogger(__name__)

DRAFT_DIR = "draft"  # a model's own draft head, beside its weights (k3-mini ships one)
MEMORY_BYTES = 256 << 20  # finished requests' draft caches an engine keeps (DraftMemory)


@dataclass(frozen=True)
class Kept:
    """A draft cache and what it covers: rows for the positions [first, first + cache.length) of `text`, whose
    last token follows the last row."""

    text: tuple[int, ...]
    first: int
    cache: DraftCache

    @property
    def nbytes(self) -> int:
        c = self.cache
        return sum(t.numel() * t.element_size() for t in (c.keys, c.values, c.hiddens)) + 8 * len(self.text)

    def rows_for(self, text: Sequence[int]) -> int:
        """How many of its rows hold for `text`: those whose position's tokens and the token after match."""
        same = 0
        for a, b in zip(self.text, text, strict=False):
            if a != b:
                break
            same += 1
        return max(0, min(self.cache.length, same - 1 - self.first))


class DraftMemory:
    """Finished requests' draft caches (see the module docstring), least recently used first out beyond
    `budget_bytes`."""

    def __init__(self, budget_bytes: int = MEMORY_BYTES):
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], Kept] = OrderedDict()
        self.nbytes = 0

    def keep(self, kept: Kept) -> None:
        if kept.cache.length == 0 or kept.nbytes > self.budget:
            return
        old = self.entries.pop(kept.text, None)
        self.nbytes += kept.nbytes - (old.nbytes if old is not None else 0)
        self.entries[kept.text] = kept
        while self.nbytes > self.budget:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes

    def find(self, text: Sequence[int]) -> Kept | None:
        """The kept cache that holds the most rows of `text`, cut to them (None: none holds any)."""
        best, rows = None, 0
        for kept in self.entries.values():
            n = kept.rows_for(text)
            if n > rows:
                best, rows = kept, n
        if best is None:
            return None
        self.entries.move_to_end(best.text)
        c = best.cache
        return Kept(tuple(text[:best.first + rows + 1]), best.first,
                    DraftCache(c.keys[:rows], c.values[:rows], c.hiddens[:rows], rows))


class HeadDrafter:
    def __init__(self, head: EagleHead, memory: DraftMemory | None = None):
        self.head, self.memory = head, memory
        self.feature_layers = tuple(head.config.aux_layers)
        self.cache = head.new_cache()
        self.first: int | None = None  # the position of the cache's first row (None: no row yet)

    @property
    def next(self) -> int:
        """The position after the last committed row."""
        return (self.first or 0) + self.cache.length

    def _recall(self, text: Sequence[int]) -> None:
        """Before its first row: the rows a finished request left for this text, if any."""
        if self.first is None and self.memory is not None and (kept := self.memory.find(text)) is not None:
            self.first, self.cache = kept.first, kept.cache

    @torch.inference_mode()
    def observe(self, text: Sequence[int], start: int, features: Mapping[int, torch.Tensor]) -> None:
        missing = [layer for layer in self.feature_layers if layer not in features]
        if missing:
            raise ValueError(f"the forward brought no features of layers {missing}")
        self._recall(text)
        rows = torch.cat([features[layer] for layer in self.feature_layers], dim=-1)
        skip = max(0, self.next - start) if self.first is not None else 0  # rows it holds already
        if skip >= len(rows):
            return
        if self.first is None:
            self.first = start
        at = start + skip
        self.head.commit(self.cache, rows[skip:], torch.tensor(list(text[at + 1:at + 1 + len(rows) - skip]),
                                                                dtype=torch.long))

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> Drafts:
        self._recall(tokens)
        if k < 1 or not self.cache.length:  # nothing seen yet: the next forward brings some
            return Drafts()
        chain = self.head.propose(self.cache, k)
        return Drafts(chain.tokens, chain.confidence)

    def done(self, text: Sequence[int]) -> None:
        """The request ended with `text`: its cache is kept for a request that resumes it."""
        if self.memory is not None and self.first is not None and self.cache.length:
            self.memory.keep(Kept(tuple(text[:self.next + 1]), self.first, self.cache))


def head_dir(path: str | Path | None, model_dir: str | Path) -> Path:
    """Where a draft head is: `path`, else the model's own `draft/` folder."""
    return Path(path) if path is not None else Path(model_dir) / DRAFT_DIR


def head_calibration(path: str | Path | None, model_dir: str | Path) -> Calibration:
    """How often the head's drafts are taken by their confidence, as its recipe measured it on answers it was not
    trained on (config.json: `deltafin_trained.calibration`); where it ships none, or one of other slices (said in
    the log), each slice's middle."""
    config = head_dir(path, model_dir) / "config.json"
    try:
        slices = json.loads(config.read_text()).get("deltafin_trained", {}).get("calibration")
        return Calibration() if slices is None else Calibration.shipped(slices)
    except (OSError, ValueError, AttributeError) as e:
        log.warning("the draft head's calibration in %s is not used: %s", config, e)
        return Calibration()


def open_head(path: str | Path | None, model_dir: str | Path, cfg: ModelConfig, device: str = "auto") -> EagleHead:
    """The draft head at `path` (None: the model's own `draft/` folder) for the model `cfg` of `model_dir` (whose
    embedding it reads if it brings none), on `device`; DraftUnavailable where there is none, it cannot be read or it
    is another model's."""
    where = head_dir(path, model_dir)
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
