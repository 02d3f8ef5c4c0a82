"""k3-mini's training data: the standard library's docstrings (and short sources) as K3 chat turns.

Every public module, top-level function, class and method of a top-level class with a docstring becomes an
`Entry`; each entry becomes one to three question/answer conversations (what it does, its signature, its
source), phrased by a seeded `random.Random` so the corpus is the same on every run of one Python. Whole
modules are held out (by a hash of the module's name, not by chance), so the held-out loss measures
documentation the model has never seen, not paraphrases of it. Nothing here touches the network.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import json
import logging
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltafin.text import chat
from deltafin.text.tokenizer import K3Tokenizer

log = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]

SKIP_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo",
                        "ensurepip", "pydoc_data", "encodings"})
MIN_DOC = 20  # characters: shorter docstrings say too little to answer with
MAX_DOC = 1200  # characters of a docstring kept, cut at a paragraph boundary where one is late enough
MAX_SOURCE = 1500  # characters: a longer definition is not shown as source
MIN_CONVERSATIONS = 2  # per entry (at most 3: one per question kind)
THINKING_SHARE = 0.8  # of encoded conversations rendered with the think channel


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Entry:
    module: str  # dotted: "json.decoder"
    qualname: str  # "JSONDecoder.decode"; "" for the module itself
    kind: str  # module | class | function | method
    signature: str  # "dumps(obj, *, skipkeys=False, ...)"; "" for modules and classes without __init__
    doc: str  # the cleaned docstring, at most MAX_DOC characters
    source: str  # the definition's source, "" for modules and definitions over MAX_SOURCE characters
    path: str = ""  # the file, relative to the standard library: "json/__init__.py"

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


def module_name(rel: Path) -> str | None:
    """The dotted module of a file relative to the library root, or None for a file the corpus skips."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if not parts or any(p in SKIP_PARTS or p.startswith("_") or not p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def modules(root: Path) -> Iterator[tuple[str, Path, str]]:
    """(module, path relative to `root`, text) of every file the corpus reads, in sorted order."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        module = module_name(rel)
        if module is None or any(p in SKIP_PARTS for p in rel.parts):
            continue
        try:
            yield module, rel, path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            log.debug("skipping %s: %s", path, e)


def entries(root: Path) -> list[Entry]:
    """Every documented public definition under `root`, files in sorted order."""
    out: list[Entry] = []
    for module, rel, text in modules(root):
        try:
            tree = ast.parse(text, filename=str(rel))
        except (SyntaxError, ValueError) as e:
            log.debug("skipping %s: %s", rel, e)
            continue
        out += _file_entries(module, rel.as_posix(), text.splitlines(keepends=True), tree)
    log.info("%d entries from %s", len(out), root)
    return out


def _file_entries(module: str, rel: str, lines: list[str], tree: ast.Module) -> list[Entry]:
    out = []
    doc = _doc(ast.get_docstring(tree, clean=False))
    if doc:
        out.append(Entry(module, "", "module", "", doc, "", rel))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out += _definition(module, rel, lines, node, "", "function")
        elif isinstance(node, ast.ClassDef):
            out += _definition(module, rel, lines, node, "", "class")
            if node.name.startswith("_"):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    out += _definition(module, rel, lines, item, node.name + ".", "method")
    return out


def _definition(module: str, rel: str, lines: list[str], node: ast.AST, prefix: str, kind: str) -> list[Entry]:
    name = node.name  # type: ignore[attr-defined]
    doc = _doc(ast.get_docstring(node, clean=False))  # type: ignore[arg-type]
    if name.startswith("_") or not doc:
        return []
    source = _segment(lines, node)
    if len(source) > MAX_SOURCE:
        source = ""
    return [Entry(module, prefix + name, kind, _signature(node), doc, source, rel)]


def _segment(lines: list[str], node: ast.AST) -> str:
    """The definition's source, dedented (ast.get_source_segment re-splits the file on every call). Column
    offsets count UTF-8 bytes."""
    first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[attr-defined]
    start, end = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
    cut = lambda line, a, b=None: line.encode()[a:b].decode(errors="replace")
    if first == last:
        return cut(lines[first], start, end)
    head = " " * start + cut(lines[first], start)
    return textwrap.dedent("".join([head, *lines[first + 1:last], cut(lines[last], 0, end)]))


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            return ""
        args = copy.copy(init.args)  # without `self`
        if args.posonlyargs:
            args.posonlyargs = args.posonlyargs[1:]
        else:
            args.args = args.args[1:]
        return f"{node.name}({ast.unparse(args)})"
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{node.name}({ast.unparse(node.args)}){returns}"


def _doc(raw: str | None) -> str:
    """The cleaned docstring cut to MAX_DOC characters, or "" when there is none worth keeping."""
    if raw is None:
        return ""
    doc = inspect.cleandoc(raw).strip()
    if len(doc) < MIN_DOC:
        return ""
    if len(doc) <= MAX_DOC:
        return doc
    cut = doc.rfind("\n\n", 0, MAX_DOC)
    if cut < MAX_DOC // 4:
        cut = max(doc.rfind("\n", 0, MAX_DOC), doc.rfind(" ", 0, MAX_DOC))
    return doc[:cut if cut > 0 else MAX_DOC].rstrip()


def first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    m = re.search(r"^.*?[.!?](?=\s|$)", paragraph)
    return m.group(0) if m else paragraph


# ---- conversations ------------------------------------------------------------------------------------

EXPLAIN = ("What does `{n}` do?", "Explain `{n}`.", "How do I use {n}?", "What is `{n}` for?",
           "Can you describe `{n}`?", "Tell me about {n}.")
MODULE = ("What is the `{n}` module for?", "Tell me about the {n} module.", "What does the `{n}` module do?",
          "Explain the `{n}` module.")
SOURCE = ("Show me the source of `{n}`.", "How is `{n}` implemented?", "What does the code of `{n}` look like?")
SIGNATURE = ("What is the signature of `{n}`?", "What arguments does `{n}` take?", "How do I call `{n}`?")
REASONING = ("The user asks about `{n}` from the `{m}` module.",
             "This is a question about the {k} `{n}` in `{m}`.",
             "`{n}` is a {k} in the standard library's `{m}` module; its docstring answers this.",
             "The question is about `{n}`, a {k} of `{m}`.")
REASONING_SOURCE = ("The user wants the source code of `{n}`, which is in `Lib/{p}`.",
                    "They ask how `{n}` is implemented: I'll show its definition from `Lib/{p}`.")
REASONING_SIGNATURE = ("The user wants the signature of the {k} `{n}`.",
                       "They ask how to call `{n}` from `{m}`: its parameters, then what it does.")


def _explain_answer(e: Entry) -> str:
    if e.kind == "module":
        return e.doc
    if e.kind == "class":
        return f"`{e.name}` is a class in `{e.module}`. {e.doc}"
    if e.kind == "method":
        cls = e.qualname.rpartition(".")[0]
        return f"`{cls}.{e.signature}` is a method of `{e.module}.{cls}`. {e.doc}"
    return f"`{e.module}.{e.signature}` (a function in the `{e.module}` module)\n\n{e.doc}"


def _qualified_signature(e: Entry) -> str:
    owner = e.qualname.rpartition(".")[0]
    return ".".join(p for p in (e.module, owner, e.signature) if p)


def _turns(e: Entry) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], str]]:
    """Question kind -> (phrasings, reasoning phrasings, answer) for the kinds this entry can answer."""
    out = {"explain": (MODULE if e.kind == "module" else EXPLAIN, REASONING, _explain_answer(e))}
    if e.source:
        code = f"Here is `{e.name}` from `Lib/{e.path}`:\n\n```python\n{e.source.rstrip()}\n```"
        out["source"] = (SOURCE, REASONING_SOURCE, code)
    if e.signature:
        out["signature"] = (SIGNATURE, REASONING_SIGNATURE, f"`{_qualified_signature(e)}`\n\n{first_sentence(e.doc)}")
    return out


def _entry_conversations(e: Entry, rng: random.Random) -> list[Conversation]:
    """One conversation per question kind the entry can answer (what it does, its signature, its source),
    in a seeded order; an entry with only one kind is asked about twice, in two phrasings."""
    turns = _turns(e)
    kinds = ["explain"] + rng.sample(sorted(set(turns) - {"explain"}), len(turns) - 1)
    if len(kinds) < MIN_CONVERSATIONS:
        kinds += ["explain"] * (MIN_CONVERSATIONS - len(kinds))
    fill = {"n": e.name, "m": e.module, "k": e.kind, "p": e.path}
    out, asked = [], set()
    for kind in kinds:
        questions, reasons, answer = turns[kind]
        question = rng.choice([q for q in questions if q not in asked])
        asked.add(question)
        out.append([{"role": "user", "content": question.format(**fill)},
                    {"role": "assistant", "content": answer, "reasoning_content": rng.choice(reasons).format(**fill)}])
    return out


def labeled_conversations(items: Iterable[Entry], seed: int) -> list[tuple[str, Conversation]]:
    """(module, conversation) for every conversation of every entry, in the entries' order."""
    rng = random.Random(seed)
    return [(e.module, conv) for e in items for conv in _entry_conversations(e, rng)]


