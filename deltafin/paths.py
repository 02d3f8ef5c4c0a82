"""Where Deltafin keeps what it derives: one rule for every cache (built kernels, derived tokenizers, the
demo's synthetic checkpoint, reference files the tests fetch).

    $DELTAFIN_CACHE, else $XDG_CACHE_HOME/deltafin, else ~/.cache/deltafin

Nothing is ever written into a model directory: it may be read-only or shared (a Hugging Face cache), and a
file beside the checkpoint changes what other tools load from it.
"""

from __future__ import annotations

import os
from pathlib import Path


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
