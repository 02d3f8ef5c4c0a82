"""What a machine's disk holds of converted spines, as the plan reads it (pure): for each compact format the units
converted there (a decoder layer's spine is `layer-007`, the embedding `embed`, the final norm and head `head`) and
the bytes it may still write, so that the spine's format can follow the disk: a copy that is there beats quantizing
at every start, and a copy that cannot be written is not planned for (spine_choice.py).

weights/spine_files.py writes and reads the units by these names; weights/spine_convert.spine_disk reads a disk
into a SpineDisk, which a worker announces (transport/codec.py) and a single stage consults itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deltafin.checkpoint.config import ModelConfig
from deltafin.plan.memory.layer_table import align_up, converted_bytes, tensor_role


def layer_unit(layer: int) -> str:
    return f"layer-{layer:03d}"


def stage_units(cfg: ModelConfig, start: int, end: int) -> list[str]:
    """The units a stage of layers [start, end) loads: its layers, the embedding (first) and the head (last)."""
    units = [layer_unit(i) for i in range(start, end)]
    return units + (["embed"] if start == 0 else []) + (["head"] if end == cfg.num_layers else [])


def unit_tensors(cfg: ModelConfig, unit: str) -> list[tuple]:
    """The unit's tensors with their roles (layer_table.tensor_role), in the checkpoint's spec order."""
    if unit.startswith("layer-"):
        layer = int(unit.removeprefix("layer-"))
        return [(s, tensor_role(s, cfg.layer_kinds[layer])) for s in cfg.layer_tensor_specs(layer)]
    embed = unit == "embed"
    return [(s, tensor_role(s)) for s in cfg.top_tensor_specs() if ("embed_tokens" in s.name) == embed]


def converted_unit_bytes(cfg: ModelConfig, unit: str, fmt: str) -> int:
    """A unit's file in a converted spine of format `fmt`: its arrays, each widened to TENSOR_ALIGN, the file
    padded to whole direct-I/O blocks."""
    return align_up(sum(converted_bytes(s, r, fmt) for s, r in unit_tensors(cfg, unit)))


@dataclass(frozen=True)
class SpineDisk:
    """A disk's converted spines: format -> the units converted (and not stale), and the bytes a conversion may still
    write there (None: not known, taken as room enough: the stage then finds out and says so)."""

    copies: Mapping[str, frozenset[str]] = field(default_factory=dict)
    room: int | None = None

    def missing_bytes(self, cfg: ModelConfig, fmt: str, start: int, end: int) -> int:
        """What converting a stage of layers [start, end) to `fmt` would still write."""
        held = self.copies.get(fmt, frozenset())
        return sum(converted_unit_bytes(cfg, u, fmt) for u in stage_units(cfg, start, end) if u not in held)

    def has(self, cfg: ModelConfig, fmt: str, start: int, end: int) -> bool:
        """Every unit of the stage is converted to `fmt` already."""
        held = self.copies.get(fmt, frozenset())
        return all(u in held for u in stage_units(cfg, start, end))

    def ready(self, cfg: ModelConfig, fmt: str, start: int, end: int) -> bool:
        """The stage can read a `fmt` copy: there already, or with room to write what is missing."""
        return self.room is None or self.missing_bytes(cfg, fmt, start, end) <= self.room

    def describe(self) -> str:
        """The copies as `plan` shows them: "q4 (95 parts)", or "none"; and the room."""
        held = ", ".join(f"{fmt} ({len(units)} parts)" for fmt, units in sorted(self.copies.items()) if units)
        room = "" if self.room is None else f", {self.room / 1e9:.1f} GB free to convert"
        return (held or "none") + room
