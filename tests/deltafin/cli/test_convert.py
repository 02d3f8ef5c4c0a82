"""`deltafin convert` on a model a format cannot hold (synth preset odd: no row of whole 64-value groups): by default
the next format the model can use, saying why; asked for by name, refused with why and what to use; and `inspect`
says which formats the model leaves out. And `--experts q3`: the routed experts' copy of a worker's share."""

from __future__ import annotations

import contextlib
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


def test_the_experts_copy_of_a_workers_share_and_what_is_refused(odd, tmp_path, capsys, monkeypatch):
    """`convert --experts q3` on odd sizes (rows of 32 and 96 values: groups of 32): the layers and the share asked
    for, counted in the summary and named by the copy's manifest; a spine's options beside it are refused."""
    from deltafin.checkpoint.config import load_config
    from deltafin.weights import expert_copy

    monkeypatch.setattr(expert_copy, "default_root", lambda model_dir, fmt: tmp_path / fmt)
    cfg = load_config(odd)
    moe = [i for i in range(1, 3) if cfg.is_moe(i)]
    assert main(["convert", "--model", str(odd), "--experts", "q3", "--layers", "1-2", "--share", "1/3", "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    third = range(cfg.num_experts // 3, 2 * cfg.num_experts // 3)
    assert summary["experts"] == "q3" and summary["moe_layers"] == len(moe) > 0
    assert summary["bytes"] == len(moe) * len(third) * expert_copy.align_up(
        expert_copy.expert_bytes(cfg, expert_copy.low_bit_format("q3")))
    manifest = json.loads((tmp_path / "q3" / "manifest.json").read_text())
    assert manifest["layers"] == {str(i): [[third.start, third.stop]] for i in moe}
    for args, says in ((["--experts", "q3", "--spine", "int8"], "leave out --spine"),
                       (["--share", "1/3"], "--layers and --share choose"),
                       (["--experts", "q9"], "invalid choice")):
        with pytest.raises(SystemExit) if says == "invalid choice" else contextlib.nullcontext():
            assert main(["convert", "--model", str(odd), *args, "-q"]) == 1
        assert says in capsys.readouterr().err
