"""Weights off the disk: spine residency and streaming, the expert store (pread, cache, prefetch, counters; host,
GPU or MLX slots), the disk as the reader sees it.

May import: basics, formats, checkpoint, kernels, models, plan.
"""
