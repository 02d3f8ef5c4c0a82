"""The Python API (deltafin/api.py) on the `tiny` checkpoint: its greedy output against a plain argmax loop over the
same stages (no Deltafin generation code), streaming against the whole result, chat against K3's chat format,
several threads at once, an early stop freeing the sessions, errors as the project's classes, and `connect` to
worker processes giving what `load` gives."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

import deltafin
from deltafin.checkpoint.config import load_config
from deltafin.errors import DeltafinError, PromptTooLong, SamplingError, SizingError
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.chat import ChatOptions, OutputParser, encode
from deltafin.text.tokenizer import K3Tokenizer
from tests.support.serving import argmax_loop, stop_ids


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    with deltafin.load(tiny_dir, device="cpu", progress=False, max_context=400) as m:
        yield m


@pytest.fixture(scope="module")
def reference(tiny_dir: Path):
    """Greedy continuation by argmax over the raw stages (tests/support/serving.py), with the tokenizer and the
    stop ids."""
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")
    tok = K3Tokenizer.load(tiny_dir)
    stops = stop_ids(tok)
    yield (lambda ids, n: argmax_loop(pipe, ids, n, stops)[0]), tok, stops
    pipe.close()


def test_generate_is_the_greedy_continuation_with_usage_and_timings(model, reference) -> None:
    run, tok, stops = reference
    prompt = "The experts stream from the disk"
    want = run(tok.encode(prompt), 12)
    out = model.generate(prompt, max_tokens=12)
    assert out.token_ids == [t for t in want if t not in stops]
    assert out.text == tok.decode([t for t in out.token_ids if t not in tok.special_ids])  # specials: no text
    assert out.finish_reason == ("stop" if want[-1] in stops else "length")
    assert out.prompt_ids == tok.encode(prompt)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(out.prompt_ids), len(want))
    assert out.timing.decode_steps == len(want) - 1 and out.timing.tokens_per_second > 0
    assert model.generate(out.prompt_ids, max_tokens=12).token_ids == out.token_ids  # ids in, same ids out


def test_stream_pieces_add_up_to_generate_and_the_last_one_carries_the_result(model) -> None:
    prompt = "tokens are bytes"
    whole = model.generate(prompt, max_tokens=10)
    pieces = list(model.stream(prompt, max_tokens=10))
    assert "".join(p.text for p in pieces) == whole.text
    assert [p.token_id for p in pieces if p.token_id is not None][:len(whole.token_ids)] == whole.token_ids
    assert [p.finish_reason for p in pieces[:-1]] == [None] * (len(pieces) - 1)
    last = pieces[-1].completion
    assert pieces[-1].finish_reason == whole.finish_reason
    assert replace(last, timing=whole.timing, usage=whole.usage) == whole
    # the same prompt again: resumed whole from the first call's kept prompt
    assert (last.usage.prompt_tokens, last.usage.cached_tokens) == (whole.usage.prompt_tokens,) * 2


def test_sampling_with_a_seed_repeats_and_differs_from_greedy(model) -> None:
    a = model.generate("a Mac cluster", max_tokens=16, temperature=1.5, seed=3)
    b = model.generate("a Mac cluster", max_tokens=16, temperature=1.5, seed=3)
    greedy = model.generate("a Mac cluster", max_tokens=16)
    assert a.token_ids == b.token_ids and a.token_ids != greedy.token_ids
    assert model.generate("a Mac cluster", max_tokens=16, speculative="ngram").token_ids == greedy.token_ids


def test_chat_renders_k3s_format_and_parses_reasoning_and_answer(model, reference) -> None:
    run, tok, stops = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is an expert?"}]
    reply = model.chat(messages, max_tokens=24, thinking="high")
    ids = encode(tok, messages, ChatOptions(thinking=True, effort="high"))
    assert reply.prompt_ids == ids
    assert reply.token_ids == [t for t in run(ids, 24) if t not in stops]
    parser = OutputParser(tok, thinking=True)  # the channels: K3's output format over exactly those tokens
    deltas = [parser.push(t) for t in reply.token_ids] + [parser.flush()]
    assert reply.reasoning == "".join(d.reasoning for d in deltas) and reply.reasoning
    assert reply.content == "".join(d.content for d in deltas)
    off = model.chat(messages, max_tokens=8, thinking="off")
    assert off.prompt_ids == encode(tok, messages, ChatOptions(thinking=False, effort=None))
    assert off.reasoning == "" and off.message["role"] == "assistant" and off.message["content"] == off.text
    pieces = list(model.chat_stream(messages, max_tokens=24, thinking="high"))
    assert "".join(p.reasoning for p in pieces) == reply.reasoning
    assert "".join(p.text for p in pieces) == reply.content


def test_threads_generate_at_once_and_each_gets_its_own_output(model) -> None:
    prompts = ["alpha beta", "the experts stream", "tokens are bytes", "a Mac cluster"]
    alone = [model.generate(p, max_tokens=8).token_ids for p in prompts]
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, model.generate(prompts[i], 8).token_ids))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together[i] for i in range(len(prompts))] == alone


def test_leaving_a_stream_early_frees_its_session(model) -> None:
    sessions = lambda: sum(s.sessions for s in model.stats())
    stream = model.stream("a long story", max_tokens=200)
    assert next(stream).token_id is not None and sessions() == 1
    stream.close()
    for _ in range(100):  # the cancellation reaches the engine on its own thread
        if sessions() == 0:
            break
        threading.Event().wait(0.05)
    assert sessions() == 0
    assert model.generate("after", max_tokens=2).usage.completion_tokens == 2  # and the model still works


def test_stats_are_each_stages_typed_counters(model, tiny_dir) -> None:
    """`Model.stats()`: one StageStats per stage, counting the tokens its forwards carried (the prompt's and every
    generated token but the last, which is never fed back), with its plan; `as_dict()` is plain JSON."""
    (before,) = model.stats()
    out = model.generate("counted tokens, a fresh prompt", max_tokens=5)
    (after,) = model.stats()
    assert isinstance(after, deltafin.StageStats) and after.ready
    assert after.layers == (0, load_config(tiny_dir).num_layers)
    fed, forwards = out.usage.prompt_tokens + out.usage.completion_tokens - 1, out.usage.completion_tokens
    assert after.tokens - before.tokens == fed and after.forwards - before.forwards == forwards
    assert after.plan is not None and after.plan.end == after.layers[1]
    as_json = json.loads(json.dumps(after.as_dict()))
    assert as_json["tokens"] == after.tokens and as_json["layers"] == list(after.layers)
    assert as_json["plan"]["total"] == after.plan.total


def test_errors_are_the_projects_classes_with_the_option_named(model, tiny_dir) -> None:
    with pytest.raises(DeltafinError, match="max_tokens must be at least 1"):
        model.generate("x", max_tokens=0)
    with pytest.raises(SamplingError, match="temperature"):
        model.generate("x", temperature=-1)
    with pytest.raises(PromptTooLong, match="context limit of 400"):
        model.generate("x " * 500, max_tokens=4)
    with pytest.raises(DeltafinError, match="thinking must be one of"):
        model.chat([{"role": "user", "content": "x"}], thinking="medium-rare")
    with pytest.raises(DeltafinError, match="0..1023"):
        model.generate([5, 99999])
    with pytest.raises(DeltafinError, match="unknown option 'memory_gbb'.*memory_gb"):
        deltafin.load(tiny_dir, memory_gbb=3)
    with pytest.raises(DeltafinError, match="invalid choice: 'tpu'"):
        deltafin.load(tiny_dir, device="tpu")
    with pytest.raises(DeltafinError, match="no config.json"):
        deltafin.load(tiny_dir / "nowhere")
    with pytest.raises(DeltafinError, match="no workers"):
        deltafin.connect(tiny_dir, discover=False)


def test_an_impossible_budget_is_refused_before_anything_loads(tiny_dir, monkeypatch) -> None:
    """`memory_gb=0` is refused, naming the keyword; a budget below the least a stage needs says that least, before a
    stage loads (none is built here: building one fails the test)."""
    def loads(*_args, **_kwargs):
        raise AssertionError("a stage was loaded")

    monkeypatch.setattr("deltafin.runtime.pipeline.Stage", loads)
    with pytest.raises(DeltafinError, match="^memory_gb must be more than 0$"):
        deltafin.load(tiny_dir, device="cpu", progress=False, memory_gb=0)
    with pytest.raises(SizingError, match=r"^layers 0-5 cannot fit on cpu: they need at least 1\.\d\d GB \(.*\), and "
                                          r"the budget is 0\.30 GB\. Give it more memory"):
        deltafin.load(tiny_dir, device="cpu", progress=False, memory_gb=0.3)


def test_the_articles_engine_gives_the_generated_text(tiny_dir, reference) -> None:
    """`from deltafin import KimiK3Engine; engine = KimiK3Engine(model_path=..., device=...)`, then
    `engine.generate(prompt, max_length=...)`: the text of up to max_length greedy tokens."""
    from deltafin import KimiK3Engine

    run, tok, stops = reference
    with KimiK3Engine(model_path=tiny_dir, device="cpu", progress=False) as engine:
        text = engine.generate("Kimi K3 on a Mac", max_length=10)
    assert text == tok.decode([t for t in run(tok.encode("Kimi K3 on a Mac"), 10) if t not in tok.special_ids])


def test_connect_to_worker_processes_gives_what_load_gives(tiny_dir, model) -> None:
    from tests.support.cluster import workers

    want = model.generate("the experts stream", max_tokens=8)
    with workers(tiny_dir, 2) as procs, deltafin.connect(tiny_dir, [p.address for p in procs], discover=False,
                                                          progress=False) as remote:
        got = remote.generate("the experts stream", max_tokens=8)
        assert len(remote.engine.backend.stages) == 2
    assert got.token_ids == want.token_ids and got.text == want.text


def test_connect_finds_workers_by_discovery(tiny_dir, model) -> None:
    """Workers announced over zeroconf (on loopback only) are found and planned as the coordinator's CLI does."""
    from tests.support.cluster import workers

    want = model.generate("a Mac cluster", max_tokens=6)
    with workers(tiny_dir, 2, announce=True, prefix="api") as procs, deltafin.connect(
            tiny_dir, interface=["127.0.0.1"], expect=2, progress=False) as found:
        assert sorted(s.address for s in found.engine.backend.stages) == sorted(p.address for p in procs)
        assert found.generate("a Mac cluster", max_tokens=6).token_ids == want.token_ids


