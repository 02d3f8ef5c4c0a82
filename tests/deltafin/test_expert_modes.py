"""The expert modes' grammar and the share of exact's reads each is planned at."""

from __future__ import annotations

import pytest

from deltafin.errors import DeltafinError
from deltafin.expert_modes import (
    EXACT,
    PRESETS,
    TOP_P_READS,
    ExpertMode,
    least_kept,
    low_bit_presets,
    parse,
    read_share,
)


@pytest.mark.parametrize("text, mode", [("exact", ExpertMode()), ("TOP-P:0.80", ExpertMode(0.8)),
                                        ("cached:0.05", ExpertMode(None, 0.05)),
                                        ("cached:0.05+top-p:0.7", ExpertMode(0.7, 0.05)),
                                        ("q3", ExpertMode(low_bit="q3")),
                                        ("q3-tail:0.50+top-p:0.7", ExpertMode(0.7, low_bit="q3", low_tail=0.5)),
                                        ("cached:0.1+q3", ExpertMode(None, 0.1, "q3"))])
def test_a_mode_reads_back_in_its_one_spelling(text: str, mode: ExpertMode) -> None:
    assert parse(text) == mode
    assert parse(mode.name) == mode
    assert mode.exact == (mode == ExpertMode())
    assert mode.reproducible == (mode.held_margin is None and mode.low_tail is None)


def test_every_preset_is_in_its_one_spelling() -> None:
    from deltafin.plan.memory.sizing_options import mode_presets

    assert PRESETS[0] == EXACT and mode_presets()[:len(PRESETS)] == PRESETS
    assert [parse(p).name for p in mode_presets()] == list(mode_presets())
    assert "top-p:0.55+q3" in mode_presets() and parse(low_bit_presets("q9")[0]).low_bit == "q9"


@pytest.mark.parametrize("text, says", [("top-k:3", "unknown mode"), ("top-p", "needs a number"),
                                        ("top-p:1", "in (0, 1)"), ("top-p:0", "in (0, 1)"),
                                        ("cached:2", "in (0, 1]"), ("top-p:0.5+top-p:0.6", "one P"),
                                        ("exact:1", "unknown mode"), ("q3+q3-tail:0.5", "one low-bit part"),
                                        ("q3-tail:1", "in (0, 1)"), ("q3-tail:x", "in (0, 1)"),
                                        ("q-3", "unknown mode"), ("cached", "needs a number")])
def test_a_bad_mode_is_refused_naming_the_flag(text: str, says: str) -> None:
    with pytest.raises(DeltafinError, match="--expert-mode") as e:
        parse(text)
    assert says in str(e.value)


def test_least_kept_is_a_quarter_of_k_rounded_up() -> None:
    assert [least_kept(k) for k in (1, 4, 5, 16)] == [1, 1, 2, 4]


def test_read_share_follows_the_measured_points() -> None:
    assert read_share(ExpertMode()) == 1.0
    assert read_share(ExpertMode(None, 0.05)) == 1.0  # cache-aware routing is planned as exact
    for p, share in TOP_P_READS:
        assert read_share(ExpertMode(p)) == pytest.approx(share)
    (p0, s0), (p1, s1) = TOP_P_READS[:2]
    assert read_share(ExpertMode((p0 + p1) / 2)) == pytest.approx((s0 + s1) / 2)
    assert read_share(ExpertMode(0.95)) == pytest.approx((TOP_P_READS[-1][1] + 1) / 2)
    assert read_share(ExpertMode(0.25)) == pytest.approx(TOP_P_READS[0][1] / 2)
    shares = [read_share(ExpertMode(p / 100)) for p in range(1, 100)]
    assert shares == sorted(shares)  # a larger P never reads less


def test_a_low_bit_copy_is_planned_at_its_bytes_for_the_experts_it_serves() -> None:
    """Every expert's copy: the kept share times the copy's bytes ratio; a tail's: the reads top-p at its P would
    drop, at the ratio, the rest as stored (all planned as misses)."""
    r = 0.75
    assert read_share(parse("q3"), r) == pytest.approx(r)
    assert read_share(parse("top-p:0.6+q3"), r) == pytest.approx(read_share(parse("top-p:0.6")) * r)
    kept, heavy = read_share(parse("top-p:0.9")), read_share(parse("top-p:0.5"))
    assert read_share(parse("top-p:0.9+q3-tail:0.5"), r) == pytest.approx(heavy + (kept - heavy) * r)
    assert read_share(parse("top-p:0.5+q3-tail:0.9"), r) == pytest.approx(heavy)  # nothing light is kept
    assert read_share(parse("q3"), 1.0) == 1.0


def test_plan_says_the_mode_is_lossy_and_what_it_reads() -> None:
    from deltafin.expert_modes import describe

    assert "exact" in describe(ExpertMode()) and "lossy" not in describe(ExpertMode())
    line = describe(parse("top-p:0.55"))
    assert "lossy" in line and f"{read_share(parse('top-p:0.55')):.3f} of exact's" in line
    assert "not reproducible" in describe(parse("cached:0.05")) and "1.000" in describe(parse("cached:0.05"))
    assert "not reproducible" in describe(parse("q3-tail:0.5")) and "0.500" in describe(parse("q3"), 0.5)
