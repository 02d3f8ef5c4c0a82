"""Errors a user can act on. Entry points print these as one message, never a traceback."""

from __future__ import annotations


class DeltafinError(Exception):
    """Base class for every error Deltafin reports to its user."""


class ConfigError(DeltafinError):
    """config.json describes a model Deltafin cannot run (unknown type, inconsistent lists, ...)."""


class ModelFormatError(DeltafinError):
    """The checkpoint on disk does not match what its config implies.

    `problems` lists every problem found, each naming the tensor or file concerned.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = self.problems[0] if len(self.problems) == 1 else f"{len(self.problems)} problems"
        body = "" if len(self.problems) == 1 else "\n  - " + "\n  - ".join(self.problems)
        super().__init__(head + body)