def conversations(items: Iterable[Entry], seed: int) -> list[Conversation]:
    return [conv for _, conv in labeled_conversations(items, seed)]


def held_out(module: str, heldout_every: int = 40) -> bool:
    return int(hashlib.blake2b(module.encode(), digest_size=4).hexdigest(), 16) % heldout_every == 0


def split(convs_with_modules: Iterable[tuple[str, Conversation]], heldout_every: int = 40,
          seed: int = 0) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out): whole modules held out by their name's hash; train shuffled with `seed`."""
    train, heldout = [], []
    for module, conv in convs_with_modules:
        (heldout if held_out(module, heldout_every) else train).append(conv)
    random.Random(seed).shuffle(train)
    return train, heldout


def write_jsonl(path: Path, convs: Iterable[Conversation]) -> None:
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs), encoding="utf-8")


def read_jsonl(path: Path) -> list[Conversation]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---- K3 chat text and tokens --------------------------------------------------------------------------


def chat_options(thinking: bool) -> chat.ChatOptions:
    """Thinking: the think channel and the default effort message; otherwise neither (reasoning is dropped)."""
    if thinking:
        return chat.ChatOptions(add_generation_prompt=False)
    return chat.ChatOptions(thinking=False, effort=None, add_generation_prompt=False)


def render(conv: Conversation, thinking: bool) -> str:
    return chat.render_text(conv, chat_options(thinking))


def encode_all(tokenizer: K3Tokenizer, convs: Iterable[Conversation], seed: int) -> list[list[int]]:
    """Every conversation's token ids, THINKING_SHARE of them (seeded) with the think channel."""
    rng = random.Random(seed)
    return [chat.encode(tokenizer, conv, chat_options(rng.random() < THINKING_SHARE)) for conv in convs]


# ---- source code as plain documents ----------------------------------------------------------------------


def source_documents(root: Path, max_chars: int = 2000) -> list[tuple[str, str]]:
    """(module, piece) for the source of every module the corpus reads: each file cut at blank lines into
    pieces of at most `max_chars` (a longer block alone), each headed by its path, `# Lib/json/decoder.py`.
    Plain text, not chat: what teaches the model to write Python."""
    out = []
    for module, rel, text in modules(root):
        head = f"# Lib/{rel.as_posix()}\n"
        piece = ""
        for block in re.split(r"\n\s*\n", text):
            if piece and len(piece) + len(block) + 2 > max_chars:
                out.append((module, head + piece))
                piece = ""
            piece = f"{piece}\n\n{block}" if piece else block
        if piece.strip():
            out.append((module, head + piece))
    return out
