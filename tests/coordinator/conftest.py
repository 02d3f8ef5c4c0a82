"""The tiny checkpoint in this process, for the coordinator's tests that need no cluster: its stages and tokenizer
(one of each per test module), and an engine over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine.engine import Engine
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.tokenizer import K3Tokenizer


@pytest.fixture(scope="module")
def pipeline(tiny_dir: Path) -> LocalPipeline:
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> K3Tokenizer:
    return K3Tokenizer.load(tiny_dir)


@pytest.fixture
def local_engine(tiny_dir: Path):
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")
    engine = Engine(LocalBackend(pipe), K3Tokenizer.load(tiny_dir), load_config(tiny_dir), "tiny")
    yield engine
