"""A draft head's features (runtime/features.py): the hidden states entering the asked layers, from the asked
position on, the same however the layers are split into stages, and the final one the logits are made of."""

from __future__ import annotations

import pytest
import torch

from deltafin.errors import InvalidInput
from deltafin.kernels.linear import linear
from deltafin.models.common import rms_norm
from deltafin.models.decoder import layer_input
from deltafin.runtime.features import FeatureAsk
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.transport import codec, forward_parts

PROMPT = torch.tensor([5, 17, 3, 99, 42, 7, 250, 8, 61, 12])


@pytest.fixture(scope="module")
def pipes(tiny_dir):
    loaded = {n: LocalPipeline.load(tiny_dir, n, device="cpu") for n in (1, 2, 3)}
    yield loaded
    for p in loaded.values():
        p.close()


def _ask(pipe, layers, start, sid, ids=PROMPT, cache_len=0, all_logits=False):
    return pipe.forward([SeqInput(sid, cache_len, ids=ids, features=FeatureAsk(layers, start))], all_logits)[0]


def test_features_are_the_same_however_the_layers_are_split(pipes):
    layers = (0, 2, 3, 5, 6)  # 6 = num_layers: the hidden state entering the final norm
    outs = {n: _ask(p, layers, 4, f"split{n}") for n, p in pipes.items()}
    for out in outs.values():
        assert sorted(out.features) == list(layers)
        assert all(f.shape == (len(PROMPT) - 4, 64) and f.dtype == torch.float32 for f in out.features.values())
    for layer in layers:  # one process's arithmetic, each stage running its own layers: bit for bit
        assert torch.equal(outs[1].features[layer], outs[2].features[layer])
        assert torch.equal(outs[1].features[layer], outs[3].features[layer])


def test_a_layers_features_are_what_enters_it_and_the_last_make_the_logits(pipes):
    pipe = pipes[2]  # stages [0, 3) and [3, 6)
    first, second = pipe.stages
    hop = first.forward([SeqInput("hop", 0, ids=PROMPT)])[0].state
    out = _ask(pipe, (3, 6), 0, "final", all_logits=True)
    entering = layer_input(second.spine.layer(3), hop)  # the hop is the state entering layer 3
    assert torch.allclose(out.features[3], entering.float(), atol=0, rtol=0)
    top, cfg = second.top, second.cfg
    logits = linear(rms_norm(out.features[6], top.norm, cfg.rms_norm_eps), top.head).float()
    assert torch.allclose(logits, out.logits, atol=1e-5, rtol=1e-5)  # the head's own math on the same rows


def test_a_prompt_in_chunks_gives_the_rows_from_the_asked_position(pipes):
    pipe = pipes[1]
    whole = _ask(pipe, (2, 6), 3, "whole")
    a = _ask(pipe, (2, 6), 3, "chunks", ids=PROMPT[:6])
    b = _ask(pipe, (2, 6), 3, "chunks", ids=PROMPT[6:], cache_len=6)
    for layer in (2, 6):
        assert a.features[layer].shape[0] == 3 and b.features[layer].shape[0] == 4
        joined = torch.cat([a.features[layer], b.features[layer]])
        # KDA's chunked and per-piece recurrences agree to fp32 rounding, not bit for bit
        assert torch.allclose(joined, whole.features[layer], atol=1e-4, rtol=1e-4)
    late = _ask(pipe, (2,), 50, "late")  # no row from the asked position on: nothing
    assert late.features == {}


def test_features_cross_the_wire_in_parts(pipes):
    out = _ask(pipes[1], (0, 6), 0, "wire", all_logits=True)
    parts = forward_parts.encode_output_parts([out], max_bytes=4096)  # the logits in several parts
    assert len(parts) > 1
    back = forward_parts.decode_output_parts(parts)[0]
    assert sorted(back.features) == [0, 6]
    assert all(torch.equal(back.features[k], out.features[k]) for k in (0, 6))
    ask = SeqInput("w", 0, ids=PROMPT, features=FeatureAsk((1, 4), 2))
    assert codec.decode_inputs(codec.encode_inputs([ask]))[0].features == FeatureAsk((1, 4), 2)


@pytest.mark.parametrize("ask", [FeatureAsk((3, 1)), FeatureAsk((1, 1)), FeatureAsk((7,)), FeatureAsk((1,), -1),
                                 FeatureAsk(())])
def test_a_bad_ask_is_refused_before_anything_runs(pipes, ask):
    with pytest.raises(InvalidInput, match="feature|negative"):
        pipes[1].forward([SeqInput("bad", 0, ids=PROMPT, features=ask)])
