"""`deltafin bench --quality --expert-mode`: each expert mode against exact, on the same tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deltafin.cli.bench_modes import RoutingTap, frontier_rows, mode_quality, modes_asked
from deltafin.cli.commands import main
from deltafin.errors import DeltafinError
from deltafin.expert_modes import ExpertMode
from deltafin.paths import bundled_model
from deltafin.plan.memory.sizing_options import mode_presets
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput

ROOT = Path(__file__).resolve().parents[3]


def test_the_modes_asked() -> None:
    assert modes_asked("all") == list(mode_presets()[1:])
    assert modes_asked("TOP-P:0.70") == ["top-p:0.7"]
    with pytest.raises(DeltafinError, match="other than exact"):
        modes_asked("exact")
    with pytest.raises(DeltafinError, match="unknown mode"):
        modes_asked("fast")


def test_a_forwards_routing_goes_on_the_trace_token_by_token(tiny_dir) -> None:
    from deltafin.checkpoint.config import load_config

    tap = RoutingTap(load_config(tiny_dir), ExpertMode(), 4, "lfu")
    tap.calls = [(1, [[3, 5], [2]]), (3, [[7], [1, 4]])]  # two layers' choices for two rows
    tap.forward_done()
    assert tap.trace == [[(1, 3), (1, 5)], [(3, 7)], [(1, 2)], [(3, 1), (3, 4)]] and not tap.calls


def _sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 200, (n,), generator=g).tolist() for n in (30, 25)]


def test_a_mode_that_keeps_every_expert_costs_nothing_and_exact_is_the_plain_forward(tiny_dir) -> None:
    """top-p at 0.9999 keeps every routed expert (only their order changes): no KL to speak of, the same first token,
    the same reads. Exact's perplexity is the one a plain forward over the same tokens gives."""
    seqs = _sequences()
    got = mode_quality(tiny_dir, ["top-p:0.9999"], seqs, cache_share=0.1)["modes"]["top-p:0.9999"]
    assert got["tokens"] == sum(len(s) - 1 for s in seqs)
    assert got["kl"] < 1e-6 and got["top1_agreement"] == 1.0 and got["expert_bytes_ratio"] == 1.0
    pipe = LocalPipeline.load(tiny_dir, 1, device="cpu")
    nats = 0.0
    for i, seq in enumerate(seqs):
        ids = torch.tensor(seq)
        logits = pipe.forward([SeqInput(f"s{i}", 0, ids=ids)], all_logits=True)[0].logits.float()
        nats += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
    pipe.close()
    assert got["perplexity_exact"] == pytest.approx(math.exp(nats / got["tokens"]), rel=1e-4)


def test_fewer_experts_read_less_and_cost_more(tiny_dir) -> None:
    """top-p at 0.5 keeps fewer experts than exact's k on most tokens: fewer reads a token, a distribution further
    from exact's; a cache-aware mode runs token by token over as many positions (the --tokens given)."""
    seqs = _sequences()
    r = mode_quality(tiny_dir, ["top-p:0.5", "cached:1"], seqs, tokens=40, cache_share=0.25)
    low, held = r["modes"]["top-p:0.5"], r["modes"]["cached:1"]
    assert low["tokens"] == held["tokens"] == 40
    assert low["experts_per_token"] < r["exact"]["experts_per_token"] and low["expert_bytes_ratio"] < 0.9
    assert low["kl"] > 1e-4 and low["by_share"]["0.008"] < 1
    assert held["expert_bytes_ratio"] < 1  # what it finds held it reads no more: fewer reads than exact
    assert held["experts_per_token"] == r["exact"]["experts_per_token"]  # as many experts, other ones
    assert set(r["policy_hit_rates"]) == {"0.008", "0.04", "0.125", "0.25"}
    rows = frontier_rows(r)
    assert rows[0].startswith("| top-p:0.5 |") or rows[0].startswith("| cached:1 |")


def test_the_command_refuses_a_bad_mode_before_reading_text(capsys) -> None:
    for mode, says in (("top-p:3", "in (0, 1)"), ("cached", "needs a number")):
        assert main(["bench", "--model", str(bundled_model()), "--quality", "--expert-mode", mode]) == 1
        assert says in capsys.readouterr().err
    assert main(["bench", "--model", str(bundled_model()), "--quality", "--expert-mode", "all", "--cache-share",
                 "1.5"]) == 1
    assert "--cache-share must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_a_copy_is_read_at_its_bytes_and_a_tail_reads_some_of_it(tiny_dir) -> None:
    """q3 reads every expert's copy: through a cache of one expert (no hits to speak of, in either run) the bytes'
    ratio is the copy's over the stored expert's at this geometry; a tail reads the copy for some lookups only, and
    costs less quality than every expert's."""
    from deltafin.checkpoint.config import load_config
    from deltafin.plan.memory.sizing_options import low_bit_ratio

    cfg = load_config(tiny_dir)
    ratio = low_bit_ratio(cfg, "q3")
    assert 0.5 < ratio < 1
    one = 1 / (len(cfg.moe_layers) * cfg.num_experts)
    r = mode_quality(tiny_dir, ["q3", "q3-tail:0.3"], _sequences(), tokens=40, cache_share=one)
    every, tail = r["modes"]["q3"], r["modes"]["q3-tail:0.3"]
    assert r["cache_experts"] == 1
    assert every["copy_share"] == 1.0 and every["expert_bytes_ratio"] == pytest.approx(ratio, rel=0.01)
    assert every["experts_per_token"] == r["exact"]["experts_per_token"] and every["kl"] > 1e-5
    assert 0 < tail["copy_share"] < 1 and ratio < tail["expert_bytes_ratio"] < 1
    assert tail["kl"] < every["kl"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["top-p:0.55", "top-p:0.55+q3"])
def test_a_row_of_the_docs_table_measures_again(mode: str) -> None:
    """docs/expert-modes.md's rows of top-p:0.55 and of the mode that reaches both marks, measured again on the same
    4000 held-out positions (the figures are rounded to 3-4 places; another CPU's last bits may move the last one)."""
    from deltafin.cli.bench_quality import sequences_for

    model = bundled_model()
    r = mode_quality(model, [mode], sequences_for(model, None), tokens=4000)
    mine = [float(c) for c in frontier_rows(r)[0].split("|")[2:-1]]
    docs = next(line for line in (ROOT / "docs" / "expert-modes.md").read_text().splitlines()
                if line.startswith(f"| {mode} |"))
    theirs = [float(c) for c in docs.split("|")[2:6]]
    assert mine == pytest.approx(theirs, abs=2e-3)
