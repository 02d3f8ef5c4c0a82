"""A worker's background tasks around its requests (worker/idle.py): compute measured again only while idle, the
median announced; on macOS the Mac held awake while the worker serves (the command it runs, platform monkeypatched:
no Mac here) and let go when idle."""

from __future__ import annotations

import asyncio

from deltafin.plan.cluster.compute import ComputeSpeed
from deltafin.runtime.compute_probe import ComputeReadings
from deltafin.worker import idle


class FakeService:
    def __init__(self, readings: list[ComputeSpeed]):
        self.idle = 100.0
        self.stage = True
        self.to_measure = list(readings)
        self.measured = 0
        self.announced: list[ComputeSpeed] = []

    def idle_for(self) -> float:
        return self.idle

    def holds_stage(self) -> bool:
        return self.stage

    async def measure(self) -> ComputeSpeed:
        self.measured += 1
        return self.to_measure.pop(0)

    def announce_compute(self, speed: ComputeSpeed) -> None:
        self.announced.append(speed)


def _speed(t: float) -> ComputeSpeed:
    return ComputeSpeed(t, t / 10, {"bf16": 1e9 / t}, {"bf16": 1e10 / t})


async def test_an_idle_worker_measures_again_and_announces_the_median():
    busy_start = _speed(9e-3)  # the reading at start fell in a busy moment
    service = FakeService([_speed(1e-3), _speed(1.2e-3)])
    readings = ComputeReadings([busy_start])
    task = asyncio.ensure_future(idle.remeasure_compute(service, readings, service.measure, service.announce_compute,
                                                        every_s=0.01, idle_s=1.0))
    for _ in range(200):
        if len(service.announced) == 2:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert service.announced[-1].expert_one_s == 1.2e-3  # the median of 9, 1 and 1.2 ms: the busy one is outvoted


async def test_a_serving_worker_is_not_measured():
    service = FakeService([_speed(1e-3)])
    service.idle = 0.0  # serving
    task = asyncio.ensure_future(idle.remeasure_compute(service, ComputeReadings([_speed(2e-3)]), service.measure,
                                                        service.announce_compute, every_s=0.01, idle_s=1.0))
    await asyncio.sleep(0.1)
    task.cancel()
    assert service.measured == 0 and service.announced == []


async def test_a_failed_reading_keeps_the_announced_one(caplog):
    service = FakeService([])  # measure() raises IndexError
    task = asyncio.ensure_future(idle.remeasure_compute(service, ComputeReadings([_speed(2e-3)]), service.measure,
                                                        service.announce_compute, every_s=0.01, idle_s=1.0))
    await asyncio.sleep(0.1)
    assert not task.done()  # still running: the worker serves on
    task.cancel()
    assert service.announced == [] and "failed" in caplog.text


class FakeProcess:
    def __init__(self, args, **kwargs):
        self.args, self.alive = args, True

    def poll(self):
        return None if self.alive else 0

    def terminate(self):
        self.alive = False


async def test_a_mac_serving_a_stage_is_kept_awake_and_let_sleep_when_idle():
    spawned: list[FakeProcess] = []
    guard = idle.SleepGuard("darwin", spawn=lambda args, **kw: spawned.append(FakeProcess(args, **kw)) or spawned[-1])
    service = FakeService([])
    service.idle = 0.0
    task = asyncio.ensure_future(idle.keep_awake(service, guard, 4242, check_s=0.01, awake_after_s=60.0))
    await asyncio.sleep(0.05)
    assert [p.args for p in spawned] == [["caffeinate", "-i", "-w", "4242"]] and guard.held  # one, tied to the pid
    service.idle = 120.0  # idle past the limit: the Mac may sleep
    await asyncio.sleep(0.05)
    assert not guard.held and not spawned[0].alive
    service.idle = 0.0  # serving again
    await asyncio.sleep(0.05)
    assert len(spawned) == 2 and guard.held
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not spawned[1].alive  # a worker that stops lets the Mac sleep


async def test_a_worker_without_a_stage_does_not_hold_the_mac_awake():
    spawned = []
    guard = idle.SleepGuard("darwin", spawn=lambda args, **kw: spawned.append(args))
    service = FakeService([])
    service.idle, service.stage = 0.0, False
    task = asyncio.ensure_future(idle.keep_awake(service, guard, 1, check_s=0.01))
    await asyncio.sleep(0.05)
    task.cancel()
    assert spawned == []


def test_linux_never_runs_caffeinate():
    calls = []
    guard = idle.SleepGuard("linux", spawn=lambda *a, **k: calls.append(a))
    guard.hold(1)
    assert calls == [] and not guard.held


def test_a_mac_without_caffeinate_is_warned_about(caplog):
    def missing(*args, **kwargs) -> object:
        raise FileNotFoundError("caffeinate")

    guard = idle.SleepGuard("darwin", spawn=missing)
    guard.hold(1)
    assert not guard.held and "Prevent automatic sleeping" in caplog.text


async def test_a_reading_a_call_interrupts_is_dropped_quietly(caplog):
    from deltafin.kernels.timing import Stopped

    service = FakeService([])

    async def interrupted() -> ComputeSpeed:
        raise Stopped("a call came in")

    task = asyncio.ensure_future(idle.remeasure_compute(service, ComputeReadings([_speed(2e-3)]), interrupted,
                                                        service.announce_compute, every_s=0.01, idle_s=1.0))
    await asyncio.sleep(0.1)
    assert not task.done()
    task.cancel()
    assert service.announced == [] and "failed" not in caplog.text
