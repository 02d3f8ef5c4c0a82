"""The registry of weight formats (pure, torch-free): `WeightFormat`, what a format says of itself, and the lookups
the rest of the package reads instead of naming formats: the spine's formats in the order `--spine auto` tries
them, those converted once to the disk, the one held as stored, the format a matrix of a spine is held in
(`held_format`), and the format of a weight in memory (`weight_format`, for the kernels' one `linear`).

A format's functions that need torch are `Entry`s: "module:attribute" (a dotted attribute for a class's method),
imported at first call, so that the registry, and `--help` with it, loads without torch."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltafin.errors import DeltafinError

SPINE, EXPERTS = "spine", "experts"  # a format's role: the non-expert matrices', or the routed experts'
SPINE_MATRIX_ROLES = ("matrix", "matrix8")  # plan/layer_table.tensor_role: the roles a spine format rounds

_FORMATS: dict[str, WeightFormat] = {}
_by_type: dict[type, WeightFormat | None] = {}  # weight_format's memo: a weight's type -> its format


@dataclass(frozen=True)
class Entry:
    """A format's function or class that needs torch, named as "module:attribute" and imported at first use."""

    ref: str

    def load(self) -> Any:
        module, _, path = self.ref.partition(":")
        obj: Any = importlib.import_module(module)
        for attr in path.split("."):
            obj = getattr(obj, attr)
        return obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)


def any_shape(rows: int, cols: int) -> bool:
    return True


@dataclass(frozen=True)
class WeightFormat:
    """One weight format, as the planner, the converter, the kernels and the command line read it.

    A matrix in a converted format is written as its weight type's arrays (the dataclass's fields, in order: `parts`
    says their bytes), read back with the type's `from_arrays(parts, rows, cols)`, and multiplied by the kernels'
    fast path method named as the format where the device has one (kernels/linear.py), else by `reference`."""

    name: str
    role: str  # SPINE | EXPERTS
    summary: str  # what a matrix becomes in it, for the command line's help
    bytes_per_weight: float  # as the matmuls read it, scales included (plan/cluster/compute.py prices them with it)
    matrix_bytes: Callable[[int, int], int]  # a [rows, cols] matrix held in it
    parts: Callable[[int, int], tuple[int, ...]]  # the bytes of each array a [rows, cols] matrix is written as
    fits: Callable[[int, int], bool] = any_shape  # whether it can hold a [rows, cols] matrix
    converted: bool = False  # written once to the disk (`deltafin convert`), read back at the disk's speed
    sensitive: str | None = None  # the format of the matrices it keeps at 8 bits (EIGHT_BIT) and those it cannot hold
    quality: str = ""  # what it costs against the spine as stored, measured (plan/sizing_options.QUALITY_SOURCE)
    auto: bool = True  # `--spine auto` may choose it (trying the formats of more bytes a weight first)
    auto_for_room_only: bool = False  # ... only for room: never where every expert fits beside a larger one, nor
    # where it would be quantized at every start (no converted copy)
    recipe: str = ""  # what decides its converted bytes besides the source (a change makes old copies stale)
    weight: Entry | None = None  # the type of a matrix held in it (None: a plain tensor)
    quantize: Callable[[Any], Any] | None = None  # a dense matrix -> the weight
    dequantize: Callable[[Any, Any], Any] | None = None  # (weight, dtype) -> the dense matrix it stands for
    reference: Callable[[Any, Any], Any] | None = None  # (x, w) -> x @ W.T: the definition its kernels are checked by

    def __post_init__(self) -> None:
        if self.role not in (SPINE, EXPERTS):
            raise ValueError(f"format {self.name}: role {self.role!r} is neither {SPINE} nor {EXPERTS}")

    def holds(self, other: WeightFormat) -> bool:
        """Whether a spine in this format holds some of its matrices in `other` (itself, or its 8-bit format)."""
        return other.name in (self.name, self.sensitive)

    def from_arrays(self, parts: list[Any], rows: int, cols: int) -> Any:
        """A [rows, cols] weight of this format from its arrays as written (byte views: the weight views them)."""
        return self.weight.load().from_arrays(parts, rows, cols)

    @staticmethod
    def arrays(w: Any) -> tuple[Any, ...]:
        """A weight's arrays as written: its dataclass fields, in order."""
        return tuple(getattr(w, f.name) for f in dataclasses.fields(w))


