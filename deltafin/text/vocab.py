"""K3's vocabulary files: `tiktoken.model` ranks, special tokens, `tokenizer_config.json`.

K3's vocabulary is 163,584 BPE tokens plus 256 reserved ids for specials (K3_SPEC §7). A scaled-down
synthetic vocabulary keeps that shape: `n_base` BPE tokens, then the same 256 specials at the same
offsets from `n_base`, so every rule written for the real ids holds for a synthetic one.
"""

from __future__ import annotations

import base64
import json
import random
import re
from pathlib import Path

from deltafin.checkpoint.presets import N_SPECIAL  # the ids K3 reserves for specials at the vocabulary's end

# offset from the first special id -> token text (K3: 163584 + offset)
NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|kimi_image_placeholder|>",
    254: "[UNK]",
    255: "[PAD]",
}

# K3's pre-tokenizer (Rust-regex / Oniguruma syntax: `&&` is class intersection).
PRETOKENIZE_REGEX = (
    r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&"
    r"[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&"
    r"[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?"
    r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def special_tokens(n_base: int) -> dict[str, int]:
    """Every special token's text -> id, for a vocabulary of `n_base` BPE tokens + 256 specials."""
    out = {}
    for off in range(N_SPECIAL):
        out[NAMED_SPECIALS.get(off, f"<|reserved_token_{n_base + off}|>")] = n_base + off
    return out


def write_tiktoken(path: Path, ranks: dict[bytes, int]) -> None:
    lines = (f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda x: x[1]))
    path.write_text("".join(lines))


def read_tiktoken(path: Path) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a 'base64 rank' line ({e})") from None
    return ranks


def write_tokenizer_config(path: Path, n_base: int) -> None:
    specials = special_tokens(n_base)
    decoder = {str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for text, i in specials.items()}
    cfg = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Byte-level BPE of `token` using only merges ranked below `max_rank` (lowest rank merges first)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


_WORDS = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+")


def synthetic_ranks(n_base: int, seed: int) -> dict[bytes, int]:
    """A valid byte-level BPE vocabulary of `n_base` tokens: the 256 bytes, merges learned from a small
    built-in multilingual corpus, then seeded random merges of existing tokens. Every merged token
    splits back into exactly the two tokens it was made of, as trained BPE vocabularies do."""
    if n_base < 256:
        raise ValueError("a byte-level vocabulary needs at least 256 base tokens")
    ranks = {bytes([b]): b for b in range(256)}
    words = [list(bytes([b]) for b in w.encode()) for w in _WORDS.findall(_CORPUS)]
    while len(ranks) < n_base:
        counts: dict[tuple[bytes, bytes], int] = {}
        for w in words:
            for a, b in zip(w, w[1:], strict=False):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        pairs = sorted((p for p, c in counts.items() if c > 1 and p[0] + p[1] not in ranks),
                       key=lambda p: (-counts[p], p))
        if not pairs:
            break
        a, b = pairs[0]
        ranks[a + b] = len(ranks)
        words = [_merge(w, a, b) for w in words]
    rng = random.Random(seed)
    tokens = sorted(ranks, key=ranks.__getitem__)
    while len(ranks) < n_base:
        a, b = rng.choice(tokens), rng.choice(tokens)
        merged = a + b
        if len(merged) > 16 or merged in ranks or bpe_split(ranks, merged, len(ranks)) != [a, b]:
            continue
        ranks[merged] = len(ranks)
        tokens.append(merged)
    return ranks


def _merge(word: list[bytes], a: bytes, b: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


_CORPUS = """
The quick brown fox jumps over the lazy dog. Deltafin runs the largest open models on machines people own:
the experts stream from the disk while the spine stays in memory, and every token is computed on the device.
In the beginning there was the word, and the word was a token. Tokens are bytes that were merged often.
def forward(self, hidden_states, cache=None):
    residual = hidden_states
    hidden_states = self.norm(hidden_states)
    return residual + self.attention(hidden_states, cache=cache)
for (int i = 0; i < n; ++i) { sum += weights[i] * inputs[i]; }
import torch; x = torch.zeros(1024, 7168, dtype=torch.bfloat16)

人工智能正在改变我们的世界。大型语言模型可以在个人电脑上运行。专家混合模型只激活一部分参数。
今天天气很好，我们去公园散步吧。这个模型有九十三层，每层有八百九十六个专家。
Numbers: 3.14159 2.71828 1024 2048 4096 65536 163840 2026-11-30 12:34:56 $19.99 100%
Emoji and symbols: 🙂 🚀 ✨ → ← ≤ ≥ ∑ ∞ «quotes» “curly” ‘single’ — dashes – and … ellipses.
Français: l'été dernier, nous étions à Paris. Deutsch: Größe, Übung, schön. Español: año, niño, corazón.
Русский текст: привет мир. 日本語のテキスト：こんにちは世界。한국어: 안녕하세요 세계.
JSON: {"role": "user", "content": "Hello, world!", "tools": [{"name": "search", "arguments": {}}]}
The model's answer wasn't what they'd expected, but it's what we've got and they'll like it.
"""
