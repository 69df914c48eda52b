"""Exceptions of hookpolicy: errors are data, one `Problem` per thing that is wrong.

The hierarchy follows prometheus_client's `DuplicateTimeseries(ValueError)`: every
exception subclasses a builtin so callers that do not know hookpolicy still catch it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Problem", "PolicyError", "Halt", "HookPolicyError"]


class HookPolicyError(Exception):
    """Base of hookpolicy's ordinary exceptions."""


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong with a policy file, with where it is.

    `line` and `column` are 1-based; 0 when the problem has no position (an
    unreadable file). `path` is a JSON path such as `$.spec.rules[0].match`.
    """

    file: str
    line: int
    column: int
    path: str
    message: str

    def __str__(self) -> str:
        if self.line == 0 and self.path == "$":  # the file as a whole (missing, unreadable, too big)
            return f"{self.file}: {self.message}"
        return f"{self.file}:{self.line}:{self.column}: {self.path}: {self.message}"


class PolicyError(HookPolicyError, ValueError):
    """A policy could not be loaded; `problems` lists every problem found, in file order."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(sorted(problems))
        super().__init__("\n".join(str(p) for p in self.problems))


class Halt(BaseException):
    """Training was stopped by a rule whose alert says `then: halt` (or by `onError: halt`).

    A `BaseException`, like `SystemExit`: a training loop's `except Exception:` must not
    swallow a request to stop. `hookpolicy apply` turns it into exit status 3.
    """

    def __init__(self, policy: str, rule: str, step: int, message: str) -> None:
        self.policy = policy
        self.rule = rule
        self.step = step
        self.message = message
        super().__init__(self.line())

    def line(self) -> str:
        """The single line `hookpolicy apply` prints for this halt."""
        return f"hookpolicy: halted by {self.policy}/{self.rule} at step {self.step}: {self.message}"