def register(fmt: WeightFormat) -> WeightFormat:
    """Add `fmt` (its module does, as it loads); a name is registered once."""
    if fmt.name in _FORMATS or fmt.name == "auto":
        raise ValueError(f"a weight format named {fmt.name!r} is registered already")
    _FORMATS[fmt.name] = fmt
    _by_type.clear()
    return fmt


def unregister(name: str) -> None:
    """Remove a format (a test's, after it)."""
    del _FORMATS[name]
    _by_type.clear()


def registered() -> tuple[WeightFormat, ...]:
    """Every registered format, the spine's and the experts'."""
    return tuple(_FORMATS.values())


def spine_formats() -> tuple[WeightFormat, ...]:
    """The spine's formats, the most bytes a weight first (the order the plan and the reports list them in)."""
    return tuple(sorted((f for f in _FORMATS.values() if f.role == SPINE), key=lambda f: -f.bytes_per_weight))


def spine_format(name: str) -> WeightFormat:
    fmt = _FORMATS.get(name)
    if fmt is None or fmt.role != SPINE:
        raise DeltafinError(f"unknown spine format {name!r} (choose from {', '.join(spine_choices())})")
    return fmt


def expert_format(name: str) -> WeightFormat:
    fmt = _FORMATS.get(name)
    if fmt is None or fmt.role != EXPERTS:
        raise DeltafinError(f"unknown expert format {name!r}")
    return fmt


def low_bit_formats() -> tuple[str, ...]:
    """The routed experts' converted formats: what an expert mode may read instead of the experts as stored."""
    return tuple(f.name for f in _FORMATS.values() if f.role == EXPERTS and f.converted)


def low_bit_format(name: str) -> WeightFormat:
    """A low-bit expert format an expert mode names (deltafin/expert_modes.py), or a clear error."""
    fmt = _FORMATS.get(name)
    if fmt is None or fmt.role != EXPERTS or not fmt.converted:
        raise DeltafinError(f"--expert-mode: unknown mode {name!r}: use exact, top-p:P, cached:M, or a low-bit expert "
                            f"format ({', '.join(low_bit_formats())}) as FORMAT or FORMAT-tail:P")
    return fmt


def spine_choices() -> tuple[str, ...]:
    """`--spine`'s choices: auto, then every spine format."""
    return ("auto", *(f.name for f in spine_formats()))


def converted_spines() -> tuple[str, ...]:
    """The spine formats converted once to the disk, the fewest bytes a weight first (`deltafin convert`'s
    default is the first)."""
    return tuple(f.name for f in reversed(spine_formats()) if f.converted)


def stored_spine() -> str:
    """The spine format held as stored (nothing converted, nothing rounded)."""
    stored = [f.name for f in spine_formats() if not f.converted]
    if len(stored) != 1:
        raise ValueError(f"one spine format is held as stored, not {stored}")
    return stored[0]


def auto_spines(for_room_too: bool = True) -> tuple[str, ...]:
    """The formats `--spine auto` tries, the most bytes a weight first: the first that holds the whole spine wins,
    the last streams what does not fit. Without `for_room_too`, only those auto chooses for more than room."""
    return tuple(f.name for f in spine_formats() if f.auto and (for_room_too or not f.auto_for_room_only))


def held_format(spine: str, role: str, shape: tuple[int, ...]) -> WeightFormat | None:
    """The format a spine of format `spine` holds a tensor of `role` and `shape` in (None: as stored): its own for
    a matrix it can hold, its `sensitive` format for one it keeps at 8 bits (role matrix8) or cannot hold (a
    format with none: those as stored)."""
    fmt = spine_format(spine)
    if not fmt.converted or role not in SPINE_MATRIX_ROLES or len(shape) != 2 or min(shape) <= 1:
        return None
    if fmt.sensitive is not None and (role != "matrix" or not fmt.fits(*shape)):
        return spine_format(fmt.sensitive)
    return fmt if fmt.fits(*shape) else None


def weight_format(w: object) -> WeightFormat | None:
    """The format whose weight type `w` is (None: a plain tensor, or no registered format's)."""
    kind = type(w)
    if kind not in _by_type:
        _by_type[kind] = next((f for f in _FORMATS.values() if f.weight is not None and f.weight.load() is kind), None)
    return _by_type[kind]
