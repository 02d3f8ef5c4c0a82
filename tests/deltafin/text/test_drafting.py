"""Exact speculative decoding: stages verify drafted tokens in one forward and rewind to the accepted
position; the drafter, the acceptance rule (greedy and rejection sampling) and the generation loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafin.coordinator.engine.generation import Generation
from deltafin.errors import InvalidInput, SessionOutOfSync
from deltafin.plan.memory.sizing import SizingInput
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.text.drafting import Drafts
from tests.support.cluster import COORDINATOR

PROMPT = [5, 17, 99, 3, 250, 41, 7, 7, 64, 12]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Several tokens in one forward against one at a time: the same math, the matrix products' rounding
    differs with their row count (prefill against decode on `tiny` measures up to 3.4e-6 relative L2 per
    position, README's correctness table; a verify row sits between the two)."""
    assert a.shape == b.shape
    rel = float((a - b).norm() / b.norm())
    assert rel <= 1e-5, rel


@pytest.fixture(scope="module")
def pipe(tiny_dir: Path) -> LocalPipeline:
    p = LocalPipeline.load(tiny_dir, 2, "cpu", "fp32")  # two stages: every stage rewinds its own part
    yield p
    p.close()


def _plain(pipe: LocalPipeline, sid: str, tokens: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt, then after each of `tokens` fed one at a time."""
    rows = [pipe.forward([SeqInput(sid, 0, ids=torch.tensor(PROMPT))])[0].logits[-1]]
    for i, t in enumerate(tokens):
        rows.append(pipe.forward([SeqInput(sid, len(PROMPT) + i, ids=torch.tensor([t]))])[0].logits[-1])
    pipe.release(sid)
    return rows


def test_a_verified_draft_rewinds_to_the_accepted_position_and_continues_as_plain_decoding(pipe) -> None:
    tokens = [11, 23, 35, 47, 59]
    plain = _plain(pipe, "plain", tokens)
    pipe.forward([SeqInput("spec", 0, ids=torch.tensor(PROMPT))])
    n = len(PROMPT)
    # feed 11 with drafts 23, 90, 91: every position's logits come back ...
    out = pipe.forward([SeqInput("spec", n, ids=torch.tensor([11, 23, 90, 91]), speculative=True)])[0].logits
    assert out.shape[0] == 4
    # ... and the first two are plain decoding's (the rows after 11 and after 23)
    _close(out[:2], torch.stack(plain[1:3]))
    # 90 was rejected: continue after 23 with the right token, and from there on it is plain decoding
    row = pipe.forward([SeqInput("spec", n + 2, ids=torch.tensor([35]))])[0].logits[-1]
    _close(row, plain[3])
    # a speculative forward of which everything is accepted: continue at its end
    out = pipe.forward([SeqInput("spec", n + 3, ids=torch.tensor([47, 59]), speculative=True)])[0].logits
    _close(out, torch.stack(plain[4:6]))
    pipe.forward([SeqInput("spec", n + 5, ids=torch.tensor([1]))])
    pipe.release("spec")


def test_rewinding_where_no_speculative_forward_fed_is_refused(pipe) -> None:
    n = len(PROMPT)
    pipe.forward([SeqInput("s", 0, ids=torch.tensor(PROMPT))])
    pipe.forward([SeqInput("s", n, ids=torch.tensor([1, 2, 3]), speculative=True)])
    with pytest.raises(SessionOutOfSync):  # before the speculative forward's first token: not a position it fed
        pipe.forward([SeqInput("s", n, ids=torch.tensor([4]))])
    pipe.forward([SeqInput("s", n + 1, ids=torch.tensor([4]))])  # rewind to after its first token
    with pytest.raises(SessionOutOfSync):  # that forward was not speculative: nothing to rewind to any more
        pipe.forward([SeqInput("s", n + 1, ids=torch.tensor([5]))])
    pipe.release("s")


def test_a_session_kept_at_its_accepted_length_resumes_as_plain_decoding(pipe) -> None:
    tokens = [11, 23, 35]
    plain = _plain(pipe, "p", tokens)
    n = len(PROMPT)
    pipe.forward([SeqInput("a", 0, ids=torch.tensor(PROMPT))])
    pipe.forward([SeqInput("a", n, ids=torch.tensor([11, 23, 80, 81]), speculative=True)])
    pipe.release("a", "kept", keep_length=n + 2)  # 80 rejected: keep prompt, 11, 23
    row = pipe.forward([SeqInput("b", n + 2, ids=torch.tensor([35]), resume_from="kept")])[0].logits[-1]
    _close(row, plain[3])
    pipe.release("b")
    pipe.release("kept")


# ---- drafting ------------------------------------------------------------------------------------------------


def test_ngram_drafts_continue_the_latest_earlier_occurrence_of_the_longest_tail() -> None:
    from deltafin.text.drafting import NgramDrafter

    d = NgramDrafter(max_ngram=3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2).tokens == [7, 8]  # the latest "1 2 3": 7 8 followed
    assert d.propose([5, 6, 1, 2, 4, 2], 3).tokens == [4, 2]  # no 2- or 3-gram repeats: the 1-gram "2"
    assert d.propose([1, 2, 3, 4], 4).tokens == []  # nothing repeats
    assert d.propose([7, 7, 7], 5).tokens == [7]  # what follows the occurrence, up to the end of the text
    assert d.propose([1, 2, 1, 2], 0).tokens == []
    assert d.propose([1, 2, 1, 2], 2).confidence is None  # prompt lookup has no probability to give


def test_draft_length_follows_acceptance_and_the_cost_of_a_pass() -> None:
    from deltafin.text.drafting import DraftLength, PassCost, chain_tokens, default_cost

    def next_of(lengths: DraftLength, n: int) -> int:
        return lengths.next(Drafts(list(range(n))))

    assert chain_tokens([0.0] * 5) == 1.0 and chain_tokens([1.0] * 5) == 6.0
    assert chain_tokens([0.5] * 2) == pytest.approx(1.75)
    spine_bound = DraftLength(default_cost(896, 16))  # half of a one-token pass is fixed (a 64 GB Mac)
    for _ in range(20):
        spine_bound.update(drafted=4, accepted=4)
    # every draft lands: as many as allowed (the spine is read once, the experts grow with k)
    assert spine_bound.acceptance > 0.99 and next_of(spine_bound, 8) == 8 and next_of(spine_bound, 3) == 3
    for _ in range(10):
        spine_bound.update(drafted=8, accepted=4)  # about 0.8 per draft: k stops short of 8
    assert 0.75 < spine_bound.acceptance < 0.9 and 2 <= next_of(spine_bound, 8) < 8
    for _ in range(40):
        spine_bound.update(drafted=4, accepted=0)
    assert spine_bound.acceptance < 0.1 and next_of(spine_bound, 8) == 0  # drafts that never land cost reads
    # where the experts are all the cost and a uniform router brings ~16 new ones per drafted token, a pass
    # costs nearly what its tokens would alone: drafting pays only when nearly every draft lands
    expert_bound = DraftLength(PassCost(fixed=0.0, per_expert=1.0, experts=896, active=16))
    assert expert_bound.acceptance == 0.5 and next_of(expert_bound, 8) == 0
    for _ in range(30):
        expert_bound.update(drafted=2, accepted=2)
    assert expert_bound.acceptance > 0.99 and next_of(expert_bound, 8) >= 1


def test_a_head_s_confidence_sets_the_draft_length_as_its_drafts_fared() -> None:
    """With a drafter's confidences, each draft's acceptance is what drafts of that confidence got (Calibration):
    a sure chain is drafted whole, a chain stops before an unsure draft, unsure drafts are not sent, and a head
    whose sure drafts keep failing stops being believed. Priced by its experts alone (a 64 GB Mac's plan), with
    k3-mini's router (4 of 64): a pass of n tokens reads 64·(1 − (15/16)^n) experts a layer."""
    from deltafin.text.drafting import Calibration, DraftLength, PassCost, chain_tokens

    assert chain_tokens([]) == 1.0 and chain_tokens([0.5, 0.5, 1.0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    cost = PassCost(fixed=0.0, per_expert=1.0, experts=64, active=4)
    calibration = Calibration()
    assert calibration.acceptance(0.9995) > 0.99 and calibration.acceptance(0.1) < 0.2  # the prior: believed
    lengths = DraftLength(cost, calibration=calibration)
    assert lengths.next(Drafts([1, 2, 3, 4, 5], [0.9995] * 5)) == 5  # 5.98 tokens for 20.6 experts, not 1 for 4
    # after an unsure second draft the chain is unlikely to go on: one draft (2.0 tokens for 7.75 experts)
    assert lengths.next(Drafts([1, 2, 3], [0.9995, 0.2, 0.9995])) == 1
    assert lengths.next(Drafts([1, 2], [0.3, 0.9995])) == 0
    lengths.update(drafted=0, accepted=0)

    calibration.update([0.9995, 0.9995, 0.9995], accepted=1)  # judged: the first (taken) and the second (not)
    top = calibration.describe()[-1]
    assert top["judged"] == 2.0 and top["confidence"] == 0.9961
    assert calibration.acceptance(0.9995) == pytest.approx((4 * (0.99609375 + 1) / 2 + 1) / 6)
    sent = []
    for _ in range(40):  # a head sure of drafts that never land
        k = lengths.next(Drafts([1, 2, 3, 4], [0.9995] * 4))
        lengths.update(drafted=k, accepted=0)
        sent.append(k)
    assert calibration.acceptance(0.9995) < 0.5  # below what a pass of 2 tokens needs here (0.94), then only probes
    assert sum(k > 0 for k in sent[-16:]) == 2  # only the probes, one in 8 ...
    doubted = [lengths.next(Drafts([1, 2, 3, 4], [0.6, 0.9995, 0.9995, 0.9995])) for _ in range(16)]
    assert doubted == [0] * 16  # ... and only of a draft the head is sure of (probe_sure)
    blind = DraftLength(cost, calibration=calibration)  # prompt lookup gives no confidence: it probes, one in 8
    for _ in range(40):
        blind.update(drafted=4, accepted=0)
    assert sum(blind.next(Drafts([1, 2, 3, 4])) > 0 for _ in range(16)) == 2


def test_a_head_starts_from_the_calibration_its_recipe_measured(tmp_path: Path, caplog) -> None:
    """`Calibration.shipped` takes `describe`'s slices back (a head's config.json), refuses other slices; the
    engine reads it from the head's folder, and a head without one, or with a broken one, starts from the
    slices' middles (said in the log)."""
    import json

    from deltafin.runtime.head_drafter import head_calibration
    from deltafin.text.drafting import Calibration

    measured = Calibration()
    for _ in range(400):
        measured.update([0.95, 0.6], accepted=1)  # 0.95 always taken, 0.6 never
    slices = measured.describe()
    shipped = Calibration.shipped(slices)
    assert shipped.acceptance(0.95) == pytest.approx(slices[8]["taken"]) and shipped.acceptance(0.95) > 0.99
    assert shipped.acceptance(0.6) == pytest.approx(slices[2]["taken"]) and shipped.acceptance(0.6) < 0.01
    assert shipped.acceptance(0.1) == pytest.approx(Calibration().acceptance(0.1), abs=1e-3)  # unmeasured: the middle
    with pytest.raises(ValueError, match="slices start at"):
        Calibration.shipped(slices[:-1])
    with pytest.raises(ValueError, match="confidence, taken"):
        Calibration.shipped([{"confidence": 0.0}] * 17)

    head = tmp_path / "draft"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"deltafin_trained": {"calibration": slices}}))
    assert head_calibration(None, tmp_path).acceptance(0.6) < 0.01
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert head_calibration(head, tmp_path).acceptance(0.6) == Calibration().acceptance(0.6)
    assert not caplog.records
    (head / "config.json").write_text(json.dumps({"deltafin_trained": {"calibration": slices[:3]}}))
    assert head_calibration(head, tmp_path).acceptance(0.6) == Calibration().acceptance(0.6)
    assert "calibration" in caplog.text and "not used" in caplog.text


def test_verification_samples_exactly_the_target_distribution() -> None:
    """Speculative sampling with a certain draft: the token is distributed as the sampler's own p, whatever
    the draft (chi-square over 20,000 draws, seeded; the bound is the 0.999 quantile for 5 degrees of freedom)."""
    from deltafin.text.sampling import Sampler
    from deltafin.text.sampling_params import SamplingParams

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    params = SamplingParams(temperature=0.8, seed=1234)
    p = torch.softmax(logits / 0.8, -1)
    n = 20000
    for draft in (0, 4):
        sampler = Sampler(params, [])
        counts = torch.zeros(6)
        taken = 0
        for _ in range(n):
            choice, accepted = sampler.verify(logits, draft)
            counts[choice.token_id] += 1
            taken += accepted
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 20.5, (draft, chi2, counts / n, p)
        assert abs(taken / n - float(p[draft])) < 0.015  # the draft is taken with probability p(draft)
    greedy = Sampler(SamplingParams(temperature=0.0), [])
    assert [(c.token_id, ok) for c, ok in (greedy.verify(logits, 0), greedy.verify(logits, 5))] == [(0, True),
                                                                                                  (0, False)]


# ---- generation ----------------------------------------------------------------------------------------------


async def _tokens(engine, prompt: list[int], n: int, **kw) -> tuple[list[int], object]:
    from deltafin.coordinator.engine.events import Finished

    out, end = [], None
    async for e in engine.run(prompt, None, Generation(n, ignore_eos=True, **kw)):
        if isinstance(e, Finished):
            end = e
        else:
            out.append(e.token_id)
    return out, end


def _engine(tiny_dir: Path, stages: int = 2, **kw):
    from deltafin.checkpoint.config import load_config
    from deltafin.coordinator.cluster.backend import LocalBackend
    from deltafin.coordinator.engine.engine import Engine
    from deltafin.coordinator.engine.serving_options import ServingOptions
    from deltafin.text.tokenizer import K3Tokenizer

    pipe = LocalPipeline.load(tiny_dir, stages, "cpu", "fp32")
    prefix_cache = kw.pop("prefix_cache", False)
    return Engine(LocalBackend(pipe), K3Tokenizer.load(tiny_dir), load_config(tiny_dir), "tiny", ServingOptions(**kw),
                  prefix_cache=prefix_cache), pipe


class Scripted:
    """A drafter that proposes `truth` (the continuation plain decoding gives), spoiling every third pass's
    third draft: a random-weight model's text does not repeat, so n-gram drafts would rarely land."""

    feature_layers = ()  # it reads the text only

    def __init__(self, prompt: list[int], truth: list[int]):
        self.prompt, self.truth, self.passes = prompt, truth, 0

    def observe(self, text, start, features):
        pass

    def done(self, text):
        pass

    def propose(self, tokens: list[int], k: int) -> Drafts:
        at = len(tokens) - len(self.prompt)
        out = list(self.truth[at:at + k])
        self.passes += 1
        if self.passes % 3 == 0 and len(out) >= 3:
            out[2] = (out[2] + 1) % 1000
        return Drafts(out)


def _always(k: int):
    from deltafin.text.drafting import DraftLength, PassCost

    return DraftLength(PassCost(fixed=1.0, per_expert=0.0, experts=8, active=2), max_k=k)  # drafts are free


async def test_greedy_output_is_the_same_with_drafts_taken_and_rejected(tiny_dir: Path) -> None:
    """Through the engine and two in-process stages: drafts that land and drafts that do not; the output
    equals plain decoding's, one forward per pass, and the n-gram drafter's run too."""
    from deltafin.coordinator.engine.token_loop import Speculation

    engine, _ = _engine(tiny_dir, prefix_cache=True)
    try:
        for prompt in (PROMPT, [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]):
            index, engine.prefixes = engine.prefixes, None  # nothing kept by the plain run
            plain, _ = await _tokens(engine, prompt, 30)
            longer = prompt + plain[:29] + [plain[29], 7]
            expected, _ = await _tokens(engine, longer, 5)
            engine.prefixes = index
            engine._speculation = lambda mode, p=prompt, t=plain: Speculation(Scripted(p, t), _always(4))
            fast, end = await _tokens(engine, prompt, 30)
            assert fast == plain
            d = end.drafting
            assert d.accepted_tokens >= 15 and d.draft_tokens > d.accepted_tokens  # both kinds happened
            assert d.forwards == 29 - d.accepted_tokens  # every pass: one forward, 1 + accepted tokens
            del engine._speculation
            # the speculative run kept its state at prompt + 29 tokens (its rejected drafts dropped): a prompt
            # that extends it resumes there and continues as a full prefill does
            resumed, end = await _tokens(engine, longer, 5)
            assert end.usage.cached_tokens == len(prompt) + 29 and resumed == expected
            ngram, _ = await _tokens(engine, prompt, 30, speculative="ngram")
            assert ngram == plain
    finally:
        await engine.close()


async def test_sampling_with_drafts_keeps_the_distribution(tiny_dir: Path) -> None:
    """Temperature 1, top-k 3: the first two tokens take 9 values whose exact probabilities come from the
    stages' logits; 600 seeded runs with a draft for the second token (the likeliest, so both acceptance and
    rejection happen) match them (chi-square below the 0.999 quantile for 8 degrees of freedom, 26.1)."""
    from deltafin.coordinator.engine.token_loop import Speculation
    from deltafin.text.sampling_params import SamplingParams

    engine, pipe = _engine(tiny_dir, stages=1)

    def top3(logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        v, i = torch.topk(logits, 3)
        return i.tolist(), torch.softmax(v, -1)

    first, p1 = top3(pipe.forward([SeqInput("x", 0, ids=torch.tensor(PROMPT))])[0].logits[-1])
    pipe.release("x")
    exact, likeliest = {}, {}
    for t1, q1 in zip(first, p1.tolist(), strict=True):
        pipe.forward([SeqInput("x", 0, ids=torch.tensor(PROMPT))])
        second, p2 = top3(pipe.forward([SeqInput("x", len(PROMPT), ids=torch.tensor([t1]))])[0].logits[-1])
        pipe.release("x")
        likeliest[t1] = second[0]
        for t2, q2 in zip(second, p2.tolist(), strict=True):
            exact[(t1, t2)] = q1 * q2

    class Likeliest(Scripted):
        def __init__(self):
            pass

        def propose(self, tokens: list[int], k: int) -> Drafts:
            return Drafts([likeliest[tokens[len(PROMPT)]]][:k])

    engine._speculation = lambda mode: Speculation(Likeliest(), _always(1))
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    n = 600
    try:
        for seed in range(n):
            out, end = await _tokens(engine, PROMPT, 3, sampling=SamplingParams(temperature=1.0, top_k=3,
                                                                                  seed=seed))
            counts[(out[0], out[1])] += 1
            accepted += end.drafting.accepted_tokens
    finally:
        await engine.close()
    chi2 = sum((counts[c] - n * p) ** 2 / (n * p) for c, p in exact.items())
    assert chi2 < 26.1, (chi2, counts, exact)
    expected_accepted = sum(q for (t1, t2), q in exact.items() if t2 == likeliest[t1])
    assert abs(accepted / n - expected_accepted) < 0.07  # the draft lands as often as it is the sample


async def test_drafts_through_worker_processes_and_a_lost_worker(tiny_dir: Path) -> None:
    """Two worker processes (speculative forwards and keep lengths over gRPC): the output equals plain
    decoding's, and after kill -9 of the second worker mid-generation the re-planned cluster replays the
    session's forwards, speculative ones included, and the output is still the same."""
    import signal

    from deltafin.checkpoint.config import load_config
    from deltafin.coordinator.cluster.recovery import connect_cluster
    from deltafin.coordinator.cluster.workers import ClusterSpec
    from deltafin.coordinator.engine.engine import Engine
    from deltafin.coordinator.engine.events import Finished
    from deltafin.coordinator.engine.token_loop import Speculation
    from deltafin.text.tokenizer import K3Tokenizer
    from tests.support.cluster import workers

    tok, cfg = K3Tokenizer.load(tiny_dir), load_config(tiny_dir)
    with workers(tiny_dir, 2) as procs:
        addresses = [p.address for p in procs]

        async def run(kill_after: int | None) -> tuple[list[int], list[int], object]:
            backend, _ = await connect_cluster(ClusterSpec(tiny_dir, addresses=addresses, discover=False),
                                               show_progress=False)
            engine = Engine(backend, tok, cfg, "tiny", prefix_cache=True)
            try:
                plain, _ = await _tokens(engine, PROMPT, 24)
                engine._speculation = lambda mode: Speculation(Scripted(PROMPT, plain), _always(4))
                out, end = [], None
                async for e in engine.run(PROMPT, None, Generation(24, ignore_eos=True)):
                    if isinstance(e, Finished):
                        end = e
                        continue
                    out.append(e.token_id)
                    if kill_after is not None and len(out) == kill_after:
                        procs[1].proc.send_signal(signal.SIGKILL)
                return plain, out, (end, list(backend.recoveries))
            finally:
                await engine.close()

        plain, fast, (end, recoveries) = await run(None)
        assert fast == plain and end.drafting.accepted_tokens >= 10 and not recoveries
        plain, fast, (end, recoveries) = await run(8)
        assert fast == plain and len(recoveries) >= 1


def test_generate_json_reports_the_drafting_counts(tiny_dir: Path) -> None:
    import json
    import subprocess

    def generate(*extra: str) -> dict:
        done = subprocess.run([*COORDINATOR, "--model", str(tiny_dir),
                               "--local", "-q", "generate", "a b a b a b a b", "--max-tokens", "16", "--json",
                               *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    plain, fast = generate(), generate("--speculative", "ngram")
    assert fast["ids"] == plain["ids"]
    assert plain["draft_tokens"] == 0 and plain["forwards"] == len(plain["ids"]) - 1
    assert fast["draft_tokens"] > 0 and fast["forwards"] == len(fast["ids"]) - 1 - fast["accepted_tokens"]


def test_a_session_that_may_rewind_holds_its_trail_not_a_state_per_token(pipe) -> None:
    """Between a speculative forward and the next, a KDA layer holds the state from before the forward and
    each token's k, v, decay, beta and conv inputs (stage_parts.kda_trail_bytes), never a state per token."""
    from deltafin.plan.memory.stage_parts import kda_trail_bytes

    stage = pipe.stages[0]
    pipe.forward([SeqInput("m", 0, ids=torch.tensor(PROMPT))])
    plain = stage.sessions["m"].nbytes
    kda = {i: c.state for i, c in stage.sessions["m"].layers.items() if hasattr(c, "state")}
    pipe.forward([SeqInput("m", len(PROMPT), ids=torch.tensor([1, 2, 3]), speculative=True)])
    cache = stage.sessions["m"]
    assert kda and cache.pending and cache.nbytes == plain
    assert cache.trail_bytes == len(kda) * kda_trail_bytes(stage.cfg, 3) <= len(kda) * kda_trail_bytes(stage.cfg)
    assert all(cache.layers[i].state is s for i, s in kda.items())  # the state from before, not a copy
    pipe.forward([SeqInput("m", len(PROMPT) + 3, ids=torch.tensor([4]))])  # all three taken: continue
    assert not cache.pending and cache.nbytes == plain and cache.trail_bytes == 0
    with pytest.raises(InvalidInput, match="at most 9 tokens"):
        pipe.forward([SeqInput("m", len(PROMPT) + 4, ids=torch.arange(10), speculative=True)])
    pipe.release("m")


def test_a_plan_for_drafting_holds_a_full_verification_of_every_sequence(tiny_dir: Path) -> None:
    """With speculative_tokens the session budget has room for each sequence's trail beside its caches: at the
    planned length, every sequence just verified 9 tokens, the stage holds exactly what the plan gave; a plan
    without it would have been short by the trails, which then count against the caches' room."""
    from deltafin.checkpoint.config import load_config
    from deltafin.checkpoint.shards import open_checkpoint
    from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS, SizingOptions
    from deltafin.plan.memory.stage_parts import kda_trail_bytes
    from deltafin.runtime.stage import Stage
    from deltafin.runtime.stage_build import plan_stage
    from deltafin.runtime.stage_options import StageOptions

    cfg = load_config(tiny_dir)
    context, sequences = 256, 2  # one MLA block: the caches are whole at the planned length
    plain = StageOptions(memory_bytes=4 << 30, sizing=SizingOptions(sequences=sequences, context=context))
    drafting = plain.replace(speculative_tokens=SPECULATIVE_TOKENS)  # what serving with --speculative plans
    stage = Stage(open_checkpoint(tiny_dir, cfg), 0, cfg.num_layers, device=torch.device("cpu"), options=drafting)
    try:
        n_kda = sum(kind.name == "KDA" for kind in cfg.layer_kinds)
        reserved = stage.plan.sessions - plan_stage(cfg, 0, cfg.num_layers, torch.device("cpu"), plain).sessions
        assert reserved == sequences * n_kda * kda_trail_bytes(cfg) > 0
        assert stage.plan.prefixes == stage.plan.sessions - reserved  # a kept prefix has no trail
        for sid in ("a", "b"):
            stage.forward([SeqInput(sid, 0, ids=torch.arange(context - SPECULATIVE_TOKENS) % 700)])
            stage.forward([SeqInput(sid, context - SPECULATIVE_TOKENS, ids=torch.arange(SPECULATIVE_TOKENS) + 5,
                                    speculative=True)])
        assert stage.session_bytes() == stage.plan.sessions
        assert stage.session_bytes() > stage.plan.sessions - reserved
    finally:
        stage.close()


def test_verify_bench_reports_a_pass_per_draft_count(small_dir: Path) -> None:
    from deltafin.cli import bench
    from deltafin.runtime.stage_options import StageOptions

    result = bench.bench_verify(small_dir, [1, 8], device="cpu",
                                options=StageOptions(sizing=SizingInput(expert_cache_bytes=10 ** 7)))
    passes = result["passes"]
    assert list(passes) == ["0", "1", "8"] and [p["tokens"] for p in passes.values()] == [1, 2, 9]
    assert 0 < passes["0"]["expert_gb"] < passes["8"]["expert_gb"]  # more tokens route to more experts
    assert passes["8"]["uniform_router_experts_per_layer"] > passes["1"]["uniform_router_experts_per_layer"]
    assert all(p["spine_gb"] == 0 and p["seconds"] > 0 for p in passes.values())  # the spine is resident


# ---- the pass cost fitted to timed passes -----------------------------------------------------------------------


def test_the_fitted_cost_starts_as_the_plan_and_learns_the_passes():
    from deltafin.text.drafting import FittedCost, PassCost, distinct_experts

    plan = PassCost(fixed=1.0, per_expert=0.5, experts=64, active=4)  # what a plan would predict
    cost = FittedCost(plan, experts=64, active=4, longest=9)
    for n in (1, 3, 9):  # two points of a line in distinct experts: the prior is reproduced exactly
        assert cost.seconds(n) == pytest.approx(plan.seconds(n), rel=1e-9)
    # the machine is a quarter as fast per expert and pays 2 s a pass: after many passes that is what it says
    truth = PassCost(fixed=2.0, per_expert=0.125, experts=64, active=4)
    for _ in range(300):
        for n in (1, 2, 5):
            cost.observe(n, truth.seconds(n))
    fixed, slope = cost.terms
    assert fixed == pytest.approx(2.0, rel=0.02) and slope == pytest.approx(0.125, rel=0.05)
    assert cost.seconds(9) == pytest.approx(truth.seconds(9), rel=0.02)
    assert cost.passes == 900 and "900 passes timed" in cost.describe()
    flat = FittedCost(plan, experts=64, active=4)
    for _ in range(200):  # passes that cost less with more tokens (noise): the slope stays at 0, not below
        flat.observe(1, 2.0)
        flat.observe(9, 1.0)
    assert flat.terms[1] == 0 and flat.seconds(9) == pytest.approx(flat.seconds(1))
    assert distinct_experts(1, 64, 4) == pytest.approx(4)
