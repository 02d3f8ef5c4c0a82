"""Model math: pure functions of tensors, weights, config and per-sequence state; no I/O. The model's constants
(attention pieces, cache blocks) live here and the planner reads them.

May import: basics, formats, checkpoint, kernels.
"""
