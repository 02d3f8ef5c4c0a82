"""Expert-major prefill: a prompt in one forward (its attention in pieces of PIECE_TOKENS, each layer's routed
experts once over every row) gives the logits of the same prompt in forwards of 512 tokens and of one token at a
time, on the hold-out-sized checkpoints; a decode step riding in the same forward gets its own logits.

Tolerance: fp32 throughout, and the three paths sum in different orders (MLA's key blocks, KDA's chunk
boundaries, expert rows batched differently), so they differ by rounding: ~1e-6 relative on `small`, measured.
1e-5 relative to the logits' scale leaves room for other CPUs' BLAS kernels and is still far below what a wrong
state (a piece that missed its history) gives (~1e-1).
"""

from __future__ import annotations

import pytest
import torch

from deltafin.models.pieces import PIECE_TOKENS
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions

PROMPT = PIECE_TOKENS + 188  # two attention pieces in one forward, two forwards of at most 512


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab - 256, (PROMPT,), generator=torch.Generator().manual_seed(7))


def _last_logits(pipe: LocalPipeline, name: str, ids: torch.Tensor, step: int) -> torch.Tensor:
    out = None
    for pos in range(0, len(ids), step):
        (out,) = pipe.forward([SeqInput(name, pos, ids=ids[pos:pos + step])])
    pipe.release(name)
    return out.logits[-1]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("model", ["tiny_dir", "small_dir"])
def test_one_forward_equals_chunks_of_512_and_token_by_token(model, request):
    model_dir = request.getfixturevalue(model)
    pipe = LocalPipeline.load(model_dir, 2, device="cpu",
                              options=StageOptions(sizing=SizingOptions(prefill_chunk=PROMPT)))
    try:
        ids = _prompt(pipe.stages[0].cfg.vocab_size)
        whole = _last_logits(pipe, "whole", ids, PROMPT)
        chunks = _last_logits(pipe, "chunks", ids, 512)
        steps = _last_logits(pipe, "steps", ids, 1)
    finally:
        pipe.close()
    assert _close(whole, chunks) <= 1e-5 and _close(whole, steps) <= 1e-5
    assert whole.argmax() == chunks.argmax() == steps.argmax()


def test_a_decode_step_riding_a_long_forward_gets_its_own_logits(tiny_dir):
    """Rows of two sequences in one forward longer than a piece: each gets what it gets alone."""
    pipe = LocalPipeline.load(tiny_dir, 1, device="cpu",
                              options=StageOptions(sizing=SizingOptions(prefill_chunk=PROMPT + 1)))
    try:
        ids = _prompt(pipe.stages[0].cfg.vocab_size)
        pipe.forward([SeqInput("stream", 0, ids=ids[:40])])
        (alone,) = pipe.forward([SeqInput("stream", 40, ids=ids[40:41])])
        pipe.release("stream")
        pipe.forward([SeqInput("stream", 0, ids=ids[:40])])
        long_alone = _last_logits(pipe, "long", ids, PROMPT)
        step, long = pipe.forward([SeqInput("stream", 40, ids=ids[40:41]), SeqInput("long", 0, ids=ids)])
    finally:
        pipe.close()
    assert _close(step.logits[-1], alone.logits[-1]) <= 1e-5 and _close(long.logits[-1], long_alone) <= 1e-5


def test_pieces_cover_every_row_once_in_order_within_the_piece_size():
    """However the batch is made (a long prompt, short ones, decode steps): every row in exactly one piece, no piece
    over the size, a sequence at most once per piece and its runs in order, cut where a prompt fed the piece size
    at a time would be cut."""
    from deltafin.models.decoder import Span, pieces_of

    lengths = [1300, 1, 500, 3, 512, 1]
    caches = [object() for _ in lengths]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    spans = [Span(s, n, c) for s, n, c in zip(starts, lengths, caches, strict=True)]
    pieces = pieces_of(spans, 512)
    assert all(len(p.rows) <= 512 for p in pieces)
    assert sorted(torch.cat([p.rows for p in pieces]).tolist()) == list(range(sum(lengths)))
    seen: dict[int, list[int]] = {}
    for p in pieces:
        assert len({id(part.cache) for part in p.spans}) == len(p.spans)
        for part in p.spans:
            i = caches.index(part.cache)
            first = p.rows[part.start].item() - starts[i]
            assert first % 512 == 0 and p.rows[part.start:part.start + part.length].tolist() == list(
                range(starts[i] + first, starts[i] + first + part.length))
            seen.setdefault(i, []).append(first)
    assert all(runs == sorted(runs) and runs == list(range(0, lengths[i], 512)) for i, runs in seen.items())


def test_several_prompts_in_one_forward_get_their_own_logits(tiny_dir):
    """Prompts of 600, 300 and 300 tokens in one forward (1,200 rows: pieces of at most 512 mixing sequences) give
    each prompt's logits alone."""
    pipe = LocalPipeline.load(tiny_dir, 1, device="cpu", options=StageOptions(sizing=SizingOptions(prefill_chunk=1200)))
    try:
        ids = _prompt(pipe.stages[0].cfg.vocab_size)
        prompts = {"a": ids[:600], "b": ids[100:400], "c": ids[350:650]}
        alone = {name: _last_logits(pipe, name, p, len(p)) for name, p in prompts.items()}
        together = pipe.forward([SeqInput(name, 0, ids=p) for name, p in prompts.items()])
    finally:
        pipe.close()
    for out in together:
        assert _close(out.logits[-1], alone[out.session_id]) <= 1e-5
