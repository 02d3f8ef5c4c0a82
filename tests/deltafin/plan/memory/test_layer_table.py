"""Which spine formats a model can use (plan/memory/layer_table.py): a converted format whose groups divide none of the
model's matrices is left out of `--spine auto`, with why; a model whose sizes fit keeps every format."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.errors import SizingError
from deltafin.formats import auto_spines
from deltafin.mini.synth import synthesize
from deltafin.paths import bundled_model
from deltafin.plan.memory.layer_table import model_spines, unfit_spines
from deltafin.plan.memory.sizing import Placement, SizingInput, choose
from deltafin.plan.memory.stage_plan import Budget

GB = 10**9


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize("odd", tmp_path_factory.mktemp("odd"), show_progress=False)


def test_q4_is_left_out_where_its_groups_divide_no_matrix(odd):
    cfg = load_config(odd)
    shapes = {s.shape for i in range(cfg.num_layers) for s in cfg.layer_tensor_specs(i) if len(s.shape) == 2}
    assert all(cols % 64 for _, cols in shapes)  # the preset's promise: no row of whole 64-value groups
    unfit = unfit_spines(cfg)
    assert list(unfit) == ["q4"] and "int8 throughout" in unfit["q4"] and "hidden size 96" in unfit["q4"]
    assert model_spines(cfg) == tuple(f for f in auto_spines() if f != "q4")


@pytest.mark.parametrize("config", ["k3", "mini"])
def test_a_model_whose_sizes_fit_keeps_every_format(config):
    cfg = load_config(bundled_model()) if config == "mini" else parse_config(preset_config("k3", 4))
    assert unfit_spines(cfg) == {} and model_spines(cfg) == auto_spines()


def test_auto_never_plans_a_format_the_model_cannot_use(odd, monkeypatch):
    """From the least memory that holds the spine as stored down to none that fits: int8 whole, then int8 with its
    tail streamed, never q4 (which a model q4 could hold would take, and which here would be int8 under its name)."""
    from deltafin.plan.memory import sizing

    cfg = load_config(odd)
    opts = SizingInput(sequences=1, context=64, prefill_chunk=16, expert_cache_bytes=0)

    def planned(budget: int) -> tuple[str, int] | None:
        try:
            s = choose(cfg, 0, cfg.num_layers, Placement("cpu"), Budget(budget), opts)
        except SizingError:
            return None
        return s.spine, len(s.streamed_layers)

    lo, hi = 0, 8 * GB  # the least memory that holds the spine as stored, to 1 KB
    while hi - lo > 1000:
        lo, hi = (lo, (lo + hi) // 2) if (planned((lo + hi) // 2) or ("",))[0] == "bf16" else ((lo + hi) // 2, hi)
    sweep = {planned(hi - d) for d in range(0, 1_000_000, 20_000)}
    assert ("int8", 0) in sweep and any(p and p[0] == "int8" and p[1] > 0 for p in sweep) and None in sweep
    assert not any(p and p[0] == "q4" for p in sweep)
    monkeypatch.setattr(sizing, "model_spines", lambda cfg, for_room_too=True: auto_spines(for_room_too))
    assert any(p and p[0] == "q4" for p in {planned(hi - d) for d in range(0, 1_000_000, 20_000)})  # without it
