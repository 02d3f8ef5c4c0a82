"""Where a stage keeps prefix states, and what one costs: the grid of kept states inside long messages, and the
line `plan` and `inspect` print about it (the coordinator's prefix index keeps states there:
coordinator/engine/prefix_index.py)."""

from __future__ import annotations

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.plan.sizing import GB, kda_state_bytes, mla_row_bytes, sequence_bytes

GRID_MIN = 1024  # fewest tokens between two states kept inside one long message
GRID_ROUND = 256


def prefix_grid(cfg: ModelConfig, n_kda: int, n_mla: int, act_bytes: int, capacity: int, context: int) -> int:
    """Tokens between the states a stage keeps inside a long message (or a prompt with no messages), counted
    from the prompt's start. A kept state costs its KDA layers' states wherever it is taken, plus its latents,
    and saves the prefill of the tokens before it: the grid is as dense as lets a prompt of the planned
    `context` keep its grid in a quarter of the `capacity` for kept prefixes (memory, or the disk where the
    stage keeps them there), never denser than every GRID_MIN tokens; `context` when not even one fits (only
    the messages' ends and the prompt's are kept then)."""
    def grid_bytes(step: int) -> int:
        return sum(sequence_bytes(cfg, n_kda, n_mla, at, act_bytes) for at in range(step, context, step))

    step = GRID_MIN
    while step < context and grid_bytes(step) > capacity // 4:
        step += GRID_ROUND
    return step


PREFIX_DISK_BYTES = 32 * 10**9  # a stage's kept prefixes on its disk, by default (--prefix-disk-gb)


def kept_prefixes_text(cfg: ModelConfig, stages: list[tuple[int, int, int]], act_bytes: int, context: int,
                       disk: int = PREFIX_DISK_BYTES) -> str:
    """What a kept prefix costs and where states are kept, as `plan` and `inspect` print it: the state of a
    boundary at this model's width (its KDA layers' states, and its MLA layers' latents a token), and the grid
    (the densest of the stages': `stages` are (start, end, memory for kept prefixes))."""
    kinds = cfg.layer_kinds
    n_kda = sum(k is LayerKind.KDA for k in kinds)
    n_mla = len(kinds) - n_kda
    grids = [prefix_grid(cfg, sum(k is LayerKind.KDA for k in kinds[a:b]), sum(k is LayerKind.MLA for k in kinds[a:b]),
                         act_bytes, disk or memory, context) for a, b, memory in stages]
    grid = max(grids, default=context)
    where = f"every {grid:,} tokens inside long messages, " if grid < context else ""
    memory = sum(m for _, _, m in stages)
    return (f"kept prefixes: a state is {n_kda * kda_state_bytes(cfg) / GB:.3f} GB ({n_kda} KDA layers) + "
            f"{n_mla * mla_row_bytes(cfg, act_bytes) / 1e3:.1f} KB a token ({n_mla} MLA layers' latents); "
            f"{memory / GB:.2f} GB of memory for them" + (f" and {disk / GB:.0f} GB of disk a stage" if disk else "")
            + f"; kept at message ends, cache breakpoints, {where}prompts' and requests' ends")
