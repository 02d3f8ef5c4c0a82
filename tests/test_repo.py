"""The repository's own promises: CI runs exactly the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    assert len(blocks) >= 2, "README must show the install/demo command and the test command"
    test_command = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci]
    assert "pip install -q torch==2.13.0" in "\n".join(ci)
