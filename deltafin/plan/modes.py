"""Wide or local experts, chosen by what the links, the disks and the compute make each cost (pure).

Wide experts put every disk on every token but send each MoE layer's rows over the links; local experts (the
pipelined plan) send only the stage hops. With `--experts auto` and several workers both are planned and priced
(plan/timing/predict.py: a decoded token, a prompt's first token, each with the links as measured and the workers'
compute) and the one a chat turn takes less time in is used: a TURN_PROMPT-token prompt and TURN_REPLY tokens of reply.
(Where every expert is in memory nothing is read and wide spreads their compute: wide, where the workers' compute is
not known to price it.) On a fast link (a Thunderbolt bridge, 10 GbE) that is wide; on Wi-Fi at K3's width a wide
prompt moves more over the air than the disks read, and the pipelined plan wins. The plan says which and why
(`ClusterPlan.mode_why`); `--experts wide|local` forces one. Where the exact wire holds a TURN_PROMPT-token prompt back
by at least WIRE_HINT_GAIN of its time, the reason also says what `--wire bf16` would make it (a lossy wire is the
user's choice, never the plan's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import PlanError
from deltafin.plan.cluster.cluster_plan import ClusterPlan, WorkerCapacity
from deltafin.plan.cluster.links import Links
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.planner import plan_layers
from deltafin.plan.timing.predict import prefill_seconds

TURN_PROMPT = 4096  # a chat turn, as the choice weighs it: its prompt ...
TURN_REPLY = 512  # ... and its reply
CLOSE_CALL = 0.1  # two modes' turns this close (or within the compute readings' spread) are a close call
WIRE_HINT_GAIN = 0.1  # the share of a prompt's time a bf16 wire must save to be mentioned


def choose_mode(cfg: ModelConfig, workers: list[WorkerCapacity], options: SizingInput, act_bytes: int,
                asked: str, links: Links) -> ClusterPlan:
    """The plan in the experts' mode `asked` (wide | local), or with "auto" the faster for a turn (see the module
    docstring), its `mode_why` set."""
    if asked != "auto":
        plan = plan_layers(cfg, workers, options, act_bytes, asked, links)
        return replace(plan, mode_why=f"as asked (--experts {asked})" + wire_hint(cfg, plan, act_bytes))
    if len(workers) < 2 or not cfg.moe_layers:
        plan = plan_layers(cfg, workers, options, act_bytes, "local", links)
        return replace(plan, mode_why="one worker reads its own experts" if len(workers) < 2 else "no routed experts")
    plans = {}
    for mode in ("wide", "local"):
        try:
            plans[mode] = plan_layers(cfg, workers, options, act_bytes, mode, links)
        except PlanError:
            if mode == "local" and "wide" in plans:
                return replace(plans["wide"], mode_why="the workers hold the model only with wide experts")
            raise
    resident = not any(s.plan.expert_bytes_per_token for p in plans.values() for s in p.workers)
    if resident and any(s.compute is None for p in plans.values() for s in p.workers):  # nothing to price
        return replace(plans["wide"], mode_why="every expert is in memory: wide spreads their compute")
    turns = {mode: turn_seconds(cfg, p, act_bytes) for mode, p in plans.items()}
    mode = "wide" if plans["wide"].wide and turns["wide"] <= turns["local"] else "local"
    why = _why(cfg, plans, turns, mode, act_bytes) + close_call(turns, plans.values()) + wire_hint(cfg, plans[mode],
                                                                                                   act_bytes)
    return replace(plans[mode], mode_why=why)


def close_call(turns: dict[str, float], plans: Iterable[ClusterPlan]) -> str:
    """What a choice between modes the measurements barely separate says: the two within CLOSE_CALL of each other,
    or within the workers' compute readings' spread ("" where they are clearly apart)."""
    spread = max((s.compute.spread for p in plans for s in p.workers if s.compute is not None), default=0.0)
    fast, slow = min(turns.values()), max(turns.values())
    margin = max(CLOSE_CALL, spread)
    if slow > fast * (1 + margin):
        return ""
    return (f"; a close call: the two are {slow / max(fast, 1e-12) - 1:.0%} apart, within what the measurements can "
            f"tell apart (±{margin:.0%}); --experts wide|local fixes the mode")


def wire_hint(cfg: ModelConfig, plan: ClusterPlan, act_bytes: int = 4) -> str:
    """What `--wire bf16` would make a TURN_PROMPT-token prompt take, where that saves WIRE_HINT_GAIN of it ("" where
    it would not, or the wire is bf16 already)."""
    if plan.links.value_bytes < 4 or len(plan.workers) < 2:
        return ""
    exact = prefill_seconds(cfg, plan, TURN_PROMPT, act_bytes=act_bytes).total
    half = prefill_seconds(cfg, replace(plan, links=replace(plan.links, value_bytes=2)), TURN_PROMPT,
                           act_bytes=act_bytes).total
    if exact - half < WIRE_HINT_GAIN * exact:
        return ""
    return (f"; over these links the exact wire holds a {TURN_PROMPT:,}-token prompt back: {exact:.0f} s, "
            f"{half:.0f} s with --wire bf16 (lossy; its cost is measured in docs/cluster.md)")


def turn_seconds(cfg: ModelConfig, plan: ClusterPlan, act_bytes: int = 4) -> float:
    """A chat turn's predicted time on `plan`: its prompt's first token, then its reply."""
    assert plan.token is not None
    return prefill_seconds(cfg, plan, TURN_PROMPT, act_bytes=act_bytes).total + TURN_REPLY * plan.token.total


def _why(cfg: ModelConfig, plans: dict[str, ClusterPlan], turns: dict[str, float], chosen: str, act_bytes: int) -> str:
    parts = []
    for mode in ("wide", "local"):
        p = plans[mode]
        prompt = prefill_seconds(cfg, p, TURN_PROMPT, act_bytes=act_bytes)
        parts.append(f"{mode}: a token {p.token.describe()}, a {TURN_PROMPT:,}-token prompt {prompt.describe()}"
                     if p.token is not None else mode)
    return (f"a turn of a {TURN_PROMPT:,}-token prompt and {TURN_REPLY} tokens takes {turns[chosen]:.0f} s, "
            f"against {turns['local' if chosen == 'wide' else 'wide']:.0f} s ({'; '.join(parts)})")
