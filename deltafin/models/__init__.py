"""Model math: pure functions of tensors, weights, config and per-sequence state."""
