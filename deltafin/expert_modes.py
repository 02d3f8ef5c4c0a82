"""Expert modes: opt-in ways to read fewer expert bytes a token than the router's exact top-k (pure math).

Exact is the default and the only mode the model was trained with; every other mode changes the model's numbers,
is chosen by name (`--expert-mode`), and has its cost measured on held-out text (`deltafin bench --quality
--expert-mode all`, docs/expert-modes.md). A mode is one or more parts joined by "+", each NAME or NAME:VALUE:

  exact        the router's top-k (the default)
  top-p:P      of a token's k routed experts, the fewest (most weight first) whose share of the token's routed
               weight reaches P, at least a quarter of k (rounded up); the kept experts' weights are scaled back to
               the routed total. The dropped ones are never read. P in (0, 1).
  cached:M     cache-aware routing: an expert already in this stage's memory (cached, or read ahead) is chosen
               over one that is not whose selection score (router score + bias) is less than M higher. M in
               (0, 1]. Which experts are in memory depends on what ran before, so a token's output depends on the
               history of the process as well as on its text: tokens are not reproducible across runs.

  FORMAT       every routed expert read from a converted copy in a low-bit expert format (q3: 3-bit groups;
               deltafin/formats), converted once per worker's layers, about 0.77 of the stored experts' bytes.
  FORMAT-tail:P  a token's light experts (those after the heaviest whose share of its routed weight reaches P)
               read from that copy when they are not in memory as stored; the heavy ones always as stored (a miss
               on a light expert costs the copy's bytes). P in (0, 1). Which are in memory steers it, as cached:M.

`top-p:0.8+cached:0.02` combines both (cache-aware choice first, then top-p over what was chosen, then the copy for
what is read of it). The format's name is checked against deltafin/formats' registry where a mode is applied.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from deltafin.errors import DeltafinError

EXACT = "exact"
# what `--expert-mode all` measures, exact first (it is what the others are measured against)
PRESETS = (EXACT, "top-p:0.9", "top-p:0.8", "top-p:0.7", "top-p:0.6", "top-p:0.55", "top-p:0.5", "cached:0.05",
           "top-p:0.55+cached:0.05")
# ... and for each low-bit expert format F the formats' registry names (plan/memory/sizing_options.py mode_presets),
# these
LOW_BIT_PRESETS = ("{F}", "{F}-tail:0.5", "top-p:0.7+{F}-tail:0.5", "top-p:0.7+{F}", "top-p:0.6+{F}", "top-p:0.55+{F}",
                   "top-p:0.5+{F}")
# what a top-p mode reads of exact's expert bytes, as `bench --quality --expert-mode all` measured it on k3-mini's
# held-out text (4000 positions, docs/expert-modes.md; tests/deltafin/test_expert_modes.py measures a point again):
# (P, share), P rising. The plan prices a mode by it, between two points linearly (1 at P = 1).
TOP_P_READS = ((0.5, 0.495), (0.55, 0.655), (0.6, 0.718), (0.7, 0.744), (0.8, 0.941), (0.9, 0.997))


@dataclass(frozen=True)
class ExpertMode:
    top_p: float | None = None  # keep the fewest experts whose share of the routed weight reaches this
    held_margin: float | None = None  # cache-aware routing: how much lower a held expert's score may be
    low_bit: str | None = None  # the low-bit expert format of the copy read (deltafin/formats)
    low_tail: float | None = None  # ... for the experts after the heaviest of this share only (None: every one)

    @property
    def exact(self) -> bool:
        return self.top_p is None and self.held_margin is None and self.low_bit is None

    @property
    def reproducible(self) -> bool:
        """A token's output depends on its text alone (not on what the cache holds)."""
        return self.held_margin is None and self.low_tail is None

    @property
    def name(self) -> str:
        """The canonical spelling (what `parse` reads back; a kept state's identity names it)."""
        low = None if self.low_bit is None else self.low_bit + ("" if self.low_tail is None else
                                                                f"-tail:{self.low_tail:g}")
        parts = ([f"cached:{self.held_margin:g}"] if self.held_margin is not None else []) + (
            [f"top-p:{self.top_p:g}"] if self.top_p is not None else []) + ([low] if low else [])
        return "+".join(sorted(parts, reverse=True)) or EXACT


