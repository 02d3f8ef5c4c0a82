"""Text in and out: the tokenizer (tokenizer.py, vocab.py), K3's chat format (chat.py), sampling and stop strings
(sampling.py), and speculative drafting with its cost model (drafting.py).

May import: basics, formats, checkpoint.
"""
