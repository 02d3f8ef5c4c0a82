"""The long fuzz run: hostile requests to a real `deltafin-coordinator --local serve` (every HTTP route) and/or a
real `deltafin-worker` (every RPC) for N minutes each, in batches of the same strategies the tests use
(tests/support/fuzz.py). A surface stops at its first 5xx, INTERNAL/UNKNOWN, stall or lost worker; prints one JSON
object: per surface, the minutes run, the requests and their counts by route (or RPC) and status, and the failure
(the request that found it) if there was one, in which case it exits 1. Progress goes to stderr.

    python -m tests.system.fuzz --model DIR --minutes 15 [--surface http|grpc|both]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import fingerprint
from deltafin.mini.synth import synthesize
from tests.support.cluster import ServerProcess, WorkerProcess
from tests.support.fuzz import fuzz_grpc, fuzz_http, valid_forward

BATCH = 200  # examples a hypothesis run; runs repeat until the minutes are up

log = logging.getLogger("fuzz")


def soak_http(model: Path, minutes: float) -> dict:
    server = ServerProcess(model, "--local", serve_args=("--served-model-name", "tiny", "--default-max-tokens", "8",
                                                         "--max-context", "512"))
    try:
        return _soak("http", minutes, lambda counts: fuzz_http(server.url, BATCH, counts))
    finally:
        assert server.stop() == 0, "the server did not stop cleanly"


def soak_grpc(model: Path, minutes: float) -> dict:
    cfg = load_config(model)
    shape = {"fingerprint": fingerprint(model), "layers": cfg.num_layers, "hidden": cfg.hidden_size,
             "blocks": cfg.blocks_entering(0), "vocab": cfg.vocab_size}
    worker = WorkerProcess(model, "fuzz", "--max-message-mb", "4")
    try:
        worker.wait_ready()
        valid = valid_forward(worker.address, shape["fingerprint"], cfg.num_layers)

        def batch(counts: Counter) -> None:
            fuzz_grpc(worker.address, BATCH, shape, valid, counts)
            assert worker.proc.poll() is None, "the worker died"

        return _soak("grpc", minutes, batch)
    finally:
        worker.stop()


def _soak(surface: str, minutes: float, batch: Callable[[Counter], None]) -> dict:
    """Batches until the minutes are up or one fails; the counts either way."""
    counts: Counter = Counter()
    t0 = time.monotonic()
    failure = None
    while failure is None and time.monotonic() < t0 + 60 * minutes:
        try:
            batch(counts)
        except Exception as e:  # an assertion naming the request, or hypothesis' group of them
            log.exception("%s: failed", surface)
            failure = f"{type(e).__name__}: {e}"
        log.info("%s: %.1f min, %d requests%s", surface, (time.monotonic() - t0) / 60, sum(counts.values()),
                 f"; FAILED: {failure}" if failure else "")
    return _summary((time.monotonic() - t0) / 60, counts, failure)


def _summary(minutes: float, counts: Counter, failure: str | None) -> dict:
    by_route: dict[str, dict[str, int]] = {}
    for (route, status), n in sorted(counts.items()):
        by_route.setdefault(route, {})[str(status)] = n
    out = {"minutes": round(minutes, 2), "requests": sum(counts.values()), "by_route_and_status": by_route}
    return out if failure is None else {**out, "failure": failure}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: a synthetic `tiny` made for the run")
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--surface", choices=["http", "grpc", "both"], default="both")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="deltafin-fuzz-") as folder:
        model = args.model or synthesize("tiny", Path(folder) / "tiny", seed=0, show_progress=False)
        out = {}
        if args.surface in ("http", "both"):
            out["http"] = soak_http(model, args.minutes)
        if args.surface in ("grpc", "both"):
            out["grpc"] = soak_grpc(model, args.minutes)
    print(json.dumps(out, indent=1))
    if any("failure" in v for v in out.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
