"""`bench --workload`: answers with and without drafts agree, the counters add up, the replay's routing
trace covers every decode step, and the cache numbers are the stage's own."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import load_config
from deltafin.cli.workload import CACHE_SHARES, WORKLOADS, bench_workload
from deltafin.errors import DeltafinError


@pytest.mark.parametrize("pass_cost", ["timed", "reads"])
def test_workload_numbers_add_up(tiny_dir, pass_cost):
    result = bench_workload(tiny_dir, ["chat", "code"], tokens=10, device="cpu", cache_share=0.25,
                            pass_cost=pass_cost)
    cfg = load_config(tiny_dir)
    all_experts = len(cfg.moe_layers) * cfg.num_experts
    assert list(result["workloads"]) == ["chat", "code"] and result["pass_cost"] == pass_cost
    for name, w in result["workloads"].items():
        assert w["prompts"] == len(WORKLOADS[name]) and 0 < w["generated_tokens"] <= 10 * w["prompts"]
        decoded = w["generated_tokens"] - w["prompts"]  # each answer's first token comes from its prefill
        plain, d = w["drafting"]["plain"], w["drafting"]["ngram"]
        assert w["drafting"]["draft"] == {"skipped": f"{tiny_dir} has no draft head (draft/)"}
        assert plain["draft_tokens"] == 0 and plain["forwards_per_token"] == 1  # a forward a token after the first
        assert d["same_tokens_as_plain"] is True  # greedy drafting is exact
        assert 0 <= d["accepted_tokens"] <= d["draft_tokens"]
        # a forward yields its token plus what it accepted; an answer may end inside a pass's accepted drafts
        assert decoded - d["accepted_tokens"] <= d["forwards"] <= decoded
        # the decode reads through a cache of a quarter of the experts (and the prefetcher's guesses): some
        assert plain["expert_bytes_per_token"] > 0
        assert d["expert_bytes_vs_plain"] == pytest.approx(d["expert_bytes_per_token"]
                                                           / plain["expert_bytes_per_token"], abs=1e-3)
        # every decode pass metered: a plain one feeds one token and yields one; with drafts, the passes that
        # verified some and those that did not share the forwards and the tokens
        assert plain["passes"]["drafted"]["passes"] == 0
        assert plain["passes"]["undrafted"]["passes"] == plain["passes"]["undrafted"]["tokens"] == decoded
        assert plain["passes"]["undrafted"]["expert_bytes_per_token"] == plain["expert_bytes_per_token"]
        split = d["passes"]
        assert split["drafted"]["passes"] + split["undrafted"]["passes"] == d["forwards"]
        assert split["drafted"]["tokens"] + split["undrafted"]["tokens"] == decoded
        assert split["undrafted"]["passes"] == split["undrafted"]["tokens"]
        # a drafted pass yields 1 + its accepted drafts (the last of an answer maybe fewer: the answer ended)
        assert split["drafted"]["tokens"] - split["drafted"]["passes"] == decoded - d["forwards"] \
            <= d["accepted_tokens"]
        r = w["routing"]
        assert r["decode_steps"] == decoded
        assert set(r["policy_hit_rates"]) == {f"{s:g}" for s in CACHE_SHARES}
        lru = [r["policy_hit_rates"][f"{s:g}"]["lru"] for s in CACHE_SHARES]
        assert lru == sorted(lru)  # LRU is a stack algorithm: a larger cache never hits less
        assert r["shared_if_uniform"] == pytest.approx(cfg.experts_per_token / cfg.num_experts, abs=1e-4)
        if pass_cost == "reads":  # every pass priced by its experts alone: 1 for one token's
            assert d["pass_cost"].startswith("0 + ") and "reads: k=0 1, " in d["pass_cost"]
        c = w["stage_cache"]
        # a quarter of the experts, as the stage's cache holds them (whole slots, not the experts' bytes)
        assert c["capacity_experts"] == w["expert_cache_experts"] == int(0.25 * all_experts)
        assert c["lookups"] == decoded * len(cfg.moe_layers) * cfg.experts_per_token
        assert 0 <= c["hit_rate"] <= c["no_wait_rate"] <= 1


def test_unknown_workload_is_refused(tiny_dir):
    with pytest.raises(DeltafinError, match="unknown workload 'poetry'"):
        bench_workload(tiny_dir, ["poetry"], tokens=4)
    with pytest.raises(DeltafinError, match="unknown pass cost 'free'"):
        bench_workload(tiny_dir, ["chat"], tokens=4, pass_cost="free")


def test_the_drafter_alone_is_scored_against_the_greedy_continuation():
    from deltafin.cli.workload import drafter_alone

    # the answer repeats "7 8 9": from its second occurrence on, the drafter's guesses are the continuation
    answer = [5, 7, 8, 9, 1, 7, 8, 9, 1, 7, 8]
    got = drafter_alone([([2, 3], answer)], k=2)
    # positions 1..5 see no repeated n-gram; 6..9 guess the next two right ([8, 9], [9, 1], [1, 7], [7, 8]);
    # at 10 the answer ends after one: 5 guesses of 10 positions, 9 drafts taken
    assert got == {"k": 2, "positions": 10, "proposed_share": 0.5, "first_draft_taken": 0.5,
                   "taken_per_position": 0.9}
    none = drafter_alone([([2, 3], [10, 11, 12, 13])], k=3)  # nothing repeats: never a guess
    assert none["proposed_share"] == 0 and none["taken_per_position"] == 0


def test_a_pass_yields_the_tokens_up_to_where_the_next_one_starts():
    from deltafin.cli.workload import PassMeter

    class Pipeline:
        stages = ()

        def forward(self, batch):
            raise AssertionError("not run")

    meter = PassMeter(Pipeline())
    # a lost prompt fed again (position 0), then passes at 10 (1 token), 11 (the token and 3 drafts: 2 taken),
    # 14 (1 token), 15 (the token and 2 drafts; the answer ends after 2 of them)
    meter.passes = [(0, 10, 50), (10, 1, 7), (11, 4, 20), (14, 1, 6), (15, 3, 15)]
    by_kind = {"drafted": [0, 0, 0], "undrafted": [0, 0, 0]}
    meter.add_to(by_kind, prompt=10, decoded=7)
    assert by_kind == {"drafted": [2, 3 + 2, 20 + 15], "undrafted": [2, 2, 7 + 6]}
