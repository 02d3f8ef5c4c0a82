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


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    """Progress of `total` units (bytes when `unit="B"`); use as a context manager."""

    def __init__(self, total: float, desc: str, unit: str = "B", stream: TextIO | None = None,
                 enabled: bool = True, interval: float = 5.0):
        self.total, self.desc, self.unit = max(total, 1), desc, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 0.2 if self.tty else interval
        self.done = 0.0
        self.start = self._last = time.monotonic()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _amount(self, n: float) -> str:
        return _fmt_bytes(n) if self.unit == "B" else f"{n:.0f} {self.unit}"

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100.0 * self.done / self.total
        speed = f"{_fmt_bytes(rate)}/s" if self.unit == "B" else f"{rate:.1f} {self.unit}/s"
        eta_s = f"{eta:.0f}s" if eta != float("inf") else "?"
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


class Reporter:
    """A `progress(done, total)` callback for counts that advance in steps (prompt tokens, chunk by
    chunk): the first call opens a Progress line for what is left (what was already done at the start, say
    tokens resumed from a cache, does not count towards the rate) and says so once; the last closes it."""

    def __init__(self, desc: str, unit: str, stream: TextIO | None = None, enabled: bool = True):
        self.desc, self.unit, self.stream, self.enabled = desc, unit, stream, enabled
        self.bar: Progress | None = None
        self.base = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if done >= total:
                return
            self.base = done
            already = f" ({done} already in the cache)" if done else ""
            log.info("%s: %d %s to go%s", self.desc, total - done, self.unit, already)
            self.bar = Progress(total - done, self.desc, unit=self.unit, stream=self.stream, enabled=self.enabled)
        self.bar.update(done - self.base - self.bar.done)
        if done >= total:
            self.bar.close()
            self.bar = None
