"""The coordinator's option groups: --speculative plans every sequence room for a verification, on workers (the
planner's sizing) and in process (--local)."""

from __future__ import annotations

from pathlib import Path

from deltafin.coordinator.main import build_parser
from deltafin.coordinator.options import cluster_spec, open_backend
from deltafin.plan.sizing import SPECULATIVE_TOKENS


def _args(model: Path, *extra: str):
    return build_parser().parse_args(["--model", str(model), "--memory-gb", "2", "generate", "hi", *extra])


def test_speculative_decoding_is_planned_for_on_workers_and_in_process(tiny_dir: Path) -> None:
    assert cluster_spec(_args(tiny_dir, "--speculative", "ngram")).sizing.speculative_tokens == SPECULATIVE_TOKENS
    assert cluster_spec(_args(tiny_dir)).sizing.speculative_tokens == 0
    assert cluster_spec(build_parser().parse_args(["--model", str(tiny_dir), "plan", "--speculative", "ngram"])
                        ).sizing.speculative_tokens == SPECULATIVE_TOKENS


async def test_local_stages_get_the_speculative_reservation(tiny_dir: Path) -> None:
    sessions = {}
    for mode in ("none", "ngram"):
        backend = await open_backend(_args(tiny_dir, "--local", "--speculative", mode))
        try:
            (stage,) = backend.pipeline.stages
            assert stage.options.speculative_tokens == (SPECULATIVE_TOKENS if mode == "ngram" else 0)
            sessions[mode] = stage.sizing.sessions
        finally:
            await backend.close()
    assert sessions["ngram"] > sessions["none"]
