"""The cluster's spine format (pure): one for every stage, as asked (the coordinator's `--spine`, else the workers'
own, which must agree), or with `auto` the first of the registry's (formats.auto_spines) that the workers hold
whole, else the last streaming — and, with what their disks hold (plan/memory/spine_copies.py), never a format that
would be quantized at every start where a converted copy of another that fits is on the disks, nor one that streams from
a copy no disk can hold. With the formats as registered (bf16, int8, q4):

    bf16 held whole                                       (needs no copy)
    int8 held whole, every stage's copy there or writable (converted once)
    q4 held whole, every stage's copy there or writable   (a copy beats quantizing int8 at every start)
    int8 held whole                                       (quantized as it loads where a disk has no copy, no room)
    q4 held whole                                         (the same)
    q4 streaming its tail, every copy there or writable
    int8 with no copy: quantized as it loads, the tail streamed as stored (the fastest plan that needs no copy)

The planner (planner.py) hands in how to plan in one format (`plan_in`) and which stages' workers can neither read
nor write a copy of a format (`unready`), so this module sees no worker and no plan type of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from deltafin.errors import PlanError
from deltafin.formats import auto_spines, spine_format
from deltafin.plan.memory.sizing_options import QUALITY_SOURCE, SizingInput

P = TypeVar("P")
PlanIn = Callable[[SizingInput, bool], "P | None"]  # (options, resident only) -> the cheapest plan, or None
Unready = Callable[[P, str], list[str]]  # (plan, format) -> workers with no copy of their stage and no room for one


def asked_spine(coordinator: str, workers: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """The format asked for, and who asked: the coordinator's `--spine`, else the one the workers (name, own
    `--spine`) were started with; ("auto", "") when nobody fixed one. PlanError where they disagree: a worker's own
    format is honoured or refused, never replaced."""
    fixed = sorted({spine for _, spine in workers if spine != "auto"})
    if coordinator != "auto":
        others = [f"{name} (--spine {spine})" for name, spine in workers if spine not in ("auto", coordinator)]
        if others:
            raise PlanError(f"the coordinator asks for --spine {coordinator}, but {', '.join(others)} started with "
                            f"another: give every worker and the coordinator the same --spine, or auto")
        return coordinator, "as asked (--spine)"
    if len(fixed) > 1:
        raise PlanError("the workers were started with different spine formats (" + ", ".join(
            f"{name}: {spine}" for name, spine in workers if spine != "auto") + "): a cluster holds one; give them "
            "the same --spine, or auto")
    if fixed:
        names = ", ".join(name for name, spine in workers if spine == fixed[0])
        return fixed[0], f"as the workers were started (--spine {fixed[0]} on {names})"
    return "auto", ""


def choose_spine(opts: SizingInput, plan_in: PlanIn, unready: Unready, asked_why: str = "as asked (--spine)",
                 usable: Sequence[str] | None = None) -> tuple[P | None, str, SizingInput]:
    """The plan in the cluster's spine format, why that format, and the options it was planned with (see the module
    docstring). None where no format has a plan. `usable`: the formats the model can use (layer_table.model_spines;
    None: all of auto's)."""
    if opts.spine != "auto":
        return _as_asked(opts, plan_in, unready, asked_why)
    order = [f for f in auto_spines() if usable is None or f in usable]
    whole = _Whole(opts, plan_in)
    stored = [f for f in order if not spine_format(f).converted]
    converted = [f for f in order if spine_format(f).converted]
    for spine in stored:
        if whole[spine] is not None:
            return whole[spine], "the workers hold the whole spine as stored", replace(opts, spine=spine)
    cannot = _cannot(stored[-1])
    for i, spine in enumerate(converted):
        plan = whole[spine]
        if plan is not None and not unready(plan, spine):
            why = cannot if i == 0 else _instead_of(converted[i - 1], spine, whole[converted[i - 1]], unready, cannot)
            return plan, f"{why}; {spine} costs {_quality(spine)}", replace(opts, spine=spine)
    for spine in converted:  # held whole, quantized as it loads where a disk can neither read nor write a copy
        plan = whole[spine]
        if plan is not None:
            return plan, (f"{cannot}; {spine} costs {_quality(spine)}; "
                          f"{_quantized(unready(plan, spine), spine)}"), replace(opts, spine=spine)
    return _streaming(opts, plan_in, unready, order)


def _quality(spine: str) -> str:
    return f"{spine_format(spine).quality} {QUALITY_SOURCE}"


class _Whole(dict):
    """The plan holding the whole spine in each format, planned when first asked for."""

    def __init__(self, opts: SizingInput, plan_in: PlanIn):
        super().__init__()
        self.opts, self.plan_in = opts, plan_in

    def __missing__(self, spine: str) -> object:
        self[spine] = plan = self.plan_in(replace(self.opts, spine=spine), True)
        return plan


def _as_asked(opts: SizingInput, plan_in: PlanIn, unready: Unready, why: str) -> tuple[P | None, str,
                                                                                        SizingInput]:
    """The format asked for: from its copies where every stage can read or write one, else (layers stream, which
    needs a copy) the same format with none."""
    plan = plan_in(opts, False)
    if plan is None or not spine_format(opts.spine).converted:
        return plan, why, opts
    lacking = unready(plan, opts.spine)
    if not lacking:
        return plan, why, opts
    bare = replace(opts, converted=False)
    without = plan_in(bare, False)
    if without is None:
        return plan, f"{why}; {_quantized(lacking, opts.spine)}", opts
    return without, f"{why}; {_quantized(lacking, opts.spine)}, the layers that stream read as stored", bare


def _instead_of(before: str, spine: str, plan: P | None, unready: Unready, cannot: str) -> str:
    """Why `spine` and not `before`, the format auto tries first, which the workers hold whole (`plan`) but would
    quantize at every start."""
    if plan is None:
        return _cannot(before)
    return (f"{cannot}; {before} would be quantized at every start ({', '.join(unready(plan, before))}: no "
            f"converted {before} copy and no room to write one), and the converted {spine} copy is read instead")


def _streaming(opts: SizingInput, plan_in: PlanIn, unready: Unready, order: list[str]
               ) -> tuple[P | None, str, SizingInput]:
    """No format held whole: the last of auto's (the fewest bytes) with its tail streamed from the converted copies;
    where a disk can neither hold nor write one, the fastest plan that needs none: the last auto chooses for more
    than room (int8) quantized as it loads, the tail streamed as stored."""
    last, no_copy = order[-1], [f for f in auto_spines(for_room_too=False) if f in order][-1]
    streaming = replace(opts, spine=last)
    plan = plan_in(streaming, False)
    why = _cannot(no_copy)
    if plan is not None and not unready(plan, last):
        return plan, f"{why}; {last} costs {_quality(last)}", streaming
    bare = replace(opts, spine=no_copy, converted=False)
    without = plan_in(bare, False)
    if without is None:
        return plan, why, streaming
    lacking = unready(plan, last) if plan is not None else []
    return without, (f"{why}; {', '.join(lacking) or 'a worker'} has no converted {last} copy and no room to write "
                     f"one: {no_copy} quantized as it loads, the layers that stream read as stored ({no_copy} costs "
                     f"{_quality(no_copy)})"), bare


def _cannot(spine: str) -> str:
    return f"the workers cannot hold the whole {spine} spine beside their working sets"


def _quantized(workers: list[str], spine: str) -> str:
    if not workers:
        return f"read from the converted {spine} copies"
    return (f"quantized as it loads, at every start, on {', '.join(workers)} (no converted {spine} copy there and "
            "no room to write one)")
