"""The forward workspace model: the temporaries one forward of a stage keeps alive at once (`workspace_bytes`:
every row's AttnRes state, the largest layer's attention, MLP or expert scratch a piece at a time, the logits,
bounded weight-conversion blocks), how many tokens a forward carries when the user fixes none
(`auto_forward_tokens`, within FORWARD_SHARE of the budget), and the temporaries of one expert call a wide holder
computes (`holder_workspace_bytes`). Pure, from the config and the per-layer table: sizing.py counts these as a
stage's `workspace`."""

from __future__ import annotations

from deltafin.checkpoint.config import ModelConfig
from deltafin.kernels.blocks import WEIGHT_BLOCK_VALUES
from deltafin.models.pieces import MLA_BLOCK_BYTES, PIECE_TOKENS
from deltafin.plan.memory.layer_table import LayerTable

FORWARD_SHARE = 0.1  # of a stage's budget, what one forward's workspace may take when the user fixes no size


def workspace_bytes(cfg: ModelConfig, table: LayerTable, a: int, b: int, tokens: int, context: int,
                    last: bool, spilled: bool = False) -> int:
    """Temporaries of one forward of `tokens` tokens at up to `context` tokens of history (upper bound of
    what is alive at once; the largest layer of the range decides). A forward longer than PIECE_TOKENS keeps
    every row's residual state (once: a layer writes it in place) and runs each layer's attention (and a dense
    MLP) a piece at a time, its routed experts over every row at once (models/decoder.py, layer_in_pieces);
    forwards that return every position's logits take one piece at most. `spilled`: the rows' blocks kept on the
    SSD (plan/memory/spill_cost.py), every row's P held and a piece's blocks read back."""
    act = table.place.act_bytes
    d, t, p = cfg.hidden_size, tokens, min(tokens, PIECE_TOKENS)
    blocks = cfg.blocks_entering(b) + 1
    row = (blocks + 1) * d * 4  # P and B of one token (fp32)
    # every row's state, held once (a layer writes it in place, banking blocks into the room ResidualState.with_room
    # made); a piece's AttnRes mix, norm
    state = (t * d * 4 + p * row if spilled else t * row) + 2 * p * row
    per_layer = 0
    if table.kda[b] - table.kda[a]:  # projections, convolutions, gates; one chunk's decay pairs
        per_layer = max(per_layer, 16 * p * cfg.kda_dim * 4 + min(1 << 24, p * cfg.kda_dim * 16) * 4)
    if table.mla[b] - table.mla[a]:
        heads, s = cfg.num_heads, max(context, t)
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        block = min(MLA_BLOCK_BYTES, s * heads * (p + 2 * qk + 2 * v) * 4)  # one key block (or all keys)
        per_layer = max(per_layer, block + p * heads * (2 * qk + 3 * v) * 4)  # + queries, accumulators, output
    if a < cfg.first_k_dense:  # a dense MLP: a piece at a time
        per_layer = max(per_layer, 3 * p * cfg.intermediate_size * 4)
    if table.moe[b] > table.moe[a]:  # the router's scores and the routed experts' inputs and outputs, every row;
        # up to a piece every pair's output and the shared experts' on every row, a longer forward's summed expert by
        # expert and the shared experts' a block of rows at a time (models/moe.py moe_added)
        shared = cfg.moe_intermediate_size * max(1, cfg.num_shared_experts)
        pairs = cfg.experts_per_token * cfg.expert_dim if t <= PIECE_TOKENS else 2 * cfg.expert_dim
        moe = t * (cfg.num_experts * 3 + pairs + 2 * d) * 4
        per_layer = max(per_layer, 3 * p * shared * 4 + moe)
    logits = p * cfg.vocab_size * 4 if last else 0  # fp32 logits (every position of a piece, at most)
    widest = max(cfg.vocab_size if last else 0, cfg.intermediate_size, cfg.kda_dim, cfg.num_heads * 256) * d
    weight_blocks = 2 * min(WEIGHT_BLOCK_VALUES, widest) * 4  # weights converted a block of rows at a time
    # the input beside the rows' own state (a first stage's embeddings while they are copied in; a later stage's
    # state as it came, held by its call), and a row's output state on its way out
    held = t * d * act * (2 if a == 0 else 2 + cfg.blocks_entering(a) + 1)
    return state + per_layer + logits + weight_blocks + held


def auto_forward_tokens(cfg: ModelConfig, table: LayerTable, a: int, b: int, context: int, budget: int) -> int:
    """The most tokens one forward carries when the user fixes none: the whole planned context, if its workspace
    stays within FORWARD_SHARE of the budget; else as many as do (never fewer than PIECE_TOKENS, which the
    workspace of one attention pass needs anyway). A prompt up to that long reads each expert once."""
    last = b == cfg.num_layers
    cap = max(workspace_bytes(cfg, table, a, b, PIECE_TOKENS, context, last), int(FORWARD_SHARE * budget))
    if workspace_bytes(cfg, table, a, b, context, context, last) <= cap:
        return max(context, 1)
    lo, hi = PIECE_TOKENS, context  # workspace grows with tokens: the largest that stays within the cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if workspace_bytes(cfg, table, a, b, mid, context, last) <= cap else (lo, mid - 1)
    return lo


def holder_workspace_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Temporaries of computing one expert call of `tokens` tokens' pairs: each expert's rows, its gate and up
    products and output (the largest expert sees every token), and the call's outputs."""
    i, d, k = cfg.moe_intermediate_size, cfg.expert_dim, cfg.experts_per_token
    return tokens * (2 * d + 3 * i) * 4 + tokens * k * d * 4
