"""The expression language of `alert.if`, `clip.max_norm` and message fields: parsed by hand, never `eval`-ed.

Grammar (`and` binds tighter than `or`; `*` `/` tighter than `+` `-`)::

    condition  := conjunct ("or" conjunct)*
    conjunct   := atom ("and" atom)*
    atom       := "(" condition ")" | sum OP sum
    sum        := term (("+" | "-") term)*
    term       := factor (("*" | "/") factor)*
    factor     := NUMBER | NAME | FUNC "(" NAME ["," NUMBER] ")" | "(" sum ")" | ("-" | "+") factor
    OP         := ">" | ">=" | "<" | "<=" | "==" | "!="
    NUMBER     := a decimal or exponent literal; "inf" and "nan" are refused

A NAME is a statistic (`l2_norm`, `mean`, ...) or an alias a caller passes in (`norm` for
a clip's own norm, `loss` for `target: loss`): its **current** value. A FUNC reads the
**past** values of the same series (never the current one), kept by
`hookpolicy.engine.measure.history`: `prev(x)`, `count(x)` (how many values it has had),
`ema(x, alpha)`, `ema_std(x, alpha)`,
`mean(x, W)`, `std(x, W)`, `min(x, W)`, `max(x, W)`, `median(x, W)`, `mad(x, W)` (the
median absolute deviation from that median), `zscore(x, W)`, which is
`(x - mean(x, W)) / std(x, W)` with `x` the current value, and `robust_z(x, W)`, which is
`(x - median(x, W)) / (MAD_SCALE * mad(x, W))`: MAD_SCALE (1.4826, R's `mad()` constant,
1/Phi^-1(3/4)) makes the MAD of normal data estimate its standard deviation. `mean`, `std`, `min` and `max`
are statistics when bare and functions when followed by `(`.

The parser reads one unified precedence grammar (comparisons and arithmetic in one
pass, no backtracking) and then checks kinds: `and`/`or` join comparisons, comparisons
and arithmetic take numbers. Every error carries the 0-based offset of what is wrong.

Arithmetic follows IEEE: `x / 0` is +-inf or nan, never an exception; a function with no
past value is nan; a comparison with nan is false, so `l2_norm > 10` is false when the
norm is NaN (guard non-finite values with `nonfinite > 0`).
"""

from __future__ import annotations

import difflib
import functools
import math
import operator
import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

__all__ = [
    "Arith", "Call", "Compare", "Condition", "ExprError", "FUNCTIONS", "Junction", "MAD_SCALE", "MAX_EXPR_NESTING",
    "MAX_OPERATIONS_DEEP", "MAX_TOKENS", "MAX_WINDOW", "Name", "Neg", "Num", "NO_PAST", "Past", "STATS", "Template", "UPDATE_RATIO",
    "Value", "names_with", "parse", "parse_value",
]

#: An expression nested deeper than this many parentheses or signs is refused (the parser recurses).
MAX_EXPR_NESTING = 32
#: Operations nested in one another, at most: every arithmetic operator, comparison,
#: `and`/`or` and sign counts, so a flat chain `a + b + c` is two deep. Evaluation (and
#: comparing or printing an expression) recurses once or twice per level, inside hooks
#: that may already run deep in a model's forward; 64 levels keep it far from Python's
#: recursion limit. (A chain of ~1,000 terms raised RecursionError at every evaluation.)
MAX_OPERATIONS_DEEP = 64
#: Tokens in one expression, at most: what one evaluation costs is bounded with it.
MAX_TOKENS = 1000
#: The largest window a function may name: each series keeps at most this many floats.
MAX_WINDOW = 10000

#: The statistics of a tensor, in the order every listing uses: the one definition of their names
#: (`policy.model`, the engine, the metric families and the schema's enum all follow it).
STATS: tuple[str, ...] = (
    "l2_norm", "mean", "std", "min", "max", "abs_max", "rms", "zero_fraction", "nonfinite", "numel", "update_ratio",
)
#: The statistic of `target: update` alone: the update's L2 norm over its parameter's before the update.
UPDATE_RATIO = "update_ratio"
_STAT_SET = frozenset(STATS)
#: The names a condition may use when its caller adds none: each statistic, as itself.
_STAT_TABLE: Mapping[str, str] = {name: name for name in STATS}

