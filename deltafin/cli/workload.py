"""`deltafin bench --model DIR --workload chat,code`: what a trained model's own text does to the expert
cache, the prefetcher and the drafters.

For each workload, a fixed set of chat prompts (questions about Python, or requests for a function's source)
is answered greedily through the serving engine (deltafin.load) in each drafting mode: plainly, with
`speculative="ngram"` and, where the model has a draft head, `speculative="draft"`; each with an expert cache of
`cache_share` of all experts, so that the bytes a mode's forwards read are what a plan that streams its experts
reads, and each pass priced as such a plan prices it, by its expert reads alone (or as the engine here prices
it: PASS_COSTS). The drafting modes must give the plain tokens; their counters give the acceptance, the forwards per
generated token and the expert bytes per token beside plain's. The n-gram drafter is also scored alone, at every
position of the answers. Then every plain answer
is replayed token by token through a stage whose experts stream through a cache of `cache_share` of them,
recording which experts each MoE layer asks for at each decode step: that routing trace gives each cache
policy's hit rate at several cache sizes (weights.cache.simulate), the stage's own prefetch recall, and how
many of a token's experts the token before it used in the same layer (docs/k3-mini.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

import deltafin
from deltafin.checkpoint.config import load_config
from deltafin.errors import DeltafinError
from deltafin.expert_modes import EXACT
from deltafin.expert_modes import parse as parse_mode
from deltafin.options import CACHE_POLICIES, GB
from deltafin.paths import model_path as resolve_model_path
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.runtime.head_drafter import DRAFT_DIR
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.text.drafting import NgramDrafter, reads_cost
from deltafin.weights.expert_cache import simulate
from deltafin.weights.expert_stats import ExpertStats
from deltafin.weights.expert_trace import ExpertRecorder

WORKLOADS: dict[str, tuple[str, ...]] = {
    "chat": ("What does `json.dumps` do?", "What is the `textwrap` module for?", "Explain `os.path.join`.",
             "How do I use `collections.Counter`?", "What does `shutil.copyfile` do?",
             "Tell me about the `csv` module.", "What is the signature of `subprocess.run`?",
             "What does `functools.lru_cache` do?"),
    "code": ("Show me the source of `textwrap.dedent`.", "How is `json.dumps` implemented?",
             "Show me the source of `shutil.copyfileobj`.", "How is `os.path.splitext` implemented?",
             "Show me the source of `heapq.heappush`.", "How is `base64.b64encode` implemented?",
             "Show me the source of `fnmatch.fnmatch`.", "How is `string.capwords` implemented?"),
}
CACHE_SHARES = (0.125, 0.25, 0.5)  # cache sizes the policies are compared at, as a share of all experts
DRAFTS = 4  # drafts per position when the drafter is measured on its own
DRAFT_MODES = ("plain", "ngram", "draft")  # each workload answered with each; "draft" where the model has a head
# how the drafting modes price a pass: by the experts it reads alone (drafting.reads_cost: one 64 GB Mac's plan at
# K3's size, where reads decide; the default, as the bench's cache stands for a plan that streams its experts), or
# as the engine here does (the plan, corrected by this machine's timed passes)
PASS_COSTS = ("reads", "timed")


def bench_workload(model: str | Path, workloads: list[str], tokens: int, device: str = "cpu",
                   cache_share: float = 0.25, options: Any = None, pass_cost: str = "reads",
                   expert_mode: str = EXACT) -> dict[str, Any]:
    """JSON-ready results per workload (see the module docstring). `options` (StageOptions) size the replay's
    stage; its expert cache is `cache_share` of all experts unless the options set one. `pass_cost` (PASS_COSTS):
    how the drafting modes price a pass when they choose their draft length. `expert_mode`: every engine and the
    replay route in it (deltafin/expert_modes.py): its expert bytes a token beside exact's from another run."""
    expert_mode, replay_options = parse_mode(expert_mode).name, options or StageOptions()
    if pass_cost not in PASS_COSTS:
        raise DeltafinError(f"unknown pass cost {pass_cost!r}: use {', '.join(PASS_COSTS)}")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise DeltafinError(f"unknown workload {unknown[0]!r}: use {', '.join(WORKLOADS)}")
    out: dict[str, Any] = {"bench": "workload", "model": str(Path(model).resolve()), "device": device,
                           "max_tokens": tokens, "pass_cost": pass_cost, "expert_mode": expert_mode, "workloads": {}}
    cfg = load_config(model)
    cache = (options.sizing.expert_cache_bytes if options is not None and options.sizing.expert_cache_bytes
             is not None else cache_bytes(cfg, cache_share))
    missing = None if has_draft_head(model) else f"{model} has no draft head ({DRAFT_DIR}/)"
    for name in workloads:
        drafting = {mode: _mode(model, device, cache, mode, WORKLOADS[name], tokens, pass_cost, expert_mode)
                    if mode != "draft" or missing is None else {"skipped": missing} for mode in DRAFT_MODES}
        plain = drafting["plain"].pop("replies")
        for mode in DRAFT_MODES[1:]:
            if "replies" in drafting[mode]:
                replies = drafting[mode].pop("replies")
                drafting[mode]["same_tokens_as_plain"] = all(a == b for a, b in zip(replies, plain, strict=True))
                drafting[mode]["expert_bytes_vs_plain"] = _ratio(drafting[mode]["expert_bytes_per_token"],
                                                                 drafting["plain"]["expert_bytes_per_token"])
                drafting[mode]["drafted_passes_bytes_vs_plain"] = _ratio(
                    drafting[mode]["passes"]["drafted"]["expert_bytes_per_token"],
                    drafting["plain"]["expert_bytes_per_token"])
        drafting["plain"]["same_tokens_as_plain"] = True
        result = {"prompts": len(plain), "generated_tokens": sum(len(t) for _, t in plain),
                  "expert_cache_bytes": cache, "expert_cache_experts": cache // expert_slot_bytes(cfg),
                  "drafting": drafting,
                  "drafter_alone": drafter_alone(plain)}
        result.update(_replay(model, device, plain, cache_share, replay_options.replace(expert_mode=expert_mode)))
        out["workloads"][name] = result
    return out


