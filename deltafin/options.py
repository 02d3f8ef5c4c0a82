"""Typed options from named values: the one rule the command line and the Python API share.

Every concern's options are a frozen dataclass that checks itself when built (StageOptions with its
SizingOptions, ClusterOptions, ServingOptions, SamplingParams). The command line builds them from its parsed
flags, the Python API from keywords, both through `from_values`: a value is named as its flag is, with
underscores, and a size given in GB as NAME_gb fills the field NAME_bytes (`--memory-gb 48` and
`memory_gb=48` are `memory_bytes=48e9`). Errors name the flag.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from deltafin.errors import DeltafinError

GB = 1e9
T = TypeVar("T")

# the values of the knobs that take one of a few (the flags' choices, the typed options' checks); the spine's
# formats are the registry's (deltafin/formats: spine_choices, converted_spines)
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("fp32", "bf16")
IO_MODES = ("direct", "buffered")
CACHE_POLICIES = ("lru", "lfu", "pinned")
KERNELS = ("auto", "reference", "native", "mlx")
EXPERT_MODES = ("auto", "wide", "local")
WIRES = ("fp32", "bf16")  # what the hidden states and expert rows cross the links as: exact, or lossy and half
PREFILL_BATCHES = ("ride", "separate")


def flag(name: str) -> str:
    """An option's name as its flag: `expert_cache_gb` -> `--expert-cache-gb`."""
    return "--" + name.replace("_", "-")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DeltafinError(f"{flag(name)}: invalid choice: {value!r} (choose from {', '.join(map(repr, choices))})")


def at_least(low: int, **values: float | None) -> None:
    """Each given value (None: not given) is at least `low` (0 or 1), else the error names its flag."""
    for name, value in values.items():
        if value is not None and value < low:
            raise DeltafinError(f"{flag(name)} must be at least 1" if low else f"{flag(name)} must not be negative")


def more_than_zero(**values: float | None) -> None:
    """Each given value (None: not given) is more than 0 (a budget of nothing holds nothing), else the error names
    its flag."""
    for name, value in values.items():
        if value is not None and value <= 0:
            raise DeltafinError(f"{flag(name)} must be more than 0")


def _gb_name(field: str) -> str | None:
    return field[:-len("_bytes")] + "_gb" if field.endswith("_bytes") else None


def from_values(cls: type[T], values: Mapping[str, Any]) -> T:
    """`cls` built from the values that name its fields (as they are, or NAME_gb for NAME_bytes); a field that is
    itself an options dataclass is built from the same values. Values for other options are left alone."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        gb = _gb_name(f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = from_values(hints[f.name], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
        elif gb is not None and gb in values:
            kwargs[f.name] = None if values[gb] is None else int(values[gb] * GB)
    return cls(**kwargs)


def option_names(*classes: type) -> set[str]:
    """The names `from_values` takes for `classes` (nested options dataclasses included)."""
    names: set[str] = set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                names |= option_names(hints[f.name])
            else:
                names.add(_gb_name(f.name) or f.name)
    return names
