"""The tiny checkpoint in this process, for the coordinator's tests that need no cluster: its stages and tokenizer
(one of each per test module); the engine over them is tests/conftest.py's `local_engine`."""

from __future__ import annotations

from pathlib import Path

import pytest

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