def _mode(model: str | Path, device: str, cache: int, mode: str, prompts: tuple[str, ...], tokens: int,
          pass_cost: str, expert_mode: str) -> dict[str, Any]:
    """The prompts answered in one drafting mode by a fresh engine with an expert cache of `cache` bytes (its kept
    prefixes in a folder of its own, and no remembered heat: no earlier run's states)."""
    with tempfile.TemporaryDirectory() as kept, \
            deltafin.load(model, device, progress=False, speculative=mode if mode != "plain" else "none",
                          expert_cache_gb=cache / GB, prefix_dir=kept, expert_mode=expert_mode,
                          expert_heat=False) as m:
        if pass_cost == "reads":
            m.engine.price_passes(reads_cost(m.engine.cfg.num_experts, m.engine.cfg.experts_per_token))
        return _drafting(m, prompts, tokens)


def cache_bytes(cfg: Any, share: float) -> int:
    """An expert cache holding `share` of all experts: whole slots (an expert's slot is its bytes widened to
    direct-I/O blocks, 3.6 times them at k3-mini's 19.6 KB, 0.3 % more at K3's 17.5 MB; plan/memory/sizing.py)."""
    return int(share * len(cfg.moe_layers) * cfg.num_experts) * expert_slot_bytes(cfg)


