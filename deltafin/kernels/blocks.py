"""The kernels' working sizes the planner counts (torch-free, so that plan/ loads without torch)."""

WEIGHT_BLOCK_VALUES = 1 << 24  # fp32 values of one on-the-fly converted weight block (64 MB: kernels/linear.py)