def test_the_readmes_example_runs_as_written(tmp_path) -> None:
    """The README's Python API block, on the bundled k3-mini, in a fresh interpreter: it prints what the API
    gives in this process."""
    import re
    import subprocess
    import sys

    from deltafin.paths import bundled_model

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    with deltafin.load(bundled_model(), device="cpu", progress=False) as m:
        out = m.generate("def read_lines(path):", max_tokens=16)
        source = m.generate("# Lib/textwrap.py", max_tokens=16).text
        reply = m.chat([{"role": "user", "content": "What does `json.dumps` do?"}], max_tokens=64)
        body = m.generate("def heappush(heap, item):\n", max_tokens=24).text
    want = (re.escape(f"{out.text!r} {out.finish_reason} {out.usage.completion_tokens} ") + r"\d+ tok/s\n"
            + re.escape(f"{source}\n{reply.finish_reason}\n{reply.reasoning}\n{reply.content}\n{body}\n"))
    assert re.fullmatch(want, run.stdout), run.stdout
    assert body.startswith("    ") and body.count("\n") >= 1  # what the comment promises: an indented body


def test_an_expert_mode_generates_its_own_models_text_with_or_without_drafts(tiny_dir) -> None:
    """In top-p, greedy text is the argmax loop over stages in that mode (not exact's), and n-gram drafts verified
    in the mode give the same text: verification is exact against the mode's own model."""
    from deltafin.runtime.stage_options import StageOptions

    prompt = "a b a b a b a b a b"
    tok = K3Tokenizer.load(tiny_dir)
    runs = {}
    for mode in ("exact", "top-p:0.5"):
        pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32", options=StageOptions(expert_mode=mode))
        runs[mode] = [t for t in argmax_loop(pipe, tok.encode(prompt), 16, stop_ids(tok))[0] if t not in stop_ids(tok)]
        pipe.close()
    assert runs["exact"] != runs["top-p:0.5"]  # the mode is another model: its own text
    with deltafin.load(tiny_dir, device="cpu", progress=False, expert_mode="top-p:0.5") as m:
        plain = m.generate(prompt, max_tokens=16)
        drafted = m.generate(prompt, max_tokens=16, speculative="ngram")
    assert plain.token_ids == drafted.token_ids == runs["top-p:0.5"]
