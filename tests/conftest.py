"""Shared fixtures: synthetic checkpoints are built once per test session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltafin.synth import synthesize

# The real Kimi K3 config.json, verbatim (copied from ../shared/fixtures/kimi-k3/).
K3_FIXTURE = Path(__file__).parent / "data" / "kimi-k3-config.json"


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
