"""How much memory this process may use, found rather than assumed: the budget a stage is sized against
when the user gives no `--memory-gb`.

- CPU: physical RAM, lowered to what is available now and to the cgroup limit where one is set (a container,
  `systemd-run -p MemoryMax`, `memlimit`): cgroup v1 and v2, every level of the hierarchy.
- CUDA: the GPU's free memory now; host RAM as for the CPU, for staging buffers.
- MPS (Apple silicon): Metal's recommended working set for this GPU (what macOS lets the GPU use without
  paging), never more than physical RAM.
A safety margin is kept off each (fragmentation, the OS, other processes): see `MARGIN`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

GB = 1e9
MARGIN = {"host": 0.10, "discrete": 0.05}  # fraction kept free of what was found
UNLIMITED = 1 << 60  # cgroup files say "max" or a huge number when there is no limit
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryFound:
    """What this process may use: `device` bytes (RAM on a CPU or a Mac), `host` RAM beside a discrete GPU,
    and where each number came from (for logs and errors)."""

    device: int
    host: int | None
    source: str

    @property
    def budget(self) -> tuple[int, int | None]:
        """The numbers a stage is sized against: what was found, less the margin."""
        if self.host is None:
            return int(self.device * (1 - MARGIN["host"])), None
        return int(self.device * (1 - MARGIN["discrete"])), int(self.host * (1 - MARGIN["host"]))


def find_memory(device_type: str, index: int | None = None) -> MemoryFound:
    """The memory a stage on `device_type` may use (see the module docstring)."""
    host, host_source = host_memory()
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info(index if index is not None else torch.cuda.current_device())
        return MemoryFound(free, host, f"CUDA free memory {free / GB:.1f} of {total / GB:.1f} GB; host {host_source}")
    if device_type == "mps":
        recommended = mps_working_set()
        if recommended:
            return MemoryFound(min(recommended, host), None, f"Metal recommended working set "
                               f"{recommended / GB:.1f} GB (host {host_source})")
    return MemoryFound(host, None, host_source)


def host_memory() -> tuple[int, str]:
    """RAM this process may use: min(physical, available now, cgroup limit) with the reason."""
    physical = _physical_ram()
    found = [(physical, f"physical RAM {physical / GB:.1f} GB")]
    available = _meminfo("MemAvailable")
    if available is not None and available < physical:
        found.append((available + _own_rss(), f"available RAM {available / GB:.1f} GB"))
    limit = cgroup_limit()
    if limit is not None:
        found.append((limit, f"cgroup memory limit {limit / GB:.1f} GB"))
    return min(found)


def cgroup_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """The tightest memory limit over this process's cgroup and its ancestors (v1 or v2), or None."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 unified hierarchy
            limits += _walk(root, path.lstrip("/"), "memory.max")
        elif "memory" in controllers.split(","):  # v1 memory controller
            limits += _walk(root / "memory", path.lstrip("/"), "memory.limit_in_bytes")
    limits = [v for v in limits if v < UNLIMITED]
    return min(limits) if limits else None


def _walk(base: Path, rel: str, name: str) -> list[int]:
    """Limits found in `name` at base/rel and every parent up to base."""
    out = []
    here = base / rel if rel else base
    while True:
        value = _read_limit(here / name)
        if value is not None:
            out.append(value)
        if here == base or base not in here.parents:
            return out
        here = here.parent


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _physical_ram() -> int:
    if sys.platform == "darwin":
        try:
            return int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True,
                                      check=True).stdout.strip())
        except (OSError, ValueError, subprocess.CalledProcessError):
            pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _own_rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def mps_working_set() -> int | None:
    """Metal's recommendedMaxWorkingSetSize for the GPU, through torch (None where it cannot say)."""
    try:
        return int(torch.mps.recommended_max_memory())
    except (AttributeError, RuntimeError):
        return None


def peak_rss(status: Path = Path("/proc/self/status")) -> int:
    """This process's peak resident memory in bytes, since it started: Linux's VmHWM in `status` (getrusage's
    ru_maxrss also counts what the parent held when it forked, a test runner's gigabytes say), elsewhere
    ru_maxrss (bytes on macOS, KiB on Linux)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # POSIX only: loaded where /proc is not

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

