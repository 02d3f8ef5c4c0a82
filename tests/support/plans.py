"""A stage's plan as a coordinator sends it in an Assignment, made as a coordinator makes it (the tests that assign a
worker directly, without a coordinator)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import scan_checkpoint
from deltafin.plan.memory.sizing_options import SizingInput, SizingOptions
from deltafin.runtime.stage_build import plan_stage
from deltafin.runtime.stage_options import AssignmentOptions, StageOptions
from deltafin.transport import codec
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.weights.reader import layer_spans

OPTION_FIELDS = frozenset(AssignmentOptions.__dataclass_fields__)  # how a stage computes, not holds
PLANNER_FIELDS = frozenset(f.name for f in dataclasses.fields(SizingInput)) - {
    f.name for f in dataclasses.fields(SizingOptions)}  # session_bytes, ...: the planner's, never an option


PLAN_BUDGET = 4 * 10**9  # the memory a test's plan is made in, as a coordinator plans in a worker's: a tiny model's
# stage fits it whole, and any worker of the test machine holds it


def stage_plan(model: Path, start: int, end: int, **knobs: Any) -> pb.StagePlan:
    """The plan of layers [start, end) of `model` on a CPU within PLAN_BUDGET with the sizing `knobs` (StageOptions'
    and SizingOptions' names: session_bytes=..., max_resident_layers=...), as the Assignment carries it."""
    cfg = load_config(model)
    known = {k: v for k, v in knobs.items() if k in PLANNER_FIELDS}  # what a coordinator's planner fixes itself
    options = StageOptions(memory_bytes=PLAN_BUDGET).replace(**{k: v for k, v in knobs.items() if k not in known})
    z = plan_stage(cfg, start, end, torch.device("cpu"), options, layer_spans(scan_checkpoint(model, cfg)),
                   known=known)
    return codec.encode_stage_plan(z)


def assignment(model: Path, fingerprint: str, start: int, end: int, **values: Any) -> pb.Assignment:
    """An Assignment of layers [start, end): the values that are options as its options, the others (sizing
    knobs) as its plan (none: the worker plans the stage)."""
    options = {k: v for k, v in values.items() if k in OPTION_FIELDS}
    knobs = {k: v for k, v in values.items() if k not in OPTION_FIELDS}
    request = pb.Assignment(start=start, end=end, model_fingerprint=fingerprint,
                            options=codec.encode_stage_options(AssignmentOptions(**options)))
    if knobs:
        request.plan.CopyFrom(stage_plan(model, start, end, **knobs))
    return request
