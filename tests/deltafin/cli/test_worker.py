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


def test_a_second_worker_on_a_port_in_use_refuses_to_start(tiny_dir):
    """gRPC would let two servers share a port (SO_REUSEPORT) and the OS spread connections over them: the second
    worker refuses instead, with the message `serve` gives for a port in use."""
    with workers(tiny_dir, 1) as (first,):
        port = first.address.rsplit(":", 1)[1]
        r = subprocess.run([*WORKER, "--model", str(tiny_dir), "--port", port, "--no-announce", "--memory-gb", "2"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"127.0.0.1:{port} is already in use by another process" in r.stderr
        assert first.proc.poll() is None  # the first one still serves


def test_a_damaged_shard_is_said_once_and_the_coordinator_names_it(tiny_dir, tmp_path):
    """A copy of the model with one shard cut short: the worker says so once, for that file, with the fix, and
    serves the other layers; the coordinator's plan names the file and the worker instead of "no worker holds
    layers 2"."""
    import shutil

    from tests.support.cluster import COORDINATOR, WorkerProcess

    model = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model)
    shard = model / "model-00003-of-00007.safetensors"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    worker = WorkerProcess(model, "damaged")
    try:
        worker.wait_ready()
        plan = subprocess.run([*COORDINATOR, "--model", str(model), "--worker", worker.address, "--no-discover",
                               "plan"], capture_output=True, text=True, timeout=120)
    finally:
        worker.stop()
    log = worker.log()
    assert log.count("model-00003-of-00007.safetensors is truncated") == 1, log
    assert "copy or download it again" in log and "this worker serves layers 0-1, 3-5, not 2" in log
    assert plan.returncode == 1 and "Traceback" not in plan.stderr
    assert "no worker holds layers 2: damaged" in plan.stderr
    assert "model-00003-of-00007.safetensors is damaged (layers 2): copy or download it again" in plan.stderr


def test_a_budget_no_stage_fits_is_refused_before_it_listens(tiny_dir):
    """0.3 GB is below the runtime's own overhead (1 GiB): the worker refuses it at start, in one line with the
    least any stage needs and that more workers do not help, and never listens (only the coordinator did, advising
    more workers); a budget of 0 is refused as a flag's value."""
    r = subprocess.run([*WORKER, "--model", str(tiny_dir), "--no-announce", "--memory-gb", "0.3", "-q"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "listening" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: this worker's memory budget, 0.30 GB (--memory-gb), is below the least any stage "
                           "of this model needs on cpu: 1."), line
    assert "more workers do not help" in line
    zero = subprocess.run([*WORKER, "--model", str(tiny_dir), "--no-announce", "--memory-gb", "0", "-q"],
                          capture_output=True, text=True, timeout=120)
    assert zero.returncode == 1 and zero.stderr.strip() == "error: --memory-gb must be more than 0"