#: function -> what its second argument is ("" for none).
FUNCTIONS: Mapping[str, str] = {
    "prev": "", "count": "", "ema": "alpha", "ema_std": "alpha",
    "mean": "window", "std": "window", "min": "window", "max": "window", "zscore": "window",
    "median": "window", "mad": "window", "robust_z": "window",
}
#: An expression's errors said at most (the first of them, in text order).
MAX_EXPR_ERRORS = 10

#: `robust_z` divides by MAD_SCALE * mad: for normal data that estimates the standard deviation.
MAD_SCALE = 1.4826

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt,
    "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}
_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<op>>=|<=|==|!=|>|<)|(?P<arith>[-+*/])|(?P<paren>[()])|(?P<comma>,)"
    r"|(?P<word>[A-Za-z_][A-Za-z0-9_]*))"
)
_SPACE = re.compile(r"\s*")


class ExprError(ValueError):
    """An expression that does not parse; `offset` is the 0-based character position."""

    def __init__(self, message: str, offset: int, others: tuple["ExprError", ...] = ()) -> None:
        self.offset = offset
        #: the expression's further errors (unknown names past the first), in text order
        self.others = others
        super().__init__(message)


class Past(Protocol):
    """The past values of the series an expression is evaluated for (`hookpolicy.engine.measure.history`)."""

    def aggregate(self, func: str, series: str, param: float) -> float:
        """`func` (one of FUNCTIONS but zscore and robust_z) over the past of `series`; nan with none (count: 0)."""


class _NoPast:
    def aggregate(self, func: str, series: str, param: float) -> float:
        return 0.0 if func == "count" else math.nan


#: The past of a series that has none: every function is nan.
NO_PAST: Past = _NoPast()


def _divide(a: float, b: float) -> float:
    """`a / b` as IEEE has it: +-inf or nan for `b == 0`, never ZeroDivisionError.

    A 0-dim tensor operand (a clip's current norm, on the device) divides as tensors do,
    which is IEEE already: testing `b != 0` on it would read it back.
    """
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return a / b
    if b != 0 or math.isnan(b):
        return a / b
    if a == 0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


_ARITH: dict[str, Callable[[float, float], float]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": _divide,
}


# --------------------------------------------------------------------------- the tree


@dataclass(frozen=True)
class Num:
    value: float

    def evaluate(self, values: Mapping[str, float], past: Past) -> float:
        return self.value

    def __str__(self) -> str:
        return f"{self.value:g}"


@dataclass(frozen=True)
class Name:
    """The current value of a series: `text` as written, `series` the statistic it names."""

    text: str
    series: str

    def evaluate(self, values: Mapping[str, float], past: Past) -> float:
        return values[self.series]

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Call:
    """A history function over the past of `series` (`param`: its window or alpha, 0 for prev)."""

    func: str
    text: str
    series: str
    param: float = 0.0

    def evaluate(self, values: Mapping[str, float], past: Past) -> float:
        if self.func == "zscore":
            deviation = values[self.series] - past.aggregate("mean", self.series, self.param)
            return _divide(deviation, past.aggregate("std", self.series, self.param))
        if self.func == "robust_z":
            deviation = values[self.series] - past.aggregate("median", self.series, self.param)
            return _divide(deviation, MAD_SCALE * past.aggregate("mad", self.series, self.param))
        return past.aggregate(self.func, self.series, self.param)

    def __str__(self) -> str:
        return f"{self.func}({self.text})" if not FUNCTIONS[self.func] else f"{self.func}({self.text}, {self.param:g})"


@dataclass(frozen=True)
class Neg:
    operand: "Number"

    def evaluate(self, values: Mapping[str, float], past: Past) -> float:
        return -self.operand.evaluate(values, past)

    def __str__(self) -> str:
        return f"-({self.operand})" if isinstance(self.operand, (Arith, Neg)) else f"-{self.operand}"


