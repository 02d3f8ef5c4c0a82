"""What the coordinator opens from its typed options: --speculative plans every sequence room for a verification,
on workers (the planner's sizing) and in process (--local)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltafin.checkpoint.config import load_config
from deltafin.cli.coordinator import build_parser
from deltafin.cli.flags import cluster_from_args, serving_from_args, stage_from_args
from deltafin.coordinator.cluster.connect import cluster_spec
from deltafin.coordinator.engine.engine import open_engine, planned_stage
from deltafin.errors import DeltafinError
from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS


def _args(model: Path, *extra: str):
    return build_parser().parse_args(["--model", str(model), "--memory-gb", "2", "generate", "hi", *extra])


def _spec(args):
    stage = planned_stage(stage_from_args(args), serving_from_args(args))
    return cluster_spec(cluster_from_args(args), stage, load_config(args.model))


def test_speculative_decoding_is_planned_for_on_workers_and_in_process(tiny_dir: Path) -> None:
    assert _spec(_args(tiny_dir, "--speculative", "ngram")).sizing.speculative_tokens == SPECULATIVE_TOKENS
    assert _spec(_args(tiny_dir)).sizing.speculative_tokens == 0
    assert _spec(build_parser().parse_args(["--model", str(tiny_dir), "plan", "--speculative", "ngram"])
                 ).sizing.speculative_tokens == SPECULATIVE_TOKENS


async def test_local_stages_get_the_speculative_reservation(tiny_dir: Path) -> None:
    sessions = {}
    for mode in ("none", "ngram"):
        args = _args(tiny_dir, "--local", "--speculative", mode)
        engine = await open_engine(cluster_from_args(args), stage_from_args(args), serving_from_args(args),
                                   show_progress=False)
        try:
            (stage,) = engine.backend.pipeline.stages
            assert stage.options.speculative_tokens == (SPECULATIVE_TOKENS if mode == "ngram" else 0)
            sessions[mode] = stage.plan.sessions
        finally:
            await engine.close()
    assert sessions["ngram"] > sessions["none"]


async def test_a_start_parses_config_json_once(tiny_dir: Path, monkeypatch) -> None:
    """Opening the engine (config, tokenizer, in-process stages) reads config.json one time."""
    from deltafin.checkpoint import config

    calls = []
    parse = config.parse_config
    monkeypatch.setattr(config, "parse_config", lambda raw: calls.append(1) or parse(raw))
    args = _args(tiny_dir, "--local")
    engine = await open_engine(cluster_from_args(args), stage_from_args(args), serving_from_args(args),
                               show_progress=False)
    await engine.close()
    assert len(calls) == 1


def test_a_mistyped_worker_address_is_refused_before_any_lookup(tiny_dir: Path, capsys) -> None:
    """`--worker localhost7070` (and the Python API's workers=[...]) is one line saying what an address is, not a
    name resolver's error after a timeout."""
    import deltafin
    from deltafin.cli.coordinator import main

    assert main(["--model", str(tiny_dir), "--worker", "localhost7070", "--no-discover", "plan"]) == 1
    assert capsys.readouterr().err == ("error: --worker 'localhost7070': HOST:PORT expected (port 1-65535; IPv6 as "
                                       "[::1]:7070)\n")
    with pytest.raises(DeltafinError, match=r"^worker 'h:99999': HOST:PORT expected"):
        deltafin.connect(tiny_dir, workers=["h:99999"], discover=False)
