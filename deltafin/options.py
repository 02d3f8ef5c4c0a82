"""Typed options from named values: the one rule the command line and the Python API share.

Every concern's options are a frozen dataclass that checks itself when built (StageOptions with its
SizingOptions, ClusterOptions, ServingOptions, SamplingParams). The command line builds them from its parsed
flags, the Python API from keywords, both through `from_values`: a value is named as its flag is, with
underscores, and a size given in GB as NAME_gb fills the field NAME_bytes (`--memory-gb 48` and
`memory_gb=48` are `memory_bytes=48e9`). Errors name the flag.

A field a user gives is declared with `opt`: its default and its help, once; the command line's flags are made
from those fields (deltafin/cli/flags.py, `add_fields`), so a flag's name, type, default and help are the field's.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from deltafin.errors import DeltafinError

GB = 1e9
T = TypeVar("T")

# the values of the knobs that take one of a few (the flags' choices, the typed options' checks); the spine's
# formats are the registry's (deltafin/formats: spine_choices, converted_spines)
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("fp32", "bf16")
IO_MODES = ("direct", "buffered")
CACHE_POLICIES = ("lru", "lfu", "pinned", "least-stale")
KERNELS = ("auto", "reference", "native", "mlx")
EXPERT_PLACEMENTS = ("auto", "wide", "local")  # where a token's experts run (--experts)
HOP_MODES = ("auto", "relay", "direct")  # how a stage's states reach the next (plan/timing/hops.py)
WIRES = ("fp32", "bf16")  # what the hidden states and expert rows cross the links as: exact, or lossy and half
PREFILL_BATCHES = ("ride", "separate")


@dataclass(frozen=True)
class Flag:
    """How an option field is given on the command line, beside what its name, type and default say. `help` is
    argparse's (`%(default)s` names the default, `%%` is a percent sign); it and `choices` may be functions, asked
    when the flag is made (a registry's entries: the spine formats)."""

    help: str | Callable[[], str]
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # other spellings that still work, shown in --help (--threads)
    hidden: tuple[str, ...] = ()  # older spellings that still work, not shown (--context)
    name: str | None = None  # the flag's name where it is not the field's (--max-context for `context`)
    off: str | None = None  # a switch that is on by default: the flag that turns it off (--no-prefetch)


def opt(default: Any, help: str | Callable[[], str], **flag: Any) -> Any:
    """A user's option field: its default and its command-line flag (`Flag`'s fields)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


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


def gb_name(field: str) -> str | None:
    """The name a size field is given by in GB (`memory_bytes` -> `memory_gb`); None for any other field."""
    return field[:-len("_bytes")] + "_gb" if field.endswith("_bytes") else None


def from_values(cls: type[T], values: Mapping[str, Any], **given: Any) -> T:
    """`cls` built from the values that name its fields (as they are, a list as a tuple field's tuple, or NAME_gb for
    NAME_bytes); a field that is itself an options dataclass is built from the same values, unless `given` holds
    it. Values for other options are left alone."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        gb = gb_name(f.name)
        if f.name in given:
            kwargs[f.name] = given[f.name]
        elif dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = from_values(hints[f.name], values)
        elif f.name in values:
            kwargs[f.name] = _held(hints[f.name], values[f.name])
        elif gb is not None and gb in values:
            kwargs[f.name] = None if values[gb] is None else int(values[gb] * GB)
    return cls(**kwargs)


def _held(hint: Any, value: Any) -> Any:
    """`value` as its field holds it: a repeated flag's list (argparse appends) as the field's tuple."""
    if isinstance(value, list) and any(typing.get_origin(h) is tuple for h in (hint, *typing.get_args(hint))):
        return tuple(value)
    return value


def option_names(*classes: type, declared: bool = False) -> set[str]:
    """The names `from_values` takes for `classes` (nested options dataclasses included); with `declared`, only
    those of the fields a user gives (declared with `opt`: the others are the process's or the plan's)."""
    names: set[str] = set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                names |= option_names(hints[f.name], declared=declared)
            elif not declared or "flag" in f.metadata:
                names.add(gb_name(f.name) or f.name)
    return names
