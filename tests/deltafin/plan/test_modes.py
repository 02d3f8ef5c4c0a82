"""Wide or local experts by what the links make each cost (K3's full geometry, pure): wide on a fast link, the
pipelined plan where a turn's rows would take the link longer than the disks take to read; as asked when asked;
wide where every expert is in memory (nothing read, their compute spread)."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.paths import bundled_model
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.cluster.links import PROFILES, Links, profile
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.modes import choose_mode, turn_seconds
from deltafin.plan.planner import plan_layers

GB = 10**9


@pytest.fixture(scope="module")
def k3():
    return parse_config(preset_config("k3"))


def _macs(n: int, gb: int = 56, layers: int = 93) -> list[WorkerCapacity]:
    return [WorkerCapacity(f"m{i}", gb * GB, 6.6, ((0, layers),), True, address=f"m{i}:1", device="mps",
                           worker_id=f"m{i}") for i in range(n)]


def test_a_fast_link_is_wide_and_a_slow_one_the_pipelined_plan(k3):
    fast = choose_mode(k3, _macs(2), SizingInput(), 4, "auto", Links(assumed=PROFILES["thunderbolt"]))
    assert fast.wide and fast.mode_why.startswith("a turn of a 4,096-token prompt and 512 tokens takes")
    slow_link = Links(assumed=profile(40.0, 20))  # a congested link: 40 ms, 20 Mbit/s
    slow = choose_mode(k3, _macs(2), SizingInput(), 4, "auto", slow_link)
    wide = plan_layers(k3, _macs(2), experts="wide", links=slow_link)
    assert not slow.wide and turn_seconds(k3, slow) < turn_seconds(k3, wide)
    assert "local: a token" in slow.mode_why and "wide: a token" in slow.mode_why


def test_asked_is_kept_and_resident_experts_stay_wide(k3):
    slow_link = Links(assumed=profile(40.0, 20))
    asked = choose_mode(k3, _macs(2), SizingInput(), 4, "wide", slow_link)
    assert asked.wide and asked.mode_why.startswith("as asked (--experts wide); over these links the exact wire")
    mini = load_config(bundled_model())
    small = choose_mode(mini, _macs(2, 8, 8), SizingInput(), 4, "auto", slow_link)
    assert small.wide and small.mode_why == "every expert is in memory: wide spreads their compute"
    one = choose_mode(k3, _macs(1), SizingInput(), 4, "auto", slow_link)
    assert not one.wide and one.mode_why == "one worker reads its own experts"


def test_the_reason_says_what_a_bf16_wire_would_make_a_prompt_where_the_wire_holds_it_back(k3):
    """Wi-Fi at K3's width: the exact wire's 4K prompt and the bf16 one's, as the predictions give them; nothing on a
    Thunderbolt bridge (the links are not what a prompt waits for) or where the wire is bf16 already."""
    from dataclasses import replace

    from deltafin.plan.timing.predict import prefill_seconds

    wifi = Links(assumed=PROFILES["wifi"])
    plan = choose_mode(k3, _macs(2), SizingInput(), 4, "auto", wifi)
    exact = prefill_seconds(k3, plan, 4096).total
    half = prefill_seconds(k3, replace(plan, links=replace(wifi, value_bytes=2)), 4096).total
    assert half < 0.9 * exact
    assert plan.mode_why.endswith(f"the exact wire holds a 4,096-token prompt back: {exact:.0f} s, {half:.0f} s with "
                                  "--wire bf16 (lossy; its cost is measured in docs/cluster.md)")
    fast = choose_mode(k3, _macs(2), SizingInput(), 4, "auto", Links(assumed=PROFILES["thunderbolt"]))
    assert "--wire bf16" not in fast.mode_why
    already = choose_mode(k3, _macs(2), SizingInput(), 4, "wide", replace(wifi, value_bytes=2))
    assert already.mode_why == "as asked (--experts wide)"


def test_a_choice_the_measurements_barely_separate_says_so(k3):
    """Two modes within CLOSE_CALL of each other, or within the workers' compute spread, are a close call; modes
    clearly apart are not."""
    from deltafin.plan.cluster.compute import assumed_gpu
    from deltafin.plan.modes import CLOSE_CALL, close_call

    assert close_call({"wide": 10.0, "local": 30.0}, []) == ""
    said = close_call({"wide": 10.0, "local": 10.5}, [])
    assert said.startswith("; a close call: the two are 5% apart") and f"±{CLOSE_CALL:.0%}" in said
    steady = assumed_gpu(k3, 400, 10)
    noisy = replace_spread(steady, 0.6)  # readings that spread 60 %: 13 s against 18 s is no clear choice
    plan = plan_layers(k3, [replace_compute(w, noisy) for w in _macs(2)], experts="wide",
                       links=Links(assumed=PROFILES["thunderbolt"]))
    assert "±60%" in close_call({"wide": 13.0, "local": 18.0}, [plan])
    plan = plan_layers(k3, [replace_compute(w, steady) for w in _macs(2)], experts="wide",
                       links=Links(assumed=PROFILES["thunderbolt"]))
    assert close_call({"wide": 13.0, "local": 18.0}, [plan]) == ""


def replace_spread(speed, spread):
    from dataclasses import replace

    return replace(speed, spread=spread)


def replace_compute(worker, speed):
    from dataclasses import replace

    return replace(worker, compute=speed)
