"""`deltafin bench --quality`: what a spine format costs, measured against the spine as stored; with `--wire bf16`,
what the lossy wire costs, measured against one process.

The same token sequences go through two in-process stages of the same checkpoint: one with the spine as stored
(bf16) and one with the format asked for (`--spine`). At every position but each sequence's last: the format's
next-token cross entropy (its perplexity, beside the stored spine's), the KL divergence of its next-token
distribution from the stored one's (mean over positions, in nats), and whether both put the same token first.
The text is k3-mini's held-out split (the conversations of the standard-library modules its training left out,
deltafin/mini/corpus.py) for k3-mini, or `--text FILE` for any checkpoint, cut into sequences of at most
SEQUENCE_TOKENS. The experts stay as stored in both: only the spine differs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deltafin.errors import DeltafinError
from deltafin.formats import stored_spine
from deltafin.mini import corpus
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.text.tokenizer import K3Tokenizer

SEQUENCE_TOKENS = 2048  # a sequence of --text; a conversation of the held-out split is one sequence
STORED = stored_spine()


def trained_on_the_corpus(model: str | Path) -> bool:
    """A checkpoint k3-mini's recipe trained (its config.json records it): its held-out split is the text."""
    try:
        raw = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("deltafin_trained"), dict)


def sequences_for(model: str | Path, text: str | None) -> list[list[int]]:
    """The token sequences `--quality` measures on: `text` (a file), else k3-mini's held-out split."""
    tokenizer = K3Tokenizer.load(model)
    if text is not None:
        return text_sequences(tokenizer, Path(text))
    if not trained_on_the_corpus(model):
        raise DeltafinError(f"{model} was not trained by k3-mini's recipe, so it has no held-out split: give the "
                            "text to measure on with --text FILE")
    return heldout_sequences(tokenizer)


def heldout_sequences(tokenizer: K3Tokenizer, seed: int = 0) -> list[list[int]]:
    """k3-mini's held-out conversations in K3's chat format, as its evaluation encodes them."""
    entries = corpus.entries(corpus.stdlib_root())
    _, heldout = corpus.split(corpus.labeled_conversations(entries, seed), seed=seed)
    return corpus.encode_all(tokenizer, heldout, seed)


def text_sequences(tokenizer: K3Tokenizer, path: Path) -> list[list[int]]:
    """A text file's tokens, in sequences of at most SEQUENCE_TOKENS."""
    try:
        ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise DeltafinError(f"cannot read --text {path}: {e}") from None
    if len(ids) < 2:
        raise DeltafinError(f"--text {path} has {len(ids)} tokens: it needs at least 2")
    return [ids[i:i + SEQUENCE_TOKENS] for i in range(0, len(ids), SEQUENCE_TOKENS) if len(ids[i:]) > 1]


def logits_of(pipe: LocalPipeline, session: str, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, vocab] of every position, in forwards of PIECE_TOKENS (the most that return them all)."""
    out = torch.cat([pipe.forward([SeqInput(session, s, ids=ids[s:s + PIECE_TOKENS])], all_logits=True)[0].logits
                     for s in range(0, len(ids), PIECE_TOKENS)])
    pipe.release(session)
    return out.float().cpu()


def compare(stored: LocalPipeline, other: LocalPipeline, sequences: list[list[int]], tokens: int | None) -> dict:
    """The sums over `sequences` (at most `tokens` positions in all) that `spine_quality` reports."""
    sums = new_sums()
    for i, seq in enumerate(cut(sequences, tokens)):
        ids = torch.tensor(seq, dtype=torch.long)
        add_pair(sums, logits_of(stored, f"q-{i}", ids), logits_of(other, f"q-{i}", ids), ids)
    return sums


def cut(sequences: list[list[int]], positions: int | None) -> list[list[int]]:
    """The sequences, in order, cut where `positions` next-token predictions (a sequence's length less one) are
    reached (None: all of them)."""
    out, count = [], 0
    for seq in sequences:
        if positions is not None and count >= positions:
            break
        part = seq[:None if positions is None else positions - count + 1]
        out.append(part)
        count += len(part) - 1
    return out


def new_sums() -> dict:
    return {"nats": {"stored": 0.0, "other": 0.0}, "kl": 0.0, "same": 0, "count": 0}


def add_pair(sums: dict, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor) -> None:
    """Adds one sequence to `sums`: `a` the reference's logits and `b` the other's at every position [T, vocab]."""
    a, b = a[:-1], b[:-1]
    sums["nats"]["stored"] += float(F.cross_entropy(a, ids[1:], reduction="sum"))
    sums["nats"]["other"] += float(F.cross_entropy(b, ids[1:], reduction="sum"))
    sums["kl"] += float(F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="sum"))
    sums["same"] += int((a.argmax(-1) == b.argmax(-1)).sum())
    sums["count"] += len(ids) - 1


def spine_quality(model: str | Path, spine: str, sequences: list[list[int]], device: str = "cpu",
                  tokens: int | None = None) -> dict[str, Any]:
    """JSON-ready: the format's `perplexity` and the stored spine's, `kl_vs_stored` and `top1_agreement`."""
    if not sequences:
        raise DeltafinError("no text to measure the spine's quality on")
    pipes = [LocalPipeline.load(model, 1, device=device, options=StageOptions(sizing=SizingOptions(spine=s)))
             for s in (STORED, spine)]
    try:
        sums = compare(*pipes, sequences, tokens)
    finally:
        for pipe in pipes:
            pipe.close()
    return {**figures(model, sums), "spine": spine, "stored_spine": STORED}


def wire_quality(model: str | Path, wire: str, sequences: list[list[int]], device: str = "cpu",
                 tokens: int | None = None) -> dict[str, Any]:
    """What `wire` costs: two wide stages, each holding half of every layer's experts (runtime/local_wide.py), whose
    hop and whose calls to each other round what crosses as the links would carry it, against one process (the
    spine as stored in both); the same figures as `spine_quality`."""
    from deltafin.runtime.local_wide import LocalWide  # (lazily: the wide stages load only here)

    one = LocalPipeline.load(model, 1, device=device)
    wide = LocalWide(Path(model), 2, device=torch.device(device), wire=wire)
    try:
        sums = compare(one, wide.pipeline, sequences, tokens)
    finally:
        one.close()
        wide.close()
    return {**figures(model, sums), "wire": wire, "against": "one process (the wire's fp32)"}


def figures(model: str | Path, sums: dict) -> dict[str, Any]:
    n = sums["count"]
    if n == 0:
        raise DeltafinError("no position to measure: every sequence has fewer than 2 tokens")
    return {"model": str(model), "tokens": n, "perplexity": round(math.exp(sums["nats"]["other"] / n), 4),
            "perplexity_stored": round(math.exp(sums["nats"]["stored"] / n), 4),
            "kl_vs_stored": round(sums["kl"] / n, 6), "top1_agreement": round(sums["same"] / n, 5)}

