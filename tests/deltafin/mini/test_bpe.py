"""The trained vocabulary: dense ranks over the 256 bytes, files K3Tokenizer loads, and tiktoken (an
independent implementation) encoding text to the same ids with the same ranks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tiktoken

from deltafin.mini import bpe, corpus
from deltafin.text import vocab
from deltafin.text.tokenizer import K3Tokenizer, unicode_to_bytes

N_BASE = 1024
SAMPLES = [
    "Serialize ``obj`` to a JSON formatted ``str``.\n\nIf ``skipkeys`` is true then ``dict`` keys that are not "
    "basic types (``str``, ``int``, ``float``, ``bool``, ``None``) will be skipped.",
    "def indent(text, prefix, predicate=None):\n    if predicate is None:\n        def predicate(line):\n"
    "            return line.strip()\n\n\treturn ''.join(prefix + line for line in text.splitlines(True))\r\n",
    "Unicode: naïve café, Größe, 人工智能正在改变我们的世界, こんにちは, 한국어, привет мир, 🙂🚀 👩‍👩‍👧",
    "Numbers 3.14159 1234567890 2026-11-30 $19.99 100% 1e-6 0x7fff_ffff and I'm sure they'll say it's RIGHT.",
    "   leading and trailing spaces   \n\n\n   \t\t  mixed  \u3000 ideographic",
    'message role="user" response think <|open|> <|end_of_msg|> look like specials but are text',
    "x" * 300 + " " + "ab" * 200,
    "",
]


@pytest.fixture(scope="module")
def convs(tmp_path_factory: pytest.TempPathFactory) -> list[corpus.Conversation]:
    lib = tmp_path_factory.mktemp("lib")
    for package in ("json", "email"):
        shutil.copytree(corpus.stdlib_root() / package, lib / package, ignore=shutil.ignore_patterns("__pycache__"))
    return corpus.conversations(corpus.entries(lib), 0)


@pytest.fixture(scope="module")
def ranks(convs: list[corpus.Conversation]) -> dict[bytes, int]:
    return bpe.train_ranks(bpe.training_texts(convs), N_BASE)


@pytest.fixture(scope="module")
def pair(ranks: dict[bytes, int], tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("mini-vocab")
    bpe.write_vocab(d, ranks, N_BASE)
    ref = tiktoken.Encoding("k3-mini-test", pat_str=vocab.PRETOKENIZE_REGEX, mergeable_ranks=vocab.read_tiktoken(
        d / "tiktoken.model"), special_tokens=vocab.special_tokens(N_BASE))
    return K3Tokenizer.load(d), ref


def test_unicode_to_bytes_inverts_the_byte_level_map() -> None:
    assert unicode_to_bytes("Ġhello") == b" hello" and unicode_to_bytes("Ċ") == b"\n"
    assert unicode_to_bytes("".join(chr(c) for c in range(ord("!"), ord("~") + 1))) == bytes(range(33, 127))


def test_ranks_are_dense_over_the_bytes(ranks: dict[bytes, int]) -> None:
    assert sorted(ranks.values()) == list(range(N_BASE))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert all(len(tok) > 1 for tok, r in ranks.items() if r >= 256)
    assert {b" the", b"def", b" self", b"json", b"email"} <= set(ranks)  # learned from the corpus


def test_training_is_deterministic(convs: list[corpus.Conversation], ranks: dict[bytes, int]) -> None:
    assert bpe.train_ranks(bpe.training_texts(convs), N_BASE) == ranks


def test_training_sees_no_special_markers(convs: list[corpus.Conversation]) -> None:
    texts = list(bpe.training_texts(convs[:20]))
    assert 'message role="user"' in texts and "think" in texts and convs[0][0]["content"] in texts
    assert not [t for t in texts if any(m in t for m in ("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"))]


def test_too_little_text_is_refused() -> None:
    with pytest.raises(ValueError, match="supports only"):
        bpe.train_ranks(["tiny text"], 512)


def test_k3_tokenizer_matches_tiktoken(pair, convs: list[corpus.Conversation]) -> None:
    ours, ref = pair
    for text in SAMPLES + list(bpe.training_texts(convs[:50])):
        ids = ours.encode(text)
        assert ids == ref.encode_ordinary(text), text
        assert ours.encode(text, allow_special=True) == ref.encode(text, allowed_special="all"), text
        assert ours.decode(ids) == text
    assert ours.vocab_size == N_BASE + vocab.N_SPECIAL


def test_the_vocabulary_files(pair, tmp_path: Path, ranks: dict[bytes, int]) -> None:
    ours, _ = pair
    assert ours.specials["<|open|>"] == N_BASE + 3 and ours.specials["[EOS]"] == N_BASE + 1
    with pytest.raises(ValueError, match="exactly"):
        bpe.write_vocab(tmp_path, {b"a": 0}, N_BASE)
