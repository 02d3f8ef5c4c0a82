"""The sizes the model's math works in, which the planner counts (torch-free, so that plan/ loads without torch):
the rows of one attention piece, the pieces a stage streams on, MLA's key blocks and cache blocks."""

from __future__ import annotations

SUMMED_ROWS = 512  # rows (one attention piece: PIECE_TOKENS) above which the routed experts' outputs are summed
# expert by expert (models/moe.py), and the rest of the layer runs a block of this many rows at a time
PIECE_TOKENS = SUMMED_ROWS  # rows of a sequence one attention pass takes; a longer forward runs each layer in pieces
STREAM_PIECE_TOKENS = 256  # a stage that ends on a dense layer runs it in pieces of this many rows and sends each
# piece's outputs on as it is done (runtime/stage.py)
MLA_BLOCK_BYTES = 384 << 20  # one key block of MLA prefill: its fp32 scores, keys and values (models/mla.py)
MLA_BLOCK_TOKENS = 256  # MLA latent caches grow in blocks of this many rows (the memory plan counts whole blocks)


def mla_capacity(tokens: int) -> int:
    """Latent rows an MLA cache holds for `tokens` tokens: whole blocks (the cache grows by these)."""
    return -(-max(tokens, 1) // MLA_BLOCK_TOKENS) * MLA_BLOCK_TOKENS
