"""A forward's stage hops (pure): what each carries, which way it goes and what it takes.

A stage's output state reaches the next stage one of two ways:
- relayed by the coordinator (coordinator/cluster/relay.py), part by part as it comes, so its two links carry it
  at once; on one medium (one Wi-Fi channel, `Links.shared_bps`) that is two crossings of the same airtime;
- handed over directly, worker to worker (worker/handoff.py): one crossing of the link between the two, then a
  round trip of each to the coordinator (the stage before answers once the next one holds the states, and the
  next stage's call starts after that answer).
A hop goes direct where the link between its two workers was measured (a worker that cannot reach the other is
relayed) and the direct way is faster for the forward's bytes (`direct_hops`; `--hops relay` or `direct` decides
instead, `Links.hops`); a token's few KB usually go through
the coordinator, a prompt's tens of MB over Wi-Fi directly. `hops_seconds` prices the ways chosen.
"""

from __future__ import annotations

from deltafin.checkpoint.config import ModelConfig
from deltafin.models.pieces import STREAM_PIECE_TOKENS
from deltafin.plan.cluster.cluster_plan import ClusterPlan, PlannedStage
from deltafin.plan.cluster.compute import spine_seconds
from deltafin.plan.cluster.links import COORDINATOR, Links
from deltafin.plan.memory.stage_parts import boundary_bytes_per_token


def hop_bytes(cfg: ModelConfig, start: int, end: int, tokens: int, act_bytes: int) -> tuple[int, int]:
    """(bytes to, bytes back) of a forward of `tokens` tokens through a stage of layers [start, end): the first
    stage's token ids or the residual state entering `start`; the state leaving `end`, or the last position's fp32
    logits."""
    into = tokens * (4 if start == 0 else boundary_bytes_per_token(cfg, start, act_bytes))
    out = 4 * cfg.vocab_size if end == cfg.num_layers else tokens * boundary_bytes_per_token(cfg, end, act_bytes)
    return into, out


def _ways(links: Links, a: str, b: str, state: float) -> tuple[float, float | None]:
    """(relayed, direct) seconds of `state` bytes from the worker keyed `a` to `b`, round trips to the coordinator
    left out where both ways have them (`hops_seconds` counts one per stage); direct is None where the link between
    them was not measured."""
    into, out = links.between(a, COORDINATOR), links.between(COORDINATOR, b)
    relayed = links.together([(into, state, 0.0), (out, state, 0.0)], 0)
    if links.hops == "relay" or ((a, b) not in links.pairs and (b, a) not in links.pairs):
        return relayed, None
    pair = links.between(a, b)
    # its crossing and the receiver's acknowledgement, then the answer to the coordinator and the next stage's call
    return relayed, pair.seconds(state, 0.0) + (into.rtt_s + out.rtt_s) / 2


def direct_hops(cfg: ModelConfig, plan: ClusterPlan, tokens: int, act_bytes: int) -> tuple[bool, ...]:
    """For each hop (stage i to stage i + 1) of a forward of `tokens` tokens: whether it goes directly."""
    wire = min(act_bytes, plan.links.value_bytes)
    out = []
    for a, b in zip(plan.stages[:-1], plan.stages[1:], strict=True):
        relayed, direct = _ways(plan.links, a.key, b.key, hop_bytes(cfg, a.start, a.end, tokens, wire)[1])
        out.append(direct is not None and (direct < relayed or plan.links.hops == "direct"))
    return tuple(out)


def hops_seconds(cfg: ModelConfig, plan: ClusterPlan, tokens: int, act_bytes: int) -> float:
    """A forward's hops: the ids to the first stage, each stage's output state to the next the way `direct_hops`
    chose (a stage that ends on a dense layer sends it while it computes: `_streamed`), the last position's logits
    back; a round trip to each stage."""
    stages, links = plan.stages, plan.links
    wire = min(act_bytes, links.value_bytes)
    first_in, _ = hop_bytes(cfg, stages[0].start, stages[0].end, tokens, wire)
    _, last_out = hop_bytes(cfg, stages[-1].start, stages[-1].end, tokens, wire)
    link = [links.between(COORDINATOR, s.key) for s in stages]
    hops = 0.0
    for a, b in zip(stages[:-1], stages[1:], strict=True):
        relayed, direct = _ways(links, a.key, b.key, hop_bytes(cfg, a.start, a.end, tokens, wire)[1])
        way = relayed if direct is None else direct if links.hops == "direct" else min(relayed, direct)
        hops += _streamed(cfg, a, tokens, way)
    return sum(v.rtt_s for v in link) + link[0].seconds(first_in, 0, 0) + hops + link[-1].seconds(0, last_out, 0)


def _streamed(cfg: ModelConfig, s: PlannedStage, tokens: int, hop: float) -> float:
    """What a stage's hop of `hop` seconds adds after its compute: all of it, but where the stage ends on a dense
    layer that runs in n pieces and sends each on as it is done (models/decoder.py STREAM_PIECE_TOKENS), the rows
    cross during its compute C of that layer: the link is done max(hop / n, hop - C (n - 1) / n) after it."""
    if tokens <= STREAM_PIECE_TOKENS or cfg.is_moe(s.end - 1) or s.compute is None:
        return hop
    n = -(-tokens // STREAM_PIECE_TOKENS)
    last = spine_seconds(cfg, s.compute, s.end - 1, s.end, tokens, s.plan.spine)
    return max(hop / n, hop - last * (n - 1) / n)


def hop_ways(cfg: ModelConfig, plan: ClusterPlan, act_bytes: int) -> list[dict[str, str]]:
    """Each hop's way for a decoded token and for a prompt's longest forward (what `plan` says)."""
    longest = min(s.plan.longest_forward for s in plan.stages)
    token, prompt = direct_hops(cfg, plan, 1, act_bytes), direct_hops(cfg, plan, longest, act_bytes)
    way = lambda direct: "direct" if direct else "relayed"
    return [{"from": a.worker, "to": b.worker, "token": way(t), "prompt": way(p), "prompt_tokens": str(longest)}
            for a, b, t, p in zip(plan.stages[:-1], plan.stages[1:], token, prompt, strict=True)]


def describe_hops(cfg: ModelConfig, plan: ClusterPlan, act_bytes: int) -> list[str]:
    """`hop_ways` in words, one line a hop (none for one stage)."""
    words = {"direct": "handed over directly", "relayed": "relayed by the coordinator"}
    return [f"stage hop {h['from']} -> {h['to']}: a token {words[h['token']]}, a prompt's forward "
            f"({int(h['prompt_tokens']):,} tokens) {words[h['prompt']]}" for h in hop_ways(cfg, plan, act_bytes)]
