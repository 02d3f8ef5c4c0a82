"""`deltafin-coordinator plan` ends with each worker's `deltafin download` command: its stage's layers, or with
wide experts its share of every layer's experts, exactly what the planner placed on it."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest

from deltafin.checkpoint.config import load_config
from deltafin.cli.commands import build_parser
from deltafin.cli.coordinator_commands import download_commands
from deltafin.download.fetch import parse_experts, parse_layers
from deltafin.plan.cluster.cluster_plan import WorkerCapacity
from deltafin.plan.cluster.expert_placement import split
from deltafin.plan.planner import plan_layers

GB = 10**9
K3_CONFIG = Path(__file__).resolve().parents[3] / "tests" / "data" / "kimi-k3-config.json"


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3cfg")
    shutil.copy(K3_CONFIG, d / "config.json")
    return load_config(d)


def _workers(n: int, speeds=None) -> list[WorkerCapacity]:
    return [WorkerCapacity(f"mac{i}", 56 * GB, (speeds or [6.6] * n)[i], ((0, 93),), True, f"10.0.0.{i}:7070",
                           worker_id=f"mac{i}") for i in range(n)]


def _args(line: str, worker: str):
    name, command = line.strip().split(": ", 1)
    assert name == worker
    argv = shlex.split(command)
    assert argv[:2] == ["deltafin", "download"]
    return build_parser().parse_args(argv[1:])


def test_local_stages_download_their_layers(k3):
    plan = plan_layers(k3, _workers(4), experts="local")
    lines = download_commands(plan)
    assert lines[0].startswith("put the model on each worker") and len(lines) == 1 + len(plan.stages)
    for line, stage in zip(lines[1:], plan.stages, strict=True):
        args = _args(line, stage.worker)
        assert parse_layers(args.layers, 93) == (stage.start, stage.end) and args.experts is None


def test_wide_workers_download_every_layer_and_the_experts_the_planner_placed_on_them(k3):
    for speeds in ([6.6] * 4, [9.9, 3.3, 6.6, 6.6]):
        plan = plan_layers(k3, _workers(4, speeds), experts="wide")
        placement = plan.experts
        lines = download_commands(plan)
        for line, s in zip(lines[1:], plan.workers, strict=True):
            args = _args(line, s.worker)
            i = placement.holders.index(s.key)
            lo, hi = parse_experts(args.experts, 896)
            assert args.layers is None  # every layer: each worker computes its share of all of them
            assert all(placement.share(i, layer) == range(lo, hi) for layer in placement.layers)
        if len(set(speeds)) > 1:  # unequal disks, unequal shares: written as ids
            assert all("/" not in line for line in lines[1:])


def test_equal_shares_are_written_k_of_n(k3):
    from deltafin.plan.cluster.cluster_plan import ClusterPlan
    from deltafin.plan.cluster.expert_placement import ExpertRanges

    plan = plan_layers(k3, _workers(4), experts="wide")
    equal = ExpertRanges.build(plan.experts.holders, k3.moe_layers, 896, lambda i, layer: 1.0)
    lines = download_commands(ClusterPlan(plan.stages, plan.holders, equal))
    assert [line.rsplit(" ", 1)[1] for line in lines[1:]] == ["0/4", "1/4", "2/4", "3/4"]
    assert split(0, 896, [1.0] * 4) == equal.bounds_of(1)
