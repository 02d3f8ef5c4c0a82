"""The parts a stage's memory plan adds up (pure: from the config and the per-layer table): the embedding and head,
an expert's read slot and the store's working slots, a sequence's caches and a speculative forward's trail, the
buffers of wide expert calls, and the state that crosses from one stage to the next. sizing.py sums them."""

from __future__ import annotations

from deltafin.checkpoint.config import ModelConfig
from deltafin.models.pieces import mla_capacity
from deltafin.plan.memory.layer_table import ALIGN, align_up, held_bytes, matrix_format, tensor_role
from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS, Placement


def top_bytes(cfg: ModelConfig, place: Placement, spine: str, first: bool, last: bool) -> int:
    """The embedding (first stage) and the final norm and head (last stage), each held as one unit."""
    units = ([[s for s in cfg.top_tensor_specs() if "embed_tokens" in s.name]] if first else []) + (
        [[s for s in cfg.top_tensor_specs() if "embed_tokens" not in s.name]] if last else [])
    return sum(held_bytes([(s, tensor_role(s)) for s in unit], place, matrix_format(spine)) for unit in units)


def expert_slot_bytes(cfg: ModelConfig) -> int:
    """One expert's read slot: its bytes widened to blocks, with room for six separately aligned tensors."""
    return align_up(cfg.bytes_per_expert) + 2 * ALIGN * 6


def working_slots(cfg: ModelConfig, threads: int, demand_layers: int = 1) -> int:
    """Slots the expert store needs besides its cache: two layers of staged prefetches, one layer of demand reads
    for each compute thread that may hold one at once (k: so a layer's experts can all be held together; a wide
    worker's stage and the expert calls it serves are two), and one per reader thread."""
    return (2 + demand_layers) * cfg.experts_per_token + threads


def kda_state_bytes(cfg: ModelConfig) -> int:
    """One KDA layer's per-sequence state (fp32): conv window of q, k, v and the recurrent state."""
    return (3 * (cfg.conv_kernel - 1) * cfg.kda_dim + cfg.kda_heads * cfg.kda_head_dim ** 2) * 4


def kda_trail_bytes(cfg: ModelConfig, tokens: int = SPECULATIVE_TOKENS) -> int:
    """What one KDA layer keeps after a speculative forward of `tokens` tokens, until the next forward picks
    the position to continue from: each token's k, v, decay, beta and conv inputs, and the window before.
    A plan for speculative decoding (`SizingInput.speculative_tokens`) reserves it for every sequence beside
    the sequence's caches (0.21 GB per sequence at K3's width: docs/speculative-decoding.md)."""
    h, d = cfg.kda_heads, cfg.kda_head_dim
    return (tokens * (3 * h * d + h + 3 * cfg.kda_dim) + 3 * (cfg.conv_kernel - 1) * cfg.kda_dim) * 4


def mla_row_bytes(cfg: ModelConfig, act_bytes: int) -> int:
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act_bytes


def sequence_bytes(cfg: ModelConfig, n_kda: int, n_mla: int, tokens: int, act_bytes: int) -> int:
    """One sequence's caches on a stage with n_kda KDA and n_mla MLA layers, at `tokens` tokens."""
    return n_kda * kda_state_bytes(cfg) + n_mla * mla_capacity(tokens) * mla_row_bytes(cfg, act_bytes)


def expert_call_bytes(cfg: ModelConfig, tokens: int, issues: bool, serves: bool) -> int:
    """Buffers of wide expert calls for a forward of `tokens` tokens: a stage's calls out (its rows, then every
    pair's fp32 output coming back, as messages and as tensors) and, for a holder, the calls it serves (the same
    bounds: at most every pair of the forward comes to one holder)."""
    one = 2 * tokens * (cfg.experts_per_token + 1) * cfg.expert_dim * 4
    return one * (int(issues) + int(serves))


def boundary_bytes_per_token(cfg: ModelConfig, layer: int, act_bytes: int) -> int:
    """Bytes one token adds to the message that enters `layer` from the previous stage: the AttnRes state,
    the banked blocks P and the partial block B (layer = L: what the last stage's head receives)."""
    return (cfg.blocks_entering(layer) + 1) * cfg.hidden_size * act_bytes
