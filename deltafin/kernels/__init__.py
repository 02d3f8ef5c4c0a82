"""Hot kernels and weight formats: MXFP4 experts and row-int8 matrices (quant.py) with a plain-torch reference and
per-device fast paths (cpu.c, Triton, MPS, MLX), each checked against the reference at first use.

May import: basics, formats, checkpoint.
"""
