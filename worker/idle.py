"""What a worker does around its requests, as background tasks of its daemon:

- `remeasure_compute`: while it is idle, it measures its compute again (runtime/compute_probe.py) and announces the
  median of its readings, so that a busy moment at start does not set the cluster's plan for good;
- `keep_awake`: on macOS, a worker that holds a stage and has served within AWAKE_AFTER_S keeps the Mac from idle
  sleep (`caffeinate -i`, tied to this process), and lets it sleep once it has been idle that long: a Mac left
  generating overnight does not stop its stage mid-generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol

from deltafin.kernels.timing import Stopped
from deltafin.plan.cluster.compute import ComputeSpeed
from deltafin.runtime.compute_probe import ComputeReadings

log = logging.getLogger(__name__)

REMEASURE_EVERY_S = 600.0  # how often an idle worker measures its compute again
IDLE_BEFORE_MEASURE_S = 30.0  # ... once it has served nothing for this long
AWAKE_AFTER_S = 600.0  # a Mac stays awake this long after its worker last served
CAFFEINATE = ("caffeinate", "-i")  # macOS: hold off idle sleep (not the display's, nor a closed lid's)


class Serving(Protocol):
    """What these tasks read of the worker's service (worker/service.py)."""

    def idle_for(self) -> float: ...  # seconds since it last served (0 while it serves)

    def holds_stage(self) -> bool: ...


async def remeasure_compute(service: Serving, readings: ComputeReadings, measure: Callable[[], Awaitable[ComputeSpeed]],
                            announce: Callable[[ComputeSpeed], None], every_s: float = REMEASURE_EVERY_S,
                            idle_s: float = IDLE_BEFORE_MEASURE_S) -> None:
    """Forever: every `every_s`, if the worker has been idle for `idle_s`, a new reading (`measure`: on the stage's
    thread, so that no forward runs beside it); the median of the readings is announced."""
    while True:
        await asyncio.sleep(every_s)
        if service.idle_for() < idle_s:
            continue
        try:
            reading = await measure()
        except Stopped:  # a call came in: it goes first, the reading is dropped
            log.debug("a call came in while measuring this worker's compute: the reading is dropped")
            continue
        except Exception as e:  # a failed reading keeps the ones announced; the worker serves on
            log.warning("measuring this worker's compute again failed (%s: %s); the plan keeps its last reading",
                        type(e).__name__, e)
            continue
        if reading is None or service.idle_for() < idle_s:  # a request came in meanwhile: the reading is not clean
            continue
        speed = readings.add(reading)
        announce(speed)
        log.info("compute measured again while idle; announcing the median of %d readings: %s",
                 len(readings.readings), speed.describe())


class SleepGuard:
    """`caffeinate -i -w PID` while held (macOS only; elsewhere nothing: a Linux server does not idle-sleep)."""

    def __init__(self, platform: str | None = None, spawn: Callable[..., subprocess.Popen] = subprocess.Popen):
        self.platform = platform or sys.platform
        self.spawn = spawn
        self.process: subprocess.Popen | None = None

    @property
    def held(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def hold(self, pid: int) -> None:
        if self.platform != "darwin" or self.held:
            return
        try:
            self.process = self.spawn([*CAFFEINATE, "-w", str(pid)], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            log.info("serving: this Mac will not idle-sleep until the worker has been idle %.0f min",
                     AWAKE_AFTER_S / 60)
        except OSError as e:
            log.warning("could not keep this Mac awake (%s): it may sleep mid-generation; run `caffeinate -i` "
                        "beside the worker, or set System Settings › Energy › Prevent automatic sleeping", e)

    def release(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            self.process = None
            log.info("idle: this Mac may sleep again")


async def keep_awake(service: Serving, guard: SleepGuard, pid: int, check_s: float = 5.0,
                     awake_after_s: float = AWAKE_AFTER_S) -> None:
    """Forever: hold `guard` while the worker holds a stage and has served within `awake_after_s`."""
    try:
        while True:
            if service.holds_stage() and service.idle_for() < awake_after_s:
                guard.hold(pid)
            elif guard.held:
                guard.release()
            await asyncio.sleep(check_s)
    finally:
        guard.release()
