"""A draft head's features through worker processes: each stage answers the layers it runs, the coordinator
gathers them, and `speculative="draft"` over workers (pipelined and wide) answers what plain decoding does."""

from __future__ import annotations

import asyncio

import pytest
import torch

import deltafin
from deltafin.coordinator.cluster.recovery import connect_cluster
from deltafin.coordinator.cluster.workers import ClusterSpec
from deltafin.runtime.features import FeatureAsk
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from tests.support.cluster import workers
from tests.support.draft_heads import write_random_head

PROMPT = torch.tensor([3, 9, 27, 81, 243, 5, 25, 125, 7, 49])
LAYERS = (1, 4, 8)  # small has 8 layers: 8 is the hidden state entering the final norm


def test_features_cross_the_stages_of_worker_processes(small_dir):
    pipe = LocalPipeline.load(small_dir, 1, device="cpu")
    try:
        want = pipe.forward([SeqInput("f", 0, ids=PROMPT, features=FeatureAsk(LAYERS, 2))])[0].features
    finally:
        pipe.close()
    with workers(small_dir, 2) as procs:
        spec = ClusterSpec(small_dir, addresses=[p.address for p in procs], discover=False, experts="local")

        async def run():
            backend, plan = await connect_cluster(spec, show_progress=False)
            try:
                assert len(plan.stages) == 2  # the asked layers are on both
                return (await backend.forward([SeqInput("f", 0, ids=PROMPT, features=FeatureAsk(LAYERS, 2))]))[0]
            finally:
                await backend.close()

        got = asyncio.run(run()).features
    assert sorted(got) == list(LAYERS)
    for layer in LAYERS:  # the same arithmetic in other processes, the states crossing exactly (fp32)
        assert torch.equal(got[layer], want[layer])


@pytest.mark.parametrize("experts", ["local", "wide"])
def test_drafted_answers_through_workers_are_the_plain_ones(small_dir, tmp_path, experts):
    head = write_random_head(tmp_path / "draft", small_dir)
    messages = [{"role": "user", "content": "Explain `os.path.join`."}]
    with workers(small_dir, 2) as procs:
        addresses = [p.address for p in procs]
        with deltafin.connect(small_dir, addresses, discover=False, progress=False, experts=experts) as m:
            plain = m.chat(messages, max_tokens=16, temperature=0.0).token_ids
        with deltafin.connect(small_dir, addresses, discover=False, progress=False, experts=experts,
                              speculative="draft", draft_model=str(head)) as m:
            drafted = m.chat(messages, max_tokens=16, temperature=0.0).token_ids
            assert m.engine.counters.draft_tokens > 0
    assert drafted == plain
