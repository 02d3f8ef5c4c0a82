"""Where Deltafin keeps what it derives: one rule for every cache (built kernels, derived tokenizers, the
demo's synthetic checkpoint, reference files the tests fetch).

    $DELTAFIN_CACHE, else $XDG_CACHE_HOME/deltafin, else ~/.cache/deltafin

Nothing is ever written into a model directory: it may be read-only or shared (a Hugging Face cache), and a
file beside the checkpoint changes what other tools load from it.
"""

from __future__ import annotations

import os
from pathlib import Path

BUNDLED = "k3-mini"  # the name of the model that ships inside the package


def cache_dir(*parts: str) -> Path:
    """The cache root, or a folder under it (not created)."""
    root = os.environ.get("DELTAFIN_CACHE")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltafin"
    return base.joinpath(*parts)


def bundled_model() -> Path:
    """k3-mini, the small K3 trained on Python's documentation that ships inside the package (deltafin/mini/):
    what `deltafin demo` and the README's examples run."""
    return Path(__file__).resolve().parent / "assets" / "k3-mini"


def models_dir() -> Path:
    """Where models are kept by name: what `deltafin download` writes by default, what `--model NAME` finds."""
    return cache_dir("models")


def model_path(model: str | Path) -> Path:
    """`resolve_model`, but what names no model stays as given: the command then says what is missing there."""
    try:
        return resolve_model(model)
    except FileNotFoundError:
        return Path(model)


def resolve_model(model: str | Path) -> Path:
    """A model as the user names it: a directory (with a config.json or not: the commands say what is wrong with
    it), the bundled `k3-mini`, or a name under models_dir(). A name that is none of these: FileNotFoundError
    naming what was looked for and where names come from."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = str(model)
    if name == BUNDLED:
        return bundled_model()
    if name and "/" not in name and (models_dir() / name).is_dir():
        return models_dir() / name
    if path.exists():
        return path  # a file: the command says it is not a model directory
    known = ", ".join([BUNDLED, *sorted(p.name for p in models_dir().glob("*") if p.is_dir())])
    raise FileNotFoundError(f"no model {name!r}: not a directory, and no model of that name (known: {known}; "
                            f"`deltafin models` lists them, `deltafin download SOURCE` adds one to {models_dir()})")
