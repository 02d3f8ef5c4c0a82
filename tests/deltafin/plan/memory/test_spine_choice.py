"""The cluster's spine format follows what the workers' disks hold (K3's full geometry, pure): a converted copy
that fits beats quantizing at every start, a copy that can be written is written once, and without either the
plan needs none; a worker's own --spine is honoured or refused, never replaced."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.errors import PlanError
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.memory.spine_choice import asked_spine
from deltafin.plan.memory.spine_copies import SpineDisk, converted_unit_bytes, stage_units
from deltafin.plan.planner import plan_layers

GB = 10**9


@pytest.fixture(scope="module")
def k3():
    return parse_config(preset_config("k3"))


def _mac(name: str, disk: SpineDisk | None, spine: str = "auto") -> WorkerCapacity:
    """A 64 GB Mac's worker (56 GB of Metal's working set) holding every layer."""
    return WorkerCapacity(name, 56 * GB, 6.6, ((0, 93),), True, address=f"{name}:7070", device="mps",
                          worker_id=name, spine=spine, spine_disk=disk)


def _spines(plan) -> set[tuple[str, bool]]:
    return {(s.plan.spine, s.plan.converted) for s in plan.stages}


def test_two_macs_with_a_q4_copy_and_no_room_read_it_rather_than_quantize_int8_at_every_start(k3):
    every = frozenset(stage_units(k3, 0, 93))
    q4_there = SpineDisk({"q4": every}, room=0)
    plan = plan_layers(k3, [_mac("a", q4_there), _mac("b", q4_there)], experts="wide")
    assert _spines(plan) == {("q4", True)} and len(plan.stages) == 2
    why = plan.stages[0].plan.spine_why
    assert "int8 would be quantized at every start (a, b" in why and "the converted q4 copy is read" in why
    # the same workers before this rule: int8 halves (the spine held whole in the better format)
    unknown = plan_layers(k3, [_mac("a", None), _mac("b", None)], experts="wide")
    assert _spines(unknown) == {("int8", True)}


def test_room_to_write_the_better_copy_converts_it_once(k3):
    every = frozenset(stage_units(k3, 0, 93))
    need = sum(converted_unit_bytes(k3, u, "int8") for u in stage_units(k3, 0, 93))
    roomy = SpineDisk({"q4": every}, room=need)  # room for every layer's int8 (each stage needs half)
    plan = plan_layers(k3, [_mac("a", roomy), _mac("b", roomy)], experts="wide")
    assert _spines(plan) == {("int8", True)} and "quantized" not in plan.stages[0].plan.spine_why


def test_no_copy_and_no_room_quantizes_int8_as_it_loads_and_says_where(k3):
    bare = SpineDisk({}, room=0)
    plan = plan_layers(k3, [_mac("a", bare), _mac("b", bare)], experts="wide")
    assert _spines(plan) == {("int8", True)}  # held whole: the stage quantizes as it loads (no streamed layer)
    assert "quantized as it loads, at every start, on a, b" in plan.stages[0].plan.spine_why


def test_one_mac_without_room_streams_int8_in_memory_not_a_bf16_spine(k3):
    """One 16 GB stage with no copy and no room: the fastest plan that needs none (int8 quantized as its resident
    layers load, the rest streamed as stored) — not the bf16 spine streamed whole."""
    small = WorkerCapacity("m", 16 * GB, 6.6, ((0, 93),), True, worker_id="m", spine_disk=SpineDisk({}, room=0))
    plan = plan_layers(k3, [small], experts="local")
    z = plan.stages[0].plan
    assert (z.spine, z.converted) == ("int8", False) and z.streamed_layers and z.resident_layers
    bf16 = plan_layers(k3, [small], SizingInput(spine="bf16"), experts="local").stages[0].plan
    assert z.spine_bytes_per_token < bf16.spine_bytes_per_token and len(z.resident_layers) > len(bf16.resident_layers)
    assert "no converted q4 copy and no room to write one" in z.spine_why and "read as stored" in z.spine_why
    # with the q4 copy on its disk the same Mac streams it instead (a third of the bytes)
    q4 = plan_layers(k3, [WorkerCapacity("m", 16 * GB, 6.6, ((0, 93),), True, worker_id="m",
                                         spine_disk=SpineDisk({"q4": frozenset(stage_units(k3, 0, 93))}, 0))])
    assert (q4.stages[0].plan.spine, q4.stages[0].plan.converted) == ("q4", True)
    assert q4.stages[0].plan.spine_bytes_per_token < z.spine_bytes_per_token


def test_a_worker_s_own_spine_is_honoured_or_refused(k3):
    plan = plan_layers(k3, [_mac("a", None, "q4"), _mac("b", None)], experts="wide")
    assert _spines(plan) == {("q4", True)}
    assert "as the workers were started (--spine q4 on a)" in plan.stages[0].plan.spine_why
    with pytest.raises(PlanError, match=r"coordinator asks for --spine int8, but a \(--spine q4\)"):
        plan_layers(k3, [_mac("a", None, "q4"), _mac("b", None)], SizingInput(spine="int8"), experts="wide")
    with pytest.raises(PlanError, match="different spine formats"):
        asked_spine("auto", [("a", "q4"), ("b", "int8")])
    assert asked_spine("auto", [("a", "auto")]) == ("auto", "")
    assert asked_spine("q4", [("a", "q4"), ("b", "auto")]) == ("q4", "as asked (--spine)")


def test_asked_q4_that_streams_without_a_copy_runs_without_one(k3):
    small = WorkerCapacity("m", 16 * GB, 6.6, ((0, 93),), True, worker_id="m", spine_disk=SpineDisk({}, room=0))
    z = plan_layers(k3, [small], SizingInput(spine="q4"), experts="local").stages[0].plan
    assert (z.spine, z.converted) == ("q4", False) and z.streamed_layers
    assert "as asked (--spine)" in z.spine_why and "read as stored" in z.spine_why
