"""`deltafin-worker`'s start: errors as one clear line; SIGINT stops an idle worker."""

from __future__ import annotations

import signal
import subprocess

from tests.support.cluster import WORKER, workers


def test_worker_start_errors_are_clear(tmp_path):
    r = subprocess.run([*WORKER, "--model", str(tmp_path), "--no-announce"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no config.json" in r.stderr and "Traceback" not in r.stderr


def test_sigint_stops_an_idle_worker(tiny_dir):
    with workers(tiny_dir, 1) as procs:
        assert procs[0].stop(signal.SIGINT) == 0
