"""What a worker takes: an assignment that asks for another spine format than the worker was started with is
refused with the reason, never silently run in the plan's format."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import fingerprint
from deltafin.errors import NotAssigned
from deltafin.plan.sizing import SizingOptions
from deltafin.runtime.stage_options import StageOptions
from deltafin.transport import codec
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.worker_info import WorkerDescription
from deltafin.worker.assignment import check_assignment


def _request(tiny_dir, spine: str) -> pb.Assignment:
    return pb.Assignment(start=0, end=6, model_fingerprint=fingerprint(tiny_dir),
                         options=codec.encode_stage_options({"spine": spine}))


def test_a_worker_s_own_spine_is_honoured_or_the_assignment_refused(tiny_dir):
    cfg = load_config(tiny_dir)
    me = WorkerDescription("w", "", "cpu", 1, 1.0, fingerprint(tiny_dir), ((0, 6),), True, spine="q4")
    own = StageOptions(sizing=SizingOptions(spine="q4"))
    options, _ = check_assignment(_request(tiny_dir, "q4"), me, cfg, own)
    assert options.sizing.spine == "q4"
    with pytest.raises(NotAssigned, match=r"started with --spine q4, and the plan holds the spine as int8"):
        check_assignment(_request(tiny_dir, "int8"), me, cfg, own)
    options, _ = check_assignment(_request(tiny_dir, "int8"), me, cfg, StageOptions())  # its own: auto
    assert options.sizing.spine == "int8"
