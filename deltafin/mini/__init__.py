"""k3-mini: a small K3 trained on Python's own documentation (corpus, tokenizer, training, export)."""
