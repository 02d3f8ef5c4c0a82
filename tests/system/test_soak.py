"""Resource hygiene: a soak of short requests (some cancelled mid-stream, some invalid) through the API and a
real worker leaves no session behind and the worker's memory flat (numbers printed; -s to read them)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.system.soak import run_soak


def test_soak_leaves_memory_flat(tiny_dir: Path) -> None:
    result = run_soak(tiny_dir, requests=250, concurrency=4)
    print("\n" + json.dumps(result))
    assert result["processes_alive"] and result["sessions_left"] == 0
    o = result["outcomes"]
    assert o == {"ok:200": 100, "chat_stream:200": 50, "cancelled": 50, "invalid:400": 25, "too_long:400": 25}
    # allocator noise is a few MB; a leak of one session per request would be far above this
    assert result["rss_growth_mb"]["worker"] < 20
    assert result["rss_growth_mb"]["coordinator"] < 30