@dataclass(frozen=True)
class Arith:
    op: str
    left: "Number"
    right: "Number"

    def evaluate(self, values: Mapping[str, float], past: Past) -> float:
        return _ARITH[self.op](self.left.evaluate(values, past), self.right.evaluate(values, past))

    def __str__(self) -> str:
        return f"{_operand(self.left, self.op, False)} {self.op} {_operand(self.right, self.op, True)}"


Number = Union[Num, Name, Call, Neg, Arith]


@dataclass(frozen=True)
class Compare:
    op: str
    left: Number
    right: Number

    def evaluate(self, values: Mapping[str, float], past: Past) -> bool:
        return _COMPARE[self.op](self.left.evaluate(values, past), self.right.evaluate(values, past))

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"


@dataclass(frozen=True)
class Junction:
    kind: str  # "and" | "or"
    parts: tuple["Truth", ...]

    def evaluate(self, values: Mapping[str, float], past: Past) -> bool:
        results = [part.evaluate(values, past) for part in self.parts]
        if all(isinstance(r, bool) for r in results):
            return all(results) if self.kind == "and" else any(results)
        # a comparison of a tensor is a bool tensor: joined on its device, never read back
        return functools.reduce(operator.and_ if self.kind == "and" else operator.or_, results)

    def __str__(self) -> str:
        return f" {self.kind} ".join(f"({p})" if isinstance(p, Junction) else str(p) for p in self.parts)


Truth = Union[Compare, Junction]
Node = Union[Number, Truth]


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _operand(node: Number, parent: str, right: bool) -> str:
    """`node` as an operand of `parent`, in parentheses only where precedence needs them."""
    if isinstance(node, Arith):
        inner, outer = _PRECEDENCE[node.op], _PRECEDENCE[parent]
        if inner < outer or (right and inner == outer and parent in "-/"):
            return f"({node})"
    return str(node)


def _walk(node: Node) -> list[Node]:
    """Every node under `node`, itself included."""
    out: list[Node] = []
    stack: list[Node] = [node]
    while stack:
        top = stack.pop()
        out.append(top)
        if isinstance(top, Junction):
            stack.extend(top.parts)
        elif isinstance(top, (Compare, Arith)):
            stack.extend((top.left, top.right))
        elif isinstance(top, Neg):
            stack.append(top.operand)
    return out


@dataclass(frozen=True)
class _Parsed:
    """What every parsed expression knows of itself: the statistics it reads now, the functions it calls."""

    #: the statistics whose current values it reads (a function's series included: the
    #: history is fed from the current values, and zscore reads the current one)
    stats: frozenset[str]
    #: the history functions it calls
    calls: frozenset[Call]


def _current(root: Node) -> frozenset[str]:
    """The series whose current value the tree under `root` reads (a Name, or zscore/robust_z)."""
    return frozenset(n.series for n in _walk(root)
                     if isinstance(n, Name) or (isinstance(n, Call) and n.func in ("zscore", "robust_z")))


@dataclass(frozen=True)
class Condition(_Parsed):
    """A parsed `alert.if` or `clip.when`: `evaluate(stats, past)` is all there is to run it.

    A value in `stats` may be a 0-dim tensor (a clip's norm on the device): the result is
    then a bool tensor, computed by the tensors' operators, with nothing read back.
    """

    root: Truth

    def reads(self) -> frozenset[str]:
        """The series whose current value it reads."""
        return _current(self.root)

    def evaluate(self, values: Mapping[str, float], past: Past = NO_PAST) -> bool:
        return self.root.evaluate(values, past)

    def __str__(self) -> str:
        return str(self.root)


@dataclass(frozen=True)
class Value(_Parsed):
    """A parsed numeric expression (`clip.max_norm`, a message field): `evaluate(stats, past)` gives a float.

    As for `Condition`, a 0-dim tensor in `stats` makes the result a 0-dim tensor.
    """

    root: Number

    def reads(self) -> frozenset[str]:
        """The series whose current value it reads."""
        return _current(self.root)

    def evaluate(self, values: Mapping[str, float], past: Past = NO_PAST) -> float:
        return self.root.evaluate(values, past)

    def __str__(self) -> str:
        return str(self.root)


