"""An engine over the tiny checkpoint in this process, for the coordinator's tests that need no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltafin.config import load_config
from deltafin.coordinator.backend import LocalBackend
from deltafin.coordinator.engine import Engine
from deltafin.pipeline import LocalPipeline
from deltafin.tokenizer import K3Tokenizer


@pytest.fixture
def local_engine(tiny_dir: Path):
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")
    engine = Engine(LocalBackend(pipe), K3Tokenizer.load(tiny_dir), load_config(tiny_dir), "tiny")
    yield engine
