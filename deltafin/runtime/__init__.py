"""The stage: a contiguous range of layers run for a batch of sequences (stage.py, its options in
stage_options.py), the sequences' caches, kept prefixes in memory and on disk, in-process pipelines, wide experts
(a stage's calls to every holder), and what a worker holds once assigned.

May import: basics, formats, checkpoint, text, kernels, models, plan, weights.
"""