# --------------------------------------------------------------------------- parsing


def names_with(aliases: Mapping[str, str]) -> Mapping[str, str]:
    """The statistic names plus `aliases` (alias -> statistic), e.g. `{"loss": "mean"}` for `target: loss`."""
    return {**_STAT_TABLE, **aliases}


def parse(text: str, names: Optional[Mapping[str, str]] = None) -> Condition:
    """Parse an `alert.if` condition; raises `ExprError` with the offending position.

    `names` maps each name the condition may use to the statistic it reads (default:
    the statistics, as themselves; `names_with` adds aliases).
    """
    parser = _Parser(text, _STAT_TABLE if names is None else names)
    root = parser.whole()
    if not isinstance(root, (Compare, Junction)):
        raise ExprError("expected a comparison (for example 'l2_norm > 10'), found a number", 0)
    return Condition(parser.stats(root), parser.calls(root), root)


def parse_value(text: str, names: Optional[Mapping[str, str]] = None, *, current: bool = True) -> Value:
    """Parse a numeric expression (a `max_norm`, a message field); raises `ExprError`.

    With `current=False` only functions and numbers are allowed: the value is needed before
    the current values exist (a clip's threshold, computed before its norm is known).
    """
    parser = _Parser(text, _STAT_TABLE if names is None else names, current=current)
    root = parser.whole()
    if isinstance(root, (Compare, Junction)):
        raise ExprError("expected a number, found a comparison", 0)
    return Value(parser.stats(root), parser.calls(root), root)


