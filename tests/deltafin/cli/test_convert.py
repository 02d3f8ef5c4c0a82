"""`deltafin convert` on a model a format cannot hold (synth preset odd: no row of whole 64-value groups): by default
the next format the model can use, saying why; asked for by name, refused with why and what to use; and `inspect`
says which formats the model leaves out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltafin.cli.commands import main
from deltafin.mini.synth import synthesize


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize("odd", tmp_path_factory.mktemp("odd"), show_progress=False)


def test_the_default_converts_the_fewest_bytes_the_model_can_use(odd, tmp_path, capsys, caplog):
    assert main(["convert", "--model", str(odd), "--out", str(tmp_path / "copy"), "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["spine"] == "int8" and summary["converted"] == summary["units"] > 0
    assert "q4 can hold none of this model's spine matrices" in caplog.text and "converting int8 instead" in caplog.text


def test_a_format_the_model_cannot_use_is_refused_with_the_one_to_use(odd, tmp_path, capsys):
    assert main(["convert", "--model", str(odd), "--spine", "q4", "--out", str(tmp_path / "copy"), "-q"]) == 1
    err = capsys.readouterr().err
    assert "q4 can hold none of this model's spine matrices" in err and "--spine int8" in err
    assert not (tmp_path / "copy").exists()  # nothing written


def test_a_model_q4_holds_converts_q4_by_default(small_dir, tmp_path, capsys):
    assert main(["convert", "--model", str(small_dir), "--out", str(tmp_path / "copy"), "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["spine"] == "q4"


def test_inspect_names_the_formats_left_out(odd, capsys):
    assert main(["inspect", "--model", str(odd)]) == 0
    out = capsys.readouterr().out
    assert "spine format q4 left out: q4 can hold none" in out
    assert main(["inspect", "--model", str(odd), "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["unusable_spines"]) == ["q4"]
