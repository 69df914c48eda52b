"""The alert-condition language of `alert.if`, parsed by hand and never `eval`-ed.

Grammar (`and` binds tighter than `or`)::

    condition  := conjunct ("or" conjunct)*
    conjunct   := atom ("and" atom)*
    atom       := "(" condition ")" | STAT OP NUMBER
    OP         := ">" | ">=" | "<" | "<=" | "==" | "!="
    NUMBER     := a decimal or exponent literal, optionally signed; "inf" and "nan" are refused

A condition compares statistics (the names of `hookpolicy.model.STATS`) with numbers.
Comparisons follow IEEE rules, so `l2_norm > 10` is false when the norm is NaN: guard
non-finite values with `nonfinite > 0`.
"""

from __future__ import annotations

import difflib
import math
import operator
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Union

__all__ = ["Condition", "Compare", "Junction", "ExprError", "parse", "STAT_NAMES"]

MAX_DEPTH = 32

STAT_NAMES: frozenset[str] = frozenset(
    {"l2_norm", "mean", "std", "min", "max", "abs_max", "rms", "zero_fraction", "nonfinite", "numel"}
)

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt,
    "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}
_TOKEN = re.compile(
    r"\s*(?:(?P<num>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<op>>=|<=|==|!=|>|<)|(?P<paren>[()])|(?P<word>[A-Za-z_][A-Za-z0-9_]*))"
)


class ExprError(ValueError):
    """A condition that does not parse; `offset` is the 0-based character position."""

    def __init__(self, message: str, offset: int) -> None:
        self.offset = offset
        super().__init__(message)


@dataclass(frozen=True)
class Compare:
    stat: str
    op: str
    value: float

    def evaluate(self, values: Mapping[str, float]) -> bool:
        return _OPS[self.op](values[self.stat], self.value)

    def __str__(self) -> str:
        return f"{self.stat} {self.op} {self.value:g}"


@dataclass(frozen=True)
class Junction:
    kind: str  # "and" | "or"
    parts: tuple["Node", ...]

    def evaluate(self, values: Mapping[str, float]) -> bool:
        results = (part.evaluate(values) for part in self.parts)
        return all(results) if self.kind == "and" else any(results)

    def __str__(self) -> str:
        return f" {self.kind} ".join(
            f"({p})" if isinstance(p, Junction) else str(p) for p in self.parts
        )


Node = Union[Compare, Junction]


@dataclass(frozen=True)
class Condition:
    """A parsed `alert.if`: `evaluate(stats)` is all there is to run it."""

    root: Node
    stats: frozenset[str]

    def evaluate(self, values: Mapping[str, float]) -> bool:
        return self.root.evaluate(values)

    def __str__(self) -> str:
        return str(self.root)


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens: list[tuple[str, str, int]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            start = len(text) - len(text[pos:].lstrip())
            raise ExprError(f"unexpected character {text[start]!r}", start)
        kind = m.lastgroup or ""
        tokens.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    tokens.append(("end", "", len(text)))
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.i = 0
        self.depth = 0
        self.stats: set[str] = set()

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.i]

    def take(self) -> tuple[str, str, int]:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def junction(self, kind: str, sub: Callable[[], Node]) -> Node:
        parts = [sub()]
        while self.peek()[:2] == ("word", kind):
            self.take()
            parts.append(sub())
        return parts[0] if len(parts) == 1 else Junction(kind, tuple(parts))

    def condition(self) -> Node:
        return self.junction("or", self.conjunct)

    def conjunct(self) -> Node:
        return self.junction("and", self.atom)

    def atom(self) -> Node:
        kind, text, at = self.take()
        if (kind, text) == ("paren", "("):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExprError(f"parentheses nested deeper than {MAX_DEPTH}", at)
            inner = self.condition()
            self.depth -= 1
            kind, text, at = self.take()
            if (kind, text) != ("paren", ")"):
                raise ExprError(f"expected ')' but found {text or 'the end'!r}", at)
            return inner
        if kind != "word" or text in ("and", "or"):
            raise ExprError(f"expected a statistic or '(' but found {text or 'the end'!r}", at)
        if text not in STAT_NAMES:
            close = difflib.get_close_matches(text, sorted(STAT_NAMES), n=1, cutoff=0.6)
            hint = f" did you mean {close[0]!r}?" if close else ""
            raise ExprError(
                f"unknown statistic {text!r};{hint} one of: {', '.join(sorted(STAT_NAMES))}", at
            )
        op_kind, op, op_at = self.take()
        if op_kind != "op":
            raise ExprError(
                f"expected a comparison ({' '.join(_OPS)}) after {text!r} but found "
                f"{op or 'the end'!r}", op_at,
            )
        num_kind, num, num_at = self.take()
        if num_kind != "num":
            raise ExprError(f"expected a number after {op!r} but found {num or 'the end'!r}", num_at)
        value = float(num)
        if not math.isfinite(value):
            raise ExprError(f"{num!r} is not a finite number", num_at)
        self.stats.add(text)
        return Compare(text, op, value)


def parse(text: str) -> Condition:
    """Parse an `alert.if` condition; raises `ExprError` with the offending position."""
    parser = _Parser(text)
    root = parser.condition()
    kind, tok, at = parser.peek()
    if kind != "end":
        raise ExprError(f"expected 'and', 'or' or the end but found {tok!r}", at)
    return Condition(root, frozenset(parser.stats))
