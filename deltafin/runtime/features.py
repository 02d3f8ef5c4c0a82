"""A draft head's features (models/eagle.py) as the stages take them during a forward.

A sequence that asks (`SeqInput.features`) gets back, for each of the asked layers a stage runs, the hidden state
entering that layer (decoder.layer_input) at its rows from position `start` on; the last stage also answers the
layer `num_layers`, the hidden state entering the final norm (decoder.final_hidden). Each stage answers its own
layers (`SeqOutput.features`, layer -> [rows, D] fp32) and whoever drives the forward gathers them
(`gather`): the head's features are the asked layers side by side, in its order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deltafin.errors import InvalidInput
from deltafin.models.attn_res import ResidualState

Features = dict[int, torch.Tensor]  # layer -> [rows, D] fp32


@dataclass(frozen=True)
class FeatureAsk:
    """The layers whose entering hidden states a sequence wants (`num_layers`: the final one), from position
    `start` on (earlier rows of the forward are not returned: a long prompt's features are only wanted near
    its end)."""

    layers: tuple[int, ...]
    start: int = 0

    def check(self, num_layers: int, what: str) -> None:
        if not self.layers or list(self.layers) != sorted(set(self.layers)) \
                or not 0 <= self.layers[0] <= self.layers[-1] <= num_layers:
            raise InvalidInput(f"{what}: feature layers must be distinct, increasing and in [0, {num_layers}]; "
                               f"got {list(self.layers)}")
        if self.start < 0:
            raise InvalidInput(f"{what}: features from a negative position")


class FeatureCapture:
    """One forward's asks on stage [start, end): which rows of the packed batch each sequence wants, and the
    hidden states taken so far."""

    def __init__(self, asks: Sequence[FeatureAsk | None], spans: Sequence[tuple[int, int, int]], start: int,
                 end: int, last: bool):
        """`spans`: each sequence's (first row in the batch, rows, tokens cached before the forward)."""
        self.rows: list[torch.Tensor | None] = []
        self.layers: list[set[int]] = []
        for ask, (row, n, cached) in zip(asks, spans, strict=True):
            mine = {i for i in (ask.layers if ask else ()) if start <= i < end or (last and i == end)}
            first = max(0, ask.start - cached) if ask else n
            self.rows.append(torch.arange(row + first, row + n) if mine and first < n else None)
            self.layers.append(mine if first < n else set())
        self.taken: list[Features] = [{} for _ in asks]

    def wants(self, layer: int) -> bool:
        return any(layer in mine for mine in self.layers)

    def take(self, layer: int, rows_of: Callable[[torch.Tensor], ResidualState],
             hidden: Callable[[ResidualState], torch.Tensor]) -> None:
        """`hidden(rows_of(rows))`: the hidden state entering `layer` at those rows, for every sequence asking."""
        for i, rows in enumerate(self.rows):
            if rows is not None and layer in self.layers[i]:
                self.taken[i][layer] = hidden(rows_of(rows)).float().cpu()


def gather(outputs: Sequence[Features], into: list[Features]) -> None:
    """Add one stage's answers (a sequence's features each) to what the stages before gave."""
    for mine, got in zip(into, outputs, strict=True):
        mine.update(got)
