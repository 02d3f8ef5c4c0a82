"""Held-out perplexity of a checkpoint, through the runtime (the quantized model as it is served).

Each conversation is encoded in K3's chat format (corpus.encode_all, seeded) and run from an empty cache,
in forwards of PIECE_TOKENS (the most that return every position's logits); the loss is the mean next-token
cross entropy over every token but the first. A model that knows nothing scores about the vocabulary size
(uniform: perplexity = vocab).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deltafin.mini.corpus import Conversation, encode_all
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.text.tokenizer import K3Tokenizer


def perplexity(model_dir: str | Path, convs: list[Conversation], device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """{"nats_per_token", "perplexity", "tokens", "conversations", "vocab_size"} over `convs`."""
    tok = K3Tokenizer.load(model_dir)
    pipe = LocalPipeline.load(model_dir, 1, device=device, dtype="fp32")
    nats, count = 0.0, 0
    try:
        for i, ids in enumerate(encode_all(tok, convs, seed)):
            t = torch.tensor(ids, dtype=torch.long)
            logits = torch.cat([pipe.forward([SeqInput(f"eval-{i}", s, ids=t[s:s + PIECE_TOKENS])],
                                             all_logits=True)[0].logits for s in range(0, len(ids), PIECE_TOKENS)])
            pipe.release(f"eval-{i}")
            nats += float(F.cross_entropy(logits[:-1].float().cpu(), t[1:], reduction="sum"))
            count += len(ids) - 1
    finally:
        pipe.close()
    vocab = pipe.stages[0].cfg.vocab_size
    return {"nats_per_token": round(nats / count, 4), "perplexity": round(math.exp(nats / count), 3),
            "tokens": count, "conversations": len(convs), "vocab_size": vocab}
