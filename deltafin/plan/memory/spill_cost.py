"""What a prompt's forward that keeps its rows' AttnRes blocks on the SSD costs, and when it pays (pure).

A long forward holds every row's residual state: P, the running sum, and B, the blocks banked every
`attn_res_block_size` layers ((1 + n) x D values a token; K3's n reaches 8). A prompt longer than the forward the
memory holds goes in several forwards, and each reads every expert again (1.45 TB at K3). A spilled forward instead
keeps P in memory and B on the SSD (runtime/spill.py): each layer reads its attention pieces' blocks back, and a
banking layer writes the one block it adds. Its workspace drops by the n blocks a token, so one forward carries
several times the tokens. It pays where those reads and writes come to less than the experts (and streamed spine)
that the extra forwards would read again: `spill_pays`. A spill is planned on a stage of every layer only: its
input is token ids and its output the last rows' logits, so no other stage ever holds the whole prompt's state.
"""

from __future__ import annotations

from deltafin.checkpoint.config import ModelConfig
from deltafin.plan.memory.stage_parts import expert_slot_bytes

SPILL_MARGIN = 1 << 30  # free bytes a spill leaves on its disk beyond its own file


def spill_read_bytes(cfg: ModelConfig, start: int, end: int, tokens: int, act_bytes: int) -> int:
    """Bytes a spilled forward of `tokens` reads back: every row's blocks banked before each layer, as the layer's
    attention pieces enter it (the head's last rows besides: a row a sequence)."""
    per_row = cfg.hidden_size * act_bytes
    blocks = sum(cfg.blocks_entering(layer) for layer in range(start, end))
    return tokens * blocks * per_row


def spill_write_bytes(cfg: ModelConfig, start: int, end: int, tokens: int, act_bytes: int) -> int:
    """Bytes a spilled forward writes: the blocks its stage's input carries, and the one each banking layer adds."""
    return spill_file_bytes(cfg, start, end, tokens, act_bytes)


def spill_file_bytes(cfg: ModelConfig, start: int, end: int, tokens: int, act_bytes: int) -> int:
    """The spill file's size at the forward's end: every row's blocks leaving the stage."""
    return tokens * cfg.blocks_entering(end) * cfg.hidden_size * act_bytes


def spill_bytes(cfg: ModelConfig, start: int, end: int, tokens: int, act_bytes: int) -> int:
    """A spilled forward's SSD traffic, reads and writes (a Mac's SSD writes about as fast as it reads)."""
    return spill_read_bytes(cfg, start, end, tokens, act_bytes) + spill_write_bytes(cfg, start, end, tokens,
                                                                                     act_bytes)


def pass_bytes(cfg: ModelConfig, expert_layers: int, spine_streamed: int) -> int:
    """What each further forward of a prompt reads again: every expert of the stage's MoE layers (a prompt touches
    nearly all; the cache is lent to it) and its streamed spine."""
    return expert_layers * cfg.num_experts * expert_slot_bytes(cfg) + spine_streamed


def spill_pays(cfg: ModelConfig, start: int, end: int, tokens: int, act_bytes: int, again: int) -> bool:
    """Whether one spilled forward of `tokens` costs the disk less than one more forward's reads (`again`:
    `pass_bytes`). Holding for the longest spilled forward, it holds for every shorter one, which reads less, while
    unspilled any prompt longer than the plan's forward takes at least one more."""
    return spill_bytes(cfg, start, end, tokens, act_bytes) < again
