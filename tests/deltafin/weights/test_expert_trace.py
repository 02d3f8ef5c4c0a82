"""The expert recorder: what each layer asked for, in order, and the provider it wraps still answering."""

from __future__ import annotations

from typing import Any

from deltafin.weights.expert_trace import ExpertRecorder


class _Provider:
    io = "direct"

    def experts(self, layer: int, ids: list[int]) -> list[tuple[int, Any]]:
        return [(e, f"{layer}:{e}") for e in ids]


def test_the_recorder_records_each_layers_experts_and_passes_them_through() -> None:
    recorder = ExpertRecorder(_Provider())
    ids = [3, 1]
    assert recorder.experts(2, ids) == [(3, "2:3"), (1, "2:1")]
    ids.append(7)  # the trace keeps its own copy
    assert recorder.experts(4, [0]) == [(0, "4:0")]
    assert recorder.trace == [(2, [3, 1]), (4, [0])]
    assert recorder.io == "direct"  # everything else is the provider's
