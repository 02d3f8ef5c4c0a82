"""Deltafin: run Kimi K3 on one or more Apple Silicon Macs.

The Python API (deltafin/api.py) is here, imported when first used: `deltafin.load(DIR)` runs K3 in this process,
`deltafin.connect(DIR, workers=[...])` on workers; `deltafin.KimiK3Engine(model_path=...)` is the short form.
"""

from __future__ import annotations

from typing import Any

from deltafin.version import __version__ as __version__  # `deltafin.__version__`

__all__ = ["ChatReply", "Completion", "KimiK3Engine", "Model", "Piece", "StageStats", "connect", "load"]


def __getattr__(name: str) -> Any:  # lazily: `import deltafin.checkpoint.config` need not load the engine
    if name in __all__:
        from deltafin import api  # the engine (torch, grpc) loads on first use, not on `import deltafin`

        return getattr(api, name)
    raise AttributeError(f"module 'deltafin' has no attribute {name!r}")
