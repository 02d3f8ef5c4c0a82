"""K3's tokenizer: `tiktoken.model` + `tokenizer_config.json` as a `tokenizers` byte-level BPE.

The ranks become a vocabulary and merges (each merged token split back into the two lower-ranked tokens
BPE would join), the pre-tokenizer is K3's regex (Oniguruma handles its `&&` class intersections), and
`ignore_merges` reproduces tiktoken's rule that a chunk already in the vocabulary is one token. The
result is cached under the cache directory (deltafin/paths.py), keyed by the sha256 of the ranks file and
the special tokens; never in the model's directory.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from deltafin import paths
from deltafin.errors import DeltafinError
from deltafin.text import vocab

log = logging.getLogger(__name__)

BUILD = 1  # bump when build_tokenizer changes what it builds: older cached files are then not used


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _to_unicode(token: bytes) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in token)


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_unicode().items()}


def unicode_to_bytes(s: str) -> bytes:
    """The bytes a byte-level BPE token spells (GPT-2's printable characters, as in a tokenizer.json)."""
    table = _unicode_to_byte()
    return bytes(table[c] for c in s)


def build_tokenizer(ranks: dict[bytes, int], specials: dict[str, int]) -> Tokenizer:
    vocab_map = {_to_unicode(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda x: x[1]):
        if len(tok) > 1:
            parts = vocab.bpe_split(ranks, tok, rank)
            if len(parts) == 2:
                merges.append((_to_unicode(parts[0]), _to_unicode(parts[1])))
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=merges, ignore_merges=True, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(vocab.PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # specials keep their ids (163584 + offset for K3); they are matched only when asked for
    ordered = sorted(specials.items(), key=lambda x: x[1])
    added = [AddedToken(text, special=True, normalized=False) for text, _ in ordered]
    tok.add_special_tokens(added)
    got = {text: tok.token_to_id(text) for text in specials}
    wrong = [t for t, i in specials.items() if got[t] != i]
    if wrong:
        raise DeltafinError(f"special tokens did not land on their ids ({wrong[:3]}...): is tiktoken.model complete?")
    return tok


class K3Tokenizer:
    """Encode/decode for a K3 (or synthetic K3) model directory."""

    def __init__(self, tok: Tokenizer, ranks: dict[bytes, int], specials: dict[str, int]):
        self.tok = tok
        # the same BPE without added tokens: text that merely looks like a special stays text
        spec = json.loads(tok.to_str())
        spec["added_tokens"] = []
        self.plain = Tokenizer.from_str(json.dumps(spec))
        self.specials = specials
        self.special_ids = {i: t for t, i in specials.items()}
        self._bytes = {rank: b for b, rank in ranks.items()}
        self.vocab_size = len(ranks) + len(specials)

    @classmethod
    def load(cls, model_dir: str | Path) -> K3Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tiktoken.model"
        if not path.is_file():
            raise DeltafinError(f"no tiktoken.model in {model_dir}: this checkpoint has no K3 tokenizer")
        try:
            ranks = vocab.read_tiktoken(path)
        except ValueError as e:
            raise DeltafinError(str(e)) from None
        specials = _read_specials(model_dir, len(ranks))
        key = hashlib.sha256(path.read_bytes() + json.dumps(sorted(specials.items())).encode()
                             + f"build {BUILD}".encode()).hexdigest()
        cached = paths.cache_dir("tokenizers", f"{key}.json")
        tok = None
        if cached.is_file():
            try:
                tok = Tokenizer.from_file(str(cached))
            except Exception:  # a truncated or foreign file: rebuild it
                tok = None
        if tok is None:
            tok = build_tokenizer(ranks, specials)
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                partial = cached.with_suffix(f".{os.getpid()}.tmp")
                tok.save(str(partial))
                partial.replace(cached)  # whole or not at all: another process may be reading it
            except OSError as e:
                log.debug("cannot cache the tokenizer in %s: %s", cached.parent, e)
        return cls(tok, ranks, specials)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. With allow_special, special-token text becomes the special ids; without,
        it is ordinary text (a user typing `<|open|>` gets plain BPE)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: replaced with U+FFFD, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return (self.tok if allow_special else self.plain).encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self.special_ids:
            return self.special_ids[token_id].encode()
        try:
            return self._bytes[token_id]
        except KeyError:
            raise DeltafinError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})") from None

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        data = b"".join(self.token_bytes(i) for i in ids if not (skip_special and i in self.special_ids))
        return data.decode("utf-8", errors="replace")


def _read_specials(model_dir: Path, n_base: int) -> dict[str, int]:
    cfg_path = model_dir / "tokenizer_config.json"
    if not cfg_path.is_file():
        return vocab.special_tokens(n_base)
    try:
        decoder = json.loads(cfg_path.read_text()).get("added_tokens_decoder", {})
        return {entry["content"]: int(i) for i, entry in decoder.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DeltafinError(f"{cfg_path} is not a valid tokenizer config: {e}") from None


class StreamDecoder:
    """Turns a stream of token ids into text pieces that never end mid-character: bytes of an incomplete
    UTF-8 sequence wait for the next token; `flush()` ends the stream (invalid bytes become U+FFFD)."""

    def __init__(self, tokenizer: K3Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self.skip_special and token_id in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