class _Parser:
    """Recursive descent over one precedence grammar, then a check of what each operand is."""

    def __init__(self, text: str, names: Mapping[str, str], current: bool = True) -> None:
        #: C operators (`&&`, `||`): each an error, read as the word it stands for so the parse goes on
        self.lexical: list[ExprError] = []
        self.tokens = _tokenize(text, self.lexical)
        self.names = names
        self.current = current
        self.i = 0
        self.depth = 0
        self.at: dict[int, int] = {}  # id(node) -> its offset, for the kind errors
        self.unknown: list[ExprError] = []  # unknown names: parsing goes on, so that all are said
        self.deep: dict[int, int] = {}  # id(node) -> operations nested in it, itself included

    def stats(self, root: Node) -> frozenset[str]:
        return frozenset(n.series for n in _walk(root) if isinstance(n, (Name, Call)) and n.series in _STAT_SET)

    def calls(self, root: Node) -> frozenset[Call]:
        return frozenset(n for n in _walk(root) if isinstance(n, Call))

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.i]

    def take(self) -> tuple[str, str, int]:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def placed(self, node: Node, at: int) -> Node:
        self.at[id(node)] = at
        return node

    def operation(self, node: Node, at: int, operands: Sequence[Node]) -> Node:
        """`placed`, for a node over `operands`: refused past MAX_OPERATIONS_DEEP, at `at` (its operator)."""
        deep = 1 + max(self.deep.get(id(o), 0) for o in operands)
        if deep > MAX_OPERATIONS_DEEP:
            raise ExprError(
                f"more than {MAX_OPERATIONS_DEEP} operations deep (each operator, comparison, 'and', 'or' and "
                f"sign counts; a + b + c is two): split the expression", at)
        self.deep[id(node)] = deep
        return self.placed(node, at)

    def whole(self) -> Node:
        """The whole expression, or an ExprError for its first error with the others (`others`), in text order.

        Every error is said, each at its position: an unknown name (parsing goes on with a
        stand-in), a C operator (read as its word), and the first syntax error of each part
        between `and`/`or` outside parentheses: after one, parsing starts again past the next
        such `and`/`or`, and the names skipped on the way are still checked (a second syntax
        error in one part is mostly the first one's echo). A character no token starts with
        ends the parse at once (`_tokenize`). At most MAX_EXPR_ERRORS are kept.
        """
        errors = list(self.lexical)
        root: Optional[Node] = None
        while True:
            try:
                node = self.disjunction()
                kind, text, at = self.peek()
                if kind != "end":
                    raise ExprError(f"expected an operator, 'and', 'or' or the end but found {text!r}", at)
                root = node
                break
            except ExprError as exc:
                errors.append(exc)
                resume = self.resume(exc.offset)
                if resume is None:
                    break
                self.i = resume
        found = {(e.offset, str(e)): e for e in errors + self.unknown}
        if found or root is None:
            first, *others = [found[key] for key in sorted(found)][:MAX_EXPR_ERRORS]
            raise ExprError(str(first), first.offset, tuple(others))
        return root

    def resume(self, offset: int) -> Optional[int]:
        """After a syntax error at `offset`: the token after the next `and`/`or` outside parentheses
        (None at the end), having checked the names on the way that the parse did not reach."""
        at = next((j for j, token in enumerate(self.tokens) if token[2] >= offset), len(self.tokens) - 1)
        depth = 0
        for j, (kind, text, _) in enumerate(self.tokens):
            if kind == "paren":
                depth += 1 if text == "(" else -1
            if j >= at and kind == "word" and text in ("and", "or") and depth == 0:
                self.check_names(max(self.i, at), j)
                return j + 1
        self.check_names(max(self.i, at), len(self.tokens))
        return None

    def check_names(self, start: int, end: int) -> None:
        """The unknown names and functions among tokens[start:end], which no parse reached."""
        for j in range(start, end):
            kind, text, at = self.tokens[j]
            if kind != "word" or text in ("and", "or"):
                continue
            if self.tokens[j + 1][:2] == ("paren", "("):
                if text not in FUNCTIONS:
                    self.unknown.append(ExprError(self.not_a_function(text), at))
            else:
                self.known(text, at)

    def disjunction(self) -> Node:
        return self.junction("or", self.conjunction)

    def conjunction(self) -> Node:
        return self.junction("and", self.comparison)

    def junction(self, kind: str, sub: Callable[[], Node]) -> Node:
        at = self.peek()[2]
        parts = [sub()]
        while self.peek()[:2] == ("word", kind):
            self.take()
            parts.append(sub())
        if len(parts) == 1:
            return parts[0]
        truths = tuple(self.truth(part, f"'{kind}' joins comparisons") for part in parts)
        return self.operation(Junction(kind, truths), at, truths)

    def comparison(self) -> Node:
        at = self.peek()[2]
        left = self.sum()
        kind, op, _ = self.peek()
        if kind != "op":
            return left
        _, _, op_at = self.take()
        right = self.sum()
        compare = Compare(op, self.number(left, f"'{op}' compares numbers"), self.number(right, f"'{op}' compares numbers"))
        self.operation(compare, op_at, (left, right))
        return self.placed(compare, at)

    def sum(self) -> Node:
        return self.chain(("+", "-"), self.term)

    def term(self) -> Node:
        return self.chain(("*", "/"), self.factor)

    def chain(self, ops: Sequence[str], sub: Callable[[], Node]) -> Node:
        at = self.peek()[2]
        node = sub()
        while self.peek()[0] == "arith" and self.peek()[1] in ops:
            _, op, op_at = self.take()
            right = sub()
            arith = Arith(op, self.number(node, f"'{op}' takes numbers"), self.number(right, f"'{op}' takes numbers"))
            self.operation(arith, op_at, (node, right))
            node = self.placed(arith, at)
        return node

    def factor(self) -> Node:
        kind, text, at = self.take()
        if kind == "arith" and text in "+-":
            with self.nested(at):
                operand = self.number(self.factor(), f"unary '{text}' takes a number")
            if text == "+":
                return operand
            if isinstance(operand, Num):
                return self.placed(Num(-operand.value), at)
            return self.operation(Neg(operand), at, (operand,))
        if (kind, text) == ("paren", "("):
            with self.nested(at):
                inner = self.disjunction()
            self.expect(")")
            return inner
        if kind == "num":
            return self.placed(Num(self.finite(text, at)), at)
        if kind == "word" and text not in ("and", "or"):
            if self.peek()[:2] == ("paren", "("):
                return self.placed(self.call(text, at), at)
            return self.placed(self.name(text, at), at)
        after = f" after {self.tokens[self.i - 2][1]!r}" if self.i >= 2 else ""
        raise ExprError(f"expected a number, a name, a function or '('{after} but found {text or 'the end'!r}", at)

    def call(self, func: str, at: int) -> Call:
        if func not in FUNCTIONS:
            raise ExprError(self.not_a_function(func), at)
        self.take()  # "("
        kind, text, name_at = self.take()
        usage = _usage(func)
        if kind != "word" or text in ("and", "or"):
            raise ExprError(f"{func} takes the name of a series first ({usage}), not {text or 'the end'!r}", name_at)
        series = self.known(text, name_at)
        param = 0.0
        what = FUNCTIONS[func]
        if what:
            kind, comma, comma_at = self.take()
            if kind != "comma":
                raise ExprError(f"{func} takes two arguments ({usage}); expected ',' but found {comma or 'the end'!r}",
                                comma_at)
            param = self.argument(func, what, usage)
        kind, close, close_at = self.take()
        if (kind, close) != ("paren", ")"):
            raise ExprError(f"{func} takes {'two arguments' if what else 'one argument'} ({usage}); "
                            f"expected ')' but found {close or 'the end'!r}", close_at)
        return Call(func, text, series, param)

    def not_a_function(self, func: str) -> str:
        hint = _did_you_mean(func, FUNCTIONS)
        what = "a statistic, not a function" if func in self.names else "not a function"
        return f"{func!r} is {what};{hint} the functions are: {', '.join(FUNCTIONS)}"

    def argument(self, func: str, what: str, usage: str) -> float:
        """A function's window (an integer in 1..MAX_WINDOW) or alpha (in (0, 1))."""
        kind, text, at = self.take()
        sign = 1.0
        if kind == "arith" and text == "-":
            sign = -1.0
            kind, text, _ = self.take()
        if kind != "num":
            raise ExprError(f"the {what} of {func} is a number ({usage}), not {text or 'the end'!r}", at)
        value = sign * self.finite(text, at)
        if what == "alpha" and not 0.0 < value < 1.0:
            raise ExprError(f"the alpha of {func} must be between 0 and 1 (exclusive), not {value:g}", at)
        if what == "window" and (not value.is_integer() or not 1 <= value <= MAX_WINDOW):
            raise ExprError(f"the window of {func} is a whole number of values from 1 to {MAX_WINDOW}, "
                            f"not {value:g}", at)
        return value

    def name(self, text: str, at: int) -> Name:
        series = self.known(text, at)
        if not self.current:
            raise ExprError(
                f"{text!r} is the current value, which is not known yet where this expression is evaluated: "
                f"use only functions of its past (for example ema({text}, 0.97) or prev({text})) and numbers", at)
        return Name(text, series)

    def known(self, text: str, at: int) -> str:
        """The series a name stands for; an unknown name is an error with a did-you-mean."""
        series = self.names.get(text)
        if series is None:
            hint = _did_you_mean(text, self.names)
            kind = "statistic" if set(self.names) >= _STAT_SET else "name"
            self.unknown.append(ExprError(f"unknown {kind} {text!r};{hint} one of: {', '.join(sorted(self.names))}", at))
            return text  # a stand-in, so that parsing goes on to the next error
        return series

    def finite(self, text: str, at: int) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ExprError(f"{text!r} is not a finite number", at)
        return value

    def expect(self, paren: str) -> None:
        kind, text, at = self.take()
        if (kind, text) != ("paren", paren):
            raise ExprError(f"expected {paren!r} but found {text or 'the end'!r}", at)

    def nested(self, at: int) -> "_Depth":
        return _Depth(self, at)

    def truth(self, node: Node, why: str) -> Truth:
        if not isinstance(node, (Compare, Junction)):
            raise ExprError(f"{why}: expected a comparison here, found a number", self.at.get(id(node), 0))
        return node

    def number(self, node: Node, why: str) -> Number:
        if isinstance(node, (Compare, Junction)):
            raise ExprError(f"{why}: expected a number here, found a comparison", self.at.get(id(node), 0))
        return node


