"""A model found by what the user calls it: a directory, the bundled k3-mini, a name under the cache's models/."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deltafin import paths


def test_a_model_is_a_directory_the_bundled_one_or_a_name_in_the_cache(tiny_dir: Path, tmp_path: Path,
                                                                       monkeypatch) -> None:
    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path / "cache"))
    assert paths.resolve_model(tiny_dir) == tiny_dir
    assert paths.resolve_model("k3-mini") == paths.bundled_model()
    shutil.copytree(tiny_dir, paths.models_dir() / "tiny-copy")
    assert paths.resolve_model("tiny-copy") == paths.models_dir() / "tiny-copy"
    with pytest.raises(FileNotFoundError) as e:
        paths.resolve_model("nosuch")
    assert "no model 'nosuch'" in str(e.value) and "known: k3-mini, tiny-copy" in str(e.value)
    assert "deltafin models" in str(e.value)
