"""deltafin-worker entry point."""

from __future__ import annotations

import sys


def main() -> int:
    print("deltafin-worker: not yet available in this build (see the status table in README.md)", file=sys.stderr)
    return 2
