"""Wide experts in one process for the tests: the runtime's own in-process cluster (runtime/local_wide.py), and
how close a wide stage is to one process."""

from __future__ import annotations

import torch

from deltafin.runtime.local_wide import LocalWide as WideCluster

__all__ = ["WIDE_CLOSE", "WideCluster", "wide_close"]


# several holders: a token's 16 weighted expert outputs are summed per holder, then across holders, in fp32 (each
# MoE layer's sum regrouped, about 16 * 2**-24 relative, through the model's layers; measured on `small` up to 3.8e-6
# of the logits' scale): a wide stage equals one process's to this, with the same greedy token
WIDE_CLOSE = 1e-5


def wide_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` (wide) within WIDE_CLOSE of `b`'s scale (one process), with the same greedy token."""
    return float((a - b).abs().max()) <= WIDE_CLOSE * float(b.abs().max()) and \
        int(a[-1].argmax()) == int(b[-1].argmax())

