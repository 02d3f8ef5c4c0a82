"""`deltafin models`: the bundled model and those under the cache's models/, with what each holds; `--model NAME`
finds them on every command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from deltafin.cli.commands import main


def test_models_lists_what_each_holds_and_names_find_them(tiny_dir: Path, tmp_path: Path, monkeypatch,
                                                          capsys) -> None:
    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    shutil.copytree(tiny_dir, models / "tiny")
    shutil.copytree(tiny_dir, models / "cut")
    shard = models / "cut" / "model-00003-of-00007.safetensors"
    shard.write_bytes(shard.read_bytes()[:100_000])
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["k3-mini", "cut", "tiny"]
    assert (rows["k3-mini"]["layers"], rows["k3-mini"]["of_layers"], rows["k3-mini"]["top"]) == (8, 8, True)
    assert (rows["tiny"]["layers"], rows["tiny"]["held"], rows["tiny"]["problems"]) == (6, "0-5", 0)
    assert (rows["cut"]["held"], rows["cut"]["problems"]) == ("0-1, 3-5", 1)
    assert rows["tiny"]["disk_bytes"] > 1_000_000
    assert main(["models"]) == 0
    assert "1 damaged file(s): deltafin inspect --model cut" in capsys.readouterr().out
    assert main(["tokenize", "--model", "tiny", "hello"]) == 0  # a name, on any command
    assert json.loads(capsys.readouterr().out)


def test_a_downloaded_copy_named_as_the_bundled_model_is_listed_once_by_what_finds_it(
        tiny_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """`deltafin download` of a model named k3-mini puts it in models/k3-mini; `--model k3-mini` is still the
    bundled model, so only that row is named k3-mini, and the copy is listed (and announced) by the path that
    finds it."""
    from deltafin.paths import bundled_model, models_dir, resolve_model

    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny_dir, tmp_path / "k3-mini")
    assert main(["download", str(tmp_path / "k3-mini"), "-q"]) == 0
    copy = models_dir() / "k3-mini"
    assert capsys.readouterr().out.splitlines()[-1] == f"(--model {copy} finds it)"
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["path"]) for r in rows] == [("k3-mini", str(bundled_model())), (str(copy), str(copy))]
    assert [resolve_model(r["name"]) for r in rows] == [bundled_model(), copy]  # each name finds its own row
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:3]
    assert lines[0].startswith("k3-mini ") and lines[0].endswith(str(bundled_model()))
    assert lines[1].startswith("(by its path) ") and lines[1].endswith(
        f"{copy} (named k3-mini too: --model k3-mini is the bundled one, this one's path finds it)")