def parse(text: str) -> ExpertMode:
    """An `--expert-mode` value -> ExpertMode; a DeltafinError that names what is wrong otherwise (a low-bit
    format's name is checked where the mode is applied: the formats' registry is not this module's to read)."""
    top_p = margin = low = tail = None
    for part in (text or "").strip().lower().split("+"):
        name, _, value = part.strip().partition(":")
        if name == EXACT and not value:
            continue
        if (name.endswith("-tail") and value) or (not value and FORMAT_NAME.fullmatch(name) and name != "cached"):
            if low is not None:
                raise DeltafinError(f"--expert-mode: one low-bit part at most (got {low} and {part.strip()!r})")
            low, tail = name.removesuffix("-tail"), _fraction(part, value) if value else None
            continue
        if name not in ("top-p", "cached"):
            raise DeltafinError(f"--expert-mode: unknown mode {part.strip()!r}: use exact, top-p:P, cached:M, a "
                                "low-bit expert format (q3) or FORMAT-tail:P, or parts joined by + (e.g. "
                                "top-p:0.8+cached:0.05)")
        try:
            number = float(value)
        except ValueError:
            raise DeltafinError(f"--expert-mode: {name} needs a number, as {name}:"
                                f"{'0.8' if name == 'top-p' else '0.05'} (got {part.strip()!r})") from None
        if name == "top-p":
            if not 0 < number < 1 or top_p is not None:
                raise DeltafinError(f"--expert-mode: top-p:P needs one P in (0, 1) (got {part.strip()!r})")
            top_p = number
        else:
            if not 0 < number <= 1 or margin is not None:
                raise DeltafinError(f"--expert-mode: cached:M needs one M in (0, 1] (got {part.strip()!r})")
            margin = number
    if low is not None and not FORMAT_NAME.fullmatch(low):
        raise DeltafinError(f"--expert-mode: {low!r} is no format's name (e.g. q3-tail:0.5)")
    return ExpertMode(top_p, margin, low, tail)


FORMAT_NAME = re.compile(r"[a-z][a-z0-9]*")  # what a low-bit part's format name may look like


def _fraction(part: str, value: str) -> float:
    """FORMAT-tail:P's P, in (0, 1)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number < 1:
        raise DeltafinError(f"--expert-mode: FORMAT-tail:P needs one P in (0, 1), as q3-tail:0.5 (got "
                            f"{part.strip()!r})")
    return number


def low_bit_presets(fmt: str) -> tuple[str, ...]:
    """The registered modes that read a copy in low-bit expert format `fmt`."""
    return tuple(p.format(F=fmt) for p in LOW_BIT_PRESETS)


def least_kept(k: int) -> int:
    """The fewest experts top-p keeps of a token's k: a quarter, rounded up."""
    return max(1, math.ceil(k / 4))


def read_share(mode: ExpertMode, low_ratio: float = 1.0) -> float:
    """The share of exact's routed-expert bytes a token that `mode` is planned to read; `low_ratio`: an expert's
    bytes in the mode's low-bit copy over its bytes as stored (the caller's, from the formats' registry). Cache-aware
    routing is planned as exact, and a tail's light experts as misses, every one: what the cache saves depends on
    what it holds, measured by the bench, not assumed. A tail's light experts are the reads top-p at its P drops."""
    kept = top_p_share(mode.top_p)
    if mode.low_bit is None:
        return kept
    light = kept if mode.low_tail is None else max(0.0, kept - top_p_share(mode.low_tail))
    return kept - light * (1 - low_ratio)


def top_p_share(p: float | None) -> float:
    """What top-p at `p` reads of exact's experts (TOP_P_READS; None: all)."""
    if p is None:
        return 1.0
    points = (*TOP_P_READS, (1.0, 1.0))
    if p <= points[0][0]:
        return points[0][1] * p / points[0][0]
    for (p0, s0), (p1, s1) in itertools.pairwise(points):
        if p <= p1:
            return s0 + (s1 - s0) * (p - p0) / (p1 - p0)
    return 1.0


def describe(mode: ExpertMode, low_ratio: float = 1.0) -> str:
    """A line for `plan`: the mode, that it is lossy, and what it is planned to read (`low_ratio`: read_share's)."""
    if mode.exact:
        return "expert mode exact: every token's routed experts, as the model was trained"
    held = "" if mode.reproducible else "; which experts are in memory steers it: tokens are not reproducible"
    return (f"expert mode {mode.name} (lossy, as asked: docs/expert-modes.md measures it): a token is planned to read "
            f"{read_share(mode, low_ratio):.3f} of exact's routed expert bytes{held}")
