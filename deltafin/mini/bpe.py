"""k3-mini's vocabulary: byte-level BPE trained on the corpus, written as K3's `tiktoken.model` ranks.

`tokenizers` learns the merges with K3's own pre-tokenizer (its regex, then the byte-level map), so the
chunks it merges within are the chunks K3Tokenizer and tiktoken split text into. The ranks are the 256
bytes in byte order, then each merge's result in the order the trainer learned it; tiktoken's rule (merge
the adjacent pair whose result ranks lowest) then reproduces the trained tokenizer's merges. The trainer
sees only text that is encoded as text: the non-special segments of each rendered conversation (message
bodies and markup such as `message role="user"`), never the special markers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from deltafin.mini.corpus import Conversation, chat_options
from deltafin.text import chat, vocab
from deltafin.text.tokenizer import unicode_to_bytes

log = logging.getLogger(__name__)

N_BASE = 7936  # BPE tokens: with K3's 256 specials, a vocabulary of 8192
SLACK = 64  # extra merges asked of the trainer, as some spell a token an earlier merge already made


def training_texts(convs: Iterable[Conversation]) -> Iterator[str]:
    """The non-special segments of every conversation rendered with the think channel (which holds every
    message's text, reasoning included)."""
    for conv in convs:
        for text, special in chat.render(conv, chat_options(thinking=True)):
            if not special:
                yield text


def _trained(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(vocab.PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _merges(tok: Tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]  # older: "a b"


def train_ranks(texts: Iterable[str], n_base: int = N_BASE) -> dict[bytes, int]:
    """`n_base` tiktoken ranks: bytes 0..255, then the trained merges' results in merge order (a result
    that spells an earlier token is skipped). Raises ValueError when the text supports fewer merges."""
    if n_base < 256:
        raise ValueError("a byte-level vocabulary needs at least 256 base tokens")
    tok = _trained(texts, n_base + SLACK)
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in _merges(tok):
        if len(ranks) == n_base:
            break
        merged = unicode_to_bytes(a) + unicode_to_bytes(b)
        if merged not in ranks:
            ranks[merged] = len(ranks)
    if len(ranks) < n_base:
        raise ValueError(f"the text supports only {len(ranks)} tokens, not {n_base}: give it more text")
    log.info("trained %d BPE tokens (longest %d bytes)", len(ranks), max(map(len, ranks)))
    return ranks


def write_vocab(out_dir: Path, ranks: dict[bytes, int], n_base: int) -> None:
    """`tiktoken.model` and `tokenizer_config.json` (K3's specials after the `n_base` ranks) in `out_dir`."""
    if sorted(ranks.values()) != list(range(n_base)):
        raise ValueError(f"ranks must be exactly 0..{n_base - 1}")
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab.write_tiktoken(out_dir / "tiktoken.model", ranks)
    vocab.write_tokenizer_config(out_dir / "tokenizer_config.json", n_base)
