"""k3-mini, a small K3 trained on Python's own documentation (corpus, tokenizer, training, export, evaluation),
and the writer of synthetic checkpoints in K3's exact layout (synth.py).

May import: basics, formats, checkpoint, text, kernels, models, plan, weights, runtime.
"""