class _Depth:
    """`with parser.nested(at):` around a parenthesis or unary sign, refusing absurd nesting."""

    def __init__(self, parser: _Parser, at: int) -> None:
        self.parser, self.offset = parser, at

    def __enter__(self) -> None:
        self.parser.depth += 1
        if self.parser.depth > MAX_EXPR_NESTING:
            raise ExprError(f"nested deeper than {MAX_EXPR_NESTING} parentheses or signs", self.offset)

    def __exit__(self, *exc: object) -> None:
        self.parser.depth -= 1


def _usage(func: str) -> str:
    what = FUNCTIONS[func]
    return f"{func}(x)" if not what else f"{func}(x, {'alpha' if what == 'alpha' else 'W'})"


def _did_you_mean(text: str, options: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(text, sorted(options), n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


#: the operators of C and Python's bit operators that people write for `and`, `or`, `not`
#: (the language has no `not`: a negation is the opposite comparison)
_C_OPERATORS = (("&&", "and"), ("||", "or"), ("&", "and"), ("|", "or"), ("!", "not"))


def _tokenize(text: str, c_operators: list[ExprError]) -> list[tuple[str, str, int]]:
    """The tokens of `text`, in time linear in its length (at most MAX_TOKENS of them).

    A C operator for `and`/`or` (`&&`, `||`, `&`, `|`) is an error appended to `c_operators`
    and read as the word it stands for, so the rest still parses; any other character no
    token starts with raises at once (with those errors), since what follows it is guesswork.
    """
    tokens: list[tuple[str, str, int]] = []
    pos = _after_space(text, 0)
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            sign, word = next(((s, w) for s, w in _C_OPERATORS if text.startswith(s, pos)), (text[pos], None))
            hint = (f"; write {word!r} to combine comparisons" if word in ("and", "or") else
                    "; the language has no 'not': write the opposite comparison (<= for >, != for ==)" if word else "")
            error = ExprError(f"unexpected character {text[pos]!r}{hint}", pos)
            if word not in ("and", "or"):  # the C operators said so far come first: they are earlier
                first, *others = [*c_operators, error][:MAX_EXPR_ERRORS]
                raise ExprError(str(first), first.offset, tuple(others))
            c_operators.append(error)
            _append(tokens, ("word", word, pos))
            pos = _after_space(text, pos + len(sign))
            continue
        kind = m.lastgroup or ""
        _append(tokens, (kind, m.group(kind), m.start(kind)))
        pos = _after_space(text, m.end())
    tokens.append(("end", "", len(text)))
    return tokens


def _append(tokens: list[tuple[str, str, int]], token: tuple[str, str, int]) -> None:
    if len(tokens) == MAX_TOKENS:
        raise ExprError(f"longer than {MAX_TOKENS} tokens (numbers, names, operators, parentheses)", token[2])
    tokens.append(token)


def _after_space(text: str, pos: int) -> int:
    space = _SPACE.match(text, pos)
    return pos if space is None else space.end()


# --------------------------------------------------------------------------- message templates


class Template(string.Formatter):
    """Renders an alert message whose fields may be expressions: `{zscore(loss, 100):.1f}`.

    A field that is one of `fields` (the expressions the loader parsed out of the template)
    is evaluated; any other is looked up by name (`policy`, `step`, a statistic).
    `get_field` never walks attributes or items, so `{module.__class__}` cannot reach Python
    (the loader refuses it anyway).
    """

    def __init__(self, fields: Mapping[str, Value], stats: Mapping[str, float], past: Past) -> None:
        super().__init__()
        self.fields, self.values, self.past = fields, stats, past

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, str]:
        expression = self.fields.get(field_name)
        if expression is None:
            return kwargs[field_name], field_name
        return expression.evaluate(self.values, self.past), field_name

