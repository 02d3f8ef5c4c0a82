"""A flag and a Python keyword become the same typed value: the command line's option groups and the Python API
build ClusterOptions, StageOptions (with its SizingOptions) and ServingOptions through one rule, and a bad value
fails when the value is built, with its flag named, before anything loads."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltafin.api import model_options
from deltafin.cli.coordinator import build_parser as coordinator_parser
from deltafin.cli.flags import cluster_from_args, sampling_from_args, serving_from_args, stage_from_args
from deltafin.cli.worker import build_parser as worker_parser
from deltafin.errors import DeltafinError

FLAGS = ["--memory-gb", "3", "--spine", "int8", "--prefill-chunk", "600", "--threads", "3", "--policy", "lru",
         "--no-prefetch", "--expert-dir", "/disk2", "--prefix-disk-gb", "0", "--dtype", "bf16", "--local",
         "--local-stages", "2", "--worker-timeout", "4"]
KEYWORDS = {"memory_gb": 3, "spine": "int8", "prefill_chunk": 600, "read_threads": 3, "cache_policy": "lru",
            "prefetch": False, "expert_dir": ["/disk2"], "prefix_disk_gb": 0, "dtype": "bf16", "local_stages": 2,
            "worker_timeout": 4, "max_active": 2, "max_context": 8192}


def _from_flags(model: Path, *extra: str):
    args = coordinator_parser().parse_args(["--model", str(model), *FLAGS, "serve", "--max-active", "2",
                                            "--max-context", "8192", *extra])
    return cluster_from_args(args), stage_from_args(args), serving_from_args(args)


def test_the_flags_and_the_python_keywords_build_the_same_options(tmp_path: Path) -> None:
    cluster, stage, serving = _from_flags(tmp_path)
    assert (cluster, stage, serving) == model_options(tmp_path, KEYWORDS, local=True, device="auto")
    assert stage.memory_bytes == 3 * 10**9 and stage.expert_dir == ("/disk2",)
    assert stage.dtype == "bf16" and stage.torch_dtype == torch.bfloat16
    assert (stage.sizing.spine, stage.sizing.prefill_chunk, stage.sizing.read_threads) == ("int8", 600, 3)
    assert (stage.cache_policy, stage.prefetch, stage.prefix_dir) == ("lru", False, None)
    assert (cluster.local, cluster.local_stages, cluster.worker_timeout) == (True, 2, 4.0)
    assert (serving.max_active, stage.sizing.context) == (2, 8192)


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["bench"], ["plan"]])
def test_max_context_is_one_flag_on_every_command_that_generates(tmp_path: Path, command) -> None:
    """--max-context is the plan's context wherever the model runs (before: serve's own, and --context
    elsewhere); --context, its name before, still parses to the same value."""
    parse = lambda *flags: stage_from_args(coordinator_parser().parse_args(["--model", str(tmp_path), *command,
                                                                            *flags]))
    assert parse("--max-context", "8192").sizing.context == parse("--context", "8192").sizing.context == 8192
    assert parse().sizing.context is None  # the plan's: the longest the memory holds, at most the model's own


def test_chat_and_the_worker_take_max_context(tmp_path: Path) -> None:
    from deltafin.cli.commands import build_parser

    chat = build_parser().parse_args(["chat", "--model", str(tmp_path), "--local", "--max-context", "512"])
    assert stage_from_args(chat).sizing.context == 512
    assert stage_from_args(worker_parser().parse_args(["--model", str(tmp_path), "--max-context", "512"])
                           ).sizing.context == 512


def test_old_flag_spellings_are_aliases_of_the_ones_named_like_the_fields(tmp_path: Path) -> None:
    new = ["--read-threads", "3", "--cache-policy", "lru"]
    old = ["--threads", "3", "--policy", "lru"]
    parse = lambda flags: stage_from_args(worker_parser().parse_args(["--model", str(tmp_path), *flags]))
    assert parse(new) == parse(old) != parse([])


def test_kept_prefixes_go_to_the_cache_directory_unless_the_disk_budget_is_zero(tmp_path: Path) -> None:
    parse = lambda *flags: stage_from_args(worker_parser().parse_args(["--model", str(tmp_path), *flags]))
    assert parse().prefix_dir.endswith("prefixes") and parse().prefix_disk_bytes is None  # the model's default
    assert parse("--prefix-disk-gb", "0.5").prefix_disk_bytes == 5 * 10**8
    assert parse("--prefix-dir", str(tmp_path)).prefix_dir == str(tmp_path)
    assert parse("--prefix-disk-gb", "0").prefix_dir is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--sequences", "0"], "--sequences must be at least 1"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1"),
    (["--threads", "0"], "--read-threads must be at least 1"),
    (["--memory-gb", "-1"], "--memory-gb must be more than 0"),
    (["--memory-gb", "0"], "--memory-gb must be more than 0"),
    (["--expert-cache-gb", "-2"], "--expert-cache-gb must not be negative"),
    (["--max-resident-layers", "-1"], "--max-resident-layers must not be negative"),
    (["--prefix-disk-gb", "-1"], "--prefix-disk-gb must not be negative"),
])
def test_a_bad_stage_value_fails_when_built_with_its_flag_named(tmp_path: Path, flags, message) -> None:
    with pytest.raises(DeltafinError, match=message):
        stage_from_args(worker_parser().parse_args(["--model", str(tmp_path), *flags]))


def test_bad_serving_and_cluster_values_fail_before_anything_loads(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"  # nothing is read: the values fail first
    with pytest.raises(DeltafinError, match="--max-active and --default-max-tokens must be >= 1"):
        _from_flags(missing, "--queue-depth", "-1")
    with pytest.raises(DeltafinError, match="max_active and .*must be >= 1"):
        model_options(missing, {"max_active": 0}, local=True, device="cpu")
    with pytest.raises(DeltafinError, match="worker_timeout and forward_timeout must be positive"):
        model_options(missing, {"worker_timeout": 0}, local=True, device="cpu")
    with pytest.raises(DeltafinError, match="spine: invalid choice: 'fp4'"):
        model_options(missing, {"spine": "fp4"}, local=True, device="cpu")


def test_the_sampling_flags_are_one_sampling_value(tmp_path: Path) -> None:
    args = coordinator_parser().parse_args(["--model", str(tmp_path), "generate", "hi", "--temperature", "0.5",
                                            "--top-k", "7", "--seed", "3"])
    params = sampling_from_args(args)
    assert (params.temperature, params.top_k, params.seed, params.top_p) == (0.5, 7, 3, 1.0)


def test_every_flags_name_is_a_python_keyword_too(tmp_path: Path) -> None:
    """--threads, --policy and the --no-X switches keep their names as keywords (threads=3, no_prefetch=True)."""
    old = {"threads": 3, "policy": "lru", "no_prefetch": True, "no_recovery": True}
    new = {"read_threads": 3, "cache_policy": "lru", "prefetch": False, "recovery": False}
    assert model_options(tmp_path, old, local=True) == model_options(tmp_path, new, local=True)
    assert model_options(tmp_path, {"no_discover": True}) == model_options(tmp_path, {"discover": False})


def test_the_experts_heat_is_remembered_in_the_cache_directory_unless_switched_off(tmp_path: Path) -> None:
    from deltafin.paths import cache_dir
    from deltafin.runtime.stage_options import StageOptions

    parse = lambda *flags: stage_from_args(worker_parser().parse_args(["--model", str(tmp_path), *flags]))
    assert parse().expert_heat_dir == str(cache_dir("heat")) and parse("--no-expert-heat").expert_heat_dir is None
    assert "--no-expert-heat" in worker_parser().format_help()
    off = model_options(tmp_path, {"no_expert_heat": True}, local=True)
    assert off == model_options(tmp_path, {"expert_heat": False}, local=True) and off[1].expert_heat_dir is None
    assert StageOptions().expert_heat_dir is None  # a bare value remembers nothing (as it keeps no prefix on disk)


def _parsers():
    """Every parser of the three programs: (program and command, parser)."""
    from deltafin.cli.commands import build_parser as deltafin_parser

    todo = [("deltafin", deltafin_parser()), ("deltafin-coordinator", coordinator_parser()),
            ("deltafin-worker", worker_parser())]
    while todo:
        name, p = todo.pop()
        yield name, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {command}", sub) for command, sub in action.choices.items()]


def test_every_option_flag_is_made_from_its_field():
    """A flag of an option field has the field's default (or its size in GB), its choices and its help, written
    once in the field: across every command of the three programs, the only defaults that differ are the ones a
    command sets for itself, listed here."""
    from deltafin.coordinator.cluster.cluster_options import ClusterOptions
    from deltafin.coordinator.engine.serving_options import ServingOptions
    from deltafin.options import GB, gb_name
    from deltafin.plan.memory.sizing_options import SizingOptions
    from deltafin.runtime.stage_options import StageOptions
    from deltafin.text.sampling_params import SamplingParams
    from deltafin.worker.worker_options import WorkerOptions

    fields = {}  # (a name two types share, the worker's and the coordinator's --device or --cluster-key: one default)
    for cls in (StageOptions, SizingOptions, ClusterOptions, ServingOptions, SamplingParams, WorkerOptions):
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                gb = gb_name(f.name)
                default = f.default / GB if gb and f.default is not None else f.default
                fields[gb or f.name] = (list(default) if isinstance(default, tuple) else default, f.metadata["flag"])
    seen, differ = set(), set()
    for program, parser in _parsers():
        for action in parser._actions:
            if not hasattr(action, "option_field"):  # not an option field's (convert --spine: the format to write)
                continue
            default, flag = fields[action.dest]
            seen.add(action.dest)
            if action.help != argparse.SUPPRESS and action.choices is not None:
                choices = flag.choices() if callable(flag.choices) else flag.choices  # a registry's, as it is now
                assert tuple(action.choices) == choices, (program, action.dest)
            if action.default not in (default, argparse.SUPPRESS):
                differ.add((program.split()[-1], action.dest, action.default))
    assert seen == set(fields)  # every field declared for the command line has its flag somewhere
    # one user's commands plan one sequence; a chat samples, generating a benchmark's tokens is greedy
    assert differ == {("bench", "sequences", 1), ("logits", "sequences", 1), ("chat", "temperature", 0.6),
                      ("generate", "temperature", 0.0)}, differ


def test_the_help_is_made_without_torch_or_grpc():
    """Every command's --help is made from the option types without loading torch or gRPC (they take seconds)."""
    code = ("import sys\nfrom deltafin.cli.commands import build_parser\np = build_parser()\n"
            "for command in ('chat', 'serve', 'bench', 'inspect', 'demo'):\n"
            "    p._subparsers._group_actions[0].choices[command].format_help()\n"
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
