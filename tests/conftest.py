"""Shared fixtures: synthetic checkpoints are built once per test session. And the `slow` mark: a test is
slow when it starts processes (workers, servers, a command line), itself or through a fixture; CI runs the
others first (`-m "not slow"`), then these (`-m slow`)."""

from __future__ import annotations

import atexit
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine.engine import Engine
from deltafin.mini.synth import synthesize
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.tokenizer import K3Tokenizer


def _isolated_cache() -> None:
    """The tests' processes keep their derived files in a cache directory of this test session's, so that
    nothing a test keeps (prefixes on disk) is seen by another run; the built kernels, derived tokenizers and
    fetched references are shared with the user's cache (links), as they only depend on their inputs."""
    from deltafin import paths

    shared = paths.cache_dir()
    session = Path(tempfile.mkdtemp(prefix="deltafin-test-cache-"))
    for part in ("kernels", "reference", "tokenizers"):
        (shared / part).mkdir(parents=True, exist_ok=True)
        (session / part).symlink_to(shared / part)
    os.environ["DELTAFIN_CACHE"] = str(session)
    atexit.register(shutil.rmtree, session, ignore_errors=True)  # the links go, not what they point at


_isolated_cache()

# The real Kimi K3 config.json, verbatim (copied from ../shared/fixtures/kimi-k3/).
K3_FIXTURE = Path(__file__).parent / "data" / "kimi-k3-config.json"

_STARTS_PROCESSES = ("workers(", "WorkerProcess(", "ServerProcess(", "subprocess.", "run_soak(")
_PROCESS_FIXTURES = {"worker", "api_url"}


def _starts_processes(function: object) -> bool:
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    return any(marker in source for marker in _STARTS_PROCESSES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if _starts_processes(function) or _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize("tiny", tmp_path_factory.mktemp("tiny"), seed=0, show_progress=False)


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize("small", tmp_path_factory.mktemp("small"), seed=0, show_progress=False)


@pytest.fixture(scope="session")
def k3_cut(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """K3's full geometry cut to 4 layers (dense KDA, two KDA+MoE, MLA+MoE), sparse: 58 GB apparent, 2.4 GB
    written (the embedding and routers carry values)."""
    return synthesize("k3", tmp_path_factory.mktemp("k3"), layers=4, sparse=True, show_progress=False)


@pytest.fixture(scope="session")
def k3_config_raw() -> dict:
    return json.loads(K3_FIXTURE.read_text())


@pytest.fixture
def local_engine(tiny_dir: Path):
    """An engine over the tiny checkpoint in this process (the coordinator's and its commands' tests)."""
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")
    engine = Engine(LocalBackend(pipe), K3Tokenizer.load(tiny_dir), load_config(tiny_dir), "tiny")
    yield engine
