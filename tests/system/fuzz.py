"""The long fuzz run: hostile requests to a real `deltafin-coordinator --local serve` (every HTTP route) and/or a
real `deltafin-worker` (every RPC) for N minutes each, in batches of the same strategies the tests use
(tests/support/fuzz.py). Stops at the first 5xx, INTERNAL/UNKNOWN, stall or lost worker (the failing request is
printed); prints one JSON object: per surface, the minutes, the requests and their counts by route (or RPC) and
status.

    python -m tests.system.fuzz --model DIR --minutes 15 [--surface http|grpc|both]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import fingerprint
from deltafin.mini.synth import synthesize
from tests.support.cluster import ServerProcess, WorkerProcess
from tests.support.fuzz import fuzz_grpc, fuzz_http, valid_forward

BATCH = 200  # examples a hypothesis run; runs repeat until the minutes are up


def soak_http(model: Path, minutes: float) -> dict:
    server = ServerProcess(model, "--local", serve_args=("--served-model-name", "tiny", "--default-max-tokens", "8",
                                                         "--max-context", "512"))
    counts: Counter = Counter()
    try:
        deadline = time.monotonic() + 60 * minutes
        while time.monotonic() < deadline:
            fuzz_http(server.url, BATCH, counts)
    finally:
        assert server.stop() == 0, "the server did not stop cleanly"
    return _summary(minutes, counts)


def soak_grpc(model: Path, minutes: float) -> dict:
    cfg = load_config(model)
    shape = {"fingerprint": fingerprint(model), "layers": cfg.num_layers, "hidden": cfg.hidden_size,
             "blocks": cfg.blocks_entering(0), "vocab": cfg.vocab_size}
    worker = WorkerProcess(model, "fuzz", "--max-message-mb", "4")
    counts: Counter = Counter()
    try:
        worker.wait_ready()
        valid = valid_forward(worker.address, shape["fingerprint"], cfg.num_layers)
        deadline = time.monotonic() + 60 * minutes
        while time.monotonic() < deadline:
            fuzz_grpc(worker.address, BATCH, shape, valid, counts)
            assert worker.proc.poll() is None, "the worker died"
    finally:
        worker.stop()
    return _summary(minutes, counts)


def _summary(minutes: float, counts: Counter) -> dict:
    by_route: dict[str, dict[str, int]] = {}
    for (route, status), n in sorted(counts.items()):
        by_route.setdefault(route, {})[str(status)] = n
    return {"minutes": minutes, "requests": sum(counts.values()), "by_route_and_status": by_route}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: a synthetic `tiny` made for the run")
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--surface", choices=["http", "grpc", "both"], default="both")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="deltafin-fuzz-") as folder:
        model = args.model or synthesize("tiny", Path(folder) / "tiny", seed=0, show_progress=False)
        out = {}
        if args.surface in ("http", "both"):
            out["http"] = soak_http(model, args.minutes)
        if args.surface in ("grpc", "both"):
            out["grpc"] = soak_grpc(model, args.minutes)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