def has_draft_head(model: str | Path) -> bool:
    return (resolve_model_path(model) / DRAFT_DIR / "config.json").is_file()


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _ask(model: Any, prompt: str, tokens: int) -> Any:
    return model.chat([{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0.0)


def _expert_bytes(model: Any) -> int:
    return sum(s.experts.bytes_read for s in model.stats() if s.experts is not None)


def _drafting(model: Any, prompts: tuple[str, ...], tokens: int) -> dict[str, Any]:
    """The prompts answered greedily in one drafting mode: each prompt first alone (its prefill, whose state the
    prefix cache keeps, as the draft head's cache is kept for the text it covers), then whole, resumed from it, so
    that the counters and the expert bytes are the decode's. The answers come back under "replies" ((prompt ids,
    answer ids) each) for the caller to compare."""
    c = model.engine.counters
    replies, by_kind = [], {"drafted": [0, 0, 0], "undrafted": [0, 0, 0]}  # passes, tokens, bytes
    drafted = accepted = forwards = read = decoded = 0
    for p in prompts:
        _ask(model, p, 1)
        before = (c.draft_tokens, c.accepted_tokens, c.forwards, _expert_bytes(model))
        with PassMeter(model.engine.backend.pipeline) as meter:
            r = _ask(model, p, tokens)
        after = (c.draft_tokens, c.accepted_tokens, c.forwards, _expert_bytes(model))
        d = [a - b for a, b in zip(after, before, strict=True)]
        drafted, accepted, forwards, read = drafted + d[0], accepted + d[1], forwards + d[2], read + d[3]
        # the first token of an answer comes from its prompt's forward; the stop token, if any, counts
        decoded += r.usage.completion_tokens - 1
        meter.add_to(by_kind, len(r.prompt_ids), r.usage.completion_tokens - 1)
        replies.append((r.prompt_ids, r.token_ids))
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "forwards": forwards, "forwards_per_token": round(forwards / decoded, 4) if decoded else None,
            "expert_bytes_per_token": round(read / decoded) if decoded else None, "replies": replies,
            "passes": {kind: {"passes": n, "tokens": t, "expert_bytes_per_token": round(b / t) if t else None}
                       for kind, (n, t, b) in by_kind.items()},
            "pass_cost": model.engine.pass_cost().describe() if model.engine.speculative != "none" else None,
            "calibration": model.engine.calibration.describe() if model.engine.speculative == "draft" else None}


class PassMeter:
    """An in-process pipeline's forwards while it is on: each one's position, the tokens it fed (this bench runs
    one sequence at a time) and the expert bytes its stages read meanwhile; split by whether each pass verified
    drafts (fed more than its one token), they say what drafting reads where the engine chose to draft."""

    def __init__(self, pipeline: Any):
        self.pipeline, self.forward, self.passes = pipeline, pipeline.forward, []

    def _read(self) -> int:
        return sum(e.bytes_read for s in self.pipeline.stages if (e := s.stats().experts) is not None)

    def _metered(self, batch: list[SeqInput], *args: Any, **kwargs: Any) -> Any:
        before = self._read()
        out = self.forward(batch, *args, **kwargs)
        self.passes.append((batch[0].cache_len, batch[0].num_tokens, self._read() - before))
        return out

    def __enter__(self) -> PassMeter:
        self.pipeline.forward = self._metered
        return self

    def __exit__(self, *exc: object) -> None:
        del self.pipeline.forward  # the class's own again

    def add_to(self, by_kind: dict[str, list[int]], prompt: int, decoded: int) -> None:
        """Add this answer's decode passes (passes, tokens, bytes) to `by_kind` (a forward of the prompt, where the
        kept one was lost, is none): a pass yields the tokens up to where the next one starts; the last, what the
        answer has left."""
        passes = [p for p in self.passes if p[0] >= prompt]
        for i, (at, fed, read) in enumerate(passes):
            tokens = passes[i + 1][0] - at if i + 1 < len(passes) else decoded
            decoded -= tokens
            counts = by_kind["drafted" if fed > 1 else "undrafted"]
            for j, v in enumerate((1, tokens, read)):
                counts[j] += v


def drafter_alone(sequences: list[tuple[list[int], list[int]]], k: int = DRAFTS) -> dict[str, Any]:
    """The n-gram drafter on greedy answers, at every decode position, k drafts each time: how often it has a
    guess, and how many of its k a greedy verification would take (its first; on average). Independent of the
    engine's choice of k (which falls to 0 when drafts stop paying)."""
    drafter = NgramDrafter()
    positions = proposed = first = taken = 0
    for prompt, answer in sequences:
        for i in range(1, len(answer)):
            context, truth = prompt + answer[:i], answer[i:i + k]
            drafts = drafter.propose(context, k).tokens
            positions += 1
            proposed += bool(drafts)
            run = next((j for j, (d, t) in enumerate(zip(drafts, truth, strict=False)) if d != t),
                       min(len(drafts), len(truth)))
            first += run > 0
            taken += run
    return {"k": k, "positions": positions, "proposed_share": round(proposed / positions, 4) if positions else None,
            "first_draft_taken": round(first / positions, 4) if positions else None,
            "taken_per_position": round(taken / positions, 4) if positions else None}


def _replay(model: str | Path, device: str, sequences: list[tuple[list[int], list[int]]], cache_share: float,
            options: Any) -> dict[str, Any]:
    """Feed each answer back one token at a time through a streaming stage; the routing trace it records."""
    cfg = load_config(model)
    all_experts = len(cfg.moe_layers) * cfg.num_experts
    options = (options or StageOptions()).replace(expert_heat_dir=None)  # no remembered heat, as the engines'
    if options.sizing.expert_cache_bytes is None:
        options = options.replace(expert_cache_bytes=cache_bytes(cfg, cache_share))
    pipe = LocalPipeline.load(model, 1, device=device, options=options)
    stage = pipe.stages[0]
    recorder = ExpertRecorder(stage.experts)
    capacity = stage.experts.cache.budget // stage.experts.slots.slot_bytes  # the experts its cache really holds
    counted = dict.fromkeys(("lookups", "hits", "prefetch_hits", "misses"), 0)
    try:
        for i, (prompt, answer) in enumerate(sequences):
            pipe.forward([SeqInput(f"replay-{i}", 0, ids=torch.tensor(prompt))])
            stage.experts, before = recorder, stage.stats().experts or ExpertStats()
            for n, token in enumerate(answer[:-1]):
                pipe.forward([SeqInput(f"replay-{i}", len(prompt) + n, ids=torch.tensor([token]))])
            stage.experts, after = recorder.inner, stage.stats().experts or ExpertStats()
            for k in counted:
                counted[k] += getattr(after, k) - getattr(before, k)
            pipe.release(f"replay-{i}")
    finally:
        pipe.close()
    return {"routing": _routing(cfg, recorder.trace, all_experts),
            "stage_cache": _stage_cache(counted, capacity, options.cache_policy)}


def _routing(cfg: Any, trace: list[tuple[int, list[int]]], all_experts: int) -> dict[str, Any]:
    """Policy hit rates at CACHE_SHARES of all experts, and how much consecutive tokens share experts."""
    steps = [[(layer, e) for e in ids] for layer, ids in trace]
    rates = {f"{share:g}": {p: round(simulate(p, max(1, int(share * all_experts)), steps), 4) for p in CACHE_POLICIES}
             for share in CACHE_SHARES}
    last: dict[int, set[int]] = {}
    shared = pairs = 0
    for layer, ids in trace:
        if layer in last:
            shared += len(last[layer] & set(ids))
            pairs += len(ids)
        last[layer] = set(ids)
    uniform = cfg.experts_per_token / cfg.num_experts  # what a router with no preferences would share
    return {"decode_steps": len(trace) // max(1, len(cfg.moe_layers)), "policy_hit_rates": rates,
            "best_policy": {s: max(r, key=r.get) for s, r in rates.items()},
            "shared_with_previous_token": round(shared / pairs, 4) if pairs else None,
            "shared_if_uniform": round(uniform, 4)}


def _stage_cache(d: dict[str, int], capacity: int, policy: str) -> dict[str, Any]:
    """The replay's decode steps as the stage counted them: found cached (hits), found because the prefetcher
    read them ahead (prefetch_recall: the share of the experts not cached before that were prefetched)."""
    want = d["prefetch_hits"] + d["misses"]
    lookups = d["lookups"]
    return {"policy": policy, "capacity_experts": capacity, "lookups": lookups,
            "hit_rate": round(d["hits"] / lookups, 4) if lookups else None,
            "prefetch_recall": round(d["prefetch_hits"] / want, 4) if want else None,
            "no_wait_rate": round((d["hits"] + d["prefetch_hits"]) / lookups, 4) if lookups else None}
