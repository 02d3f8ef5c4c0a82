"""One helper for user-facing progress of long operations (writing, loading, downloading nothing).

On a terminal it redraws one status line; otherwise (CI, pipes, logs) it logs a line every few seconds,
so long jobs never look hung and logs stay readable.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("deltafin.progress")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def silenced() -> bool:
    """Whether progress is off everywhere: -q sets this module's logger above INFO (`setup_logging`), which stops the
    terminal's status line too, not only the log lines."""
    return log.level > logging.INFO


class Progress:
    """Progress of `total` units (bytes when `unit="B"`; `unit=""`: a fraction of 1, shown as a percentage alone);
    use as a context manager."""

    def __init__(self, total: float, desc: str, unit: str = "B", stream: TextIO | None = None,
                 enabled: bool = True, interval: float = 5.0):
        self.total, self.desc, self.unit = max(total, 1), desc, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled and not silenced()
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 0.2 if self.tty else interval
        self.done = 0.0
        self.start = self._last = time.monotonic()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _amount(self, n: float) -> str:
        return fmt_bytes(n) if self.unit == "B" else f"{n:.0f} {self.unit}"

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100.0 * min(self.done, self.total) / self.total
        eta_s = f"{eta:.0f}s" if eta != float("inf") else "?"
        if not self.unit:  # a fraction: no amounts, no rate of "units"
            return f"{self.desc}: {pct:5.1f}% eta {eta_s}"
        speed = f"{fmt_bytes(rate)}/s" if self.unit == "B" else f"{rate:.1f} {self.unit}/s"
        return (f"{self.desc}: {pct:5.1f}% {self._amount(self.done)} / {self._amount(self.total)} "
                f"{speed} eta {eta_s}")

    def update(self, n: float) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._emit()

    def _emit(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line().ljust(78))
            self.stream.flush()
        else:
            log.info(self.line())

    def close(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line().ljust(78) + "\n")
            self.stream.flush()
        elif time.monotonic() - self.start >= self.interval:
            log.info(self.line())
