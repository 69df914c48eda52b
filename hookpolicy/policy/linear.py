"""Pattern matching whose time per name is linear: a lazily built automaton instead of backtracking.

Python's `re` backtracks: `[^.]*a[^.]*a...ab` (the regex of the glob `*a*a...ab`) or
`(a+)+$` take time exponential in the name's length on a name that almost matches, and
matching runs at attach, which under `hookpolicy apply` is the script's first forward.
`compile_linear` turns a regular expression into a Thompson automaton over single
characters (each character test is a one-character regex, so classes, categories and
flags mean exactly what they mean to `re`) and runs it on a set of states: time
O(len(name) x states) at worst, whatever the pattern. Sets met before are remembered per
(set, character), so a name costs about one dict lookup per character in practice; the
memory for that is capped (`MAX_CACHED_SETS` sets), beyond which the cache starts over.

Everything the glob translation produces is in the supported part of the language, and so
is a `re:` pattern made of literals, classes, `.`, groups, alternation, repeats and a
one-character lookahead. What is outside it (backreferences, wider lookarounds, anchors
other than the ends, atomic groups) makes `compile_linear` return None: the caller then
uses `re` behind `regex_guard`.
"""

from __future__ import annotations

import importlib
import re
import threading
from typing import Any, Callable, Optional

__all__ = ["LinearPattern", "MAX_CACHED_SETS", "MAX_STATES", "compile_linear", "regex_guard"]

# The parser and compiler behind `re` (`sre_parse`/`sre_compile` before Python 3.11).
try:
    _parser: Any = importlib.import_module("re._parser")
    _compiler: Any = importlib.import_module("re._compiler")
    _constants: Any = importlib.import_module("re._constants")
except ImportError:  # pragma: no cover - Python 3.10
    _parser = importlib.import_module("sre_parse")
    _compiler = importlib.import_module("sre_compile")
    _constants = importlib.import_module("sre_constants")

#: A pattern whose automaton would need more states than this is refused ("too complex").
MAX_STATES = 4000
#: Remembered state sets per pattern; a name never needs more than len(name) + 1 of them.
MAX_CACHED_SETS = 2000
#: A regex that `re` must run (it uses what the automaton cannot) is at most this long.
MAX_REGEX_LENGTH = 300
#: ... and holds at most this many unbounded repeats (`.*.*.*.*x` is O(n^4) in `re`).
MAX_GUARDED_REPEATS = 3

_CHAR_OPS = {"LITERAL", "NOT_LITERAL", "ANY", "IN"}


class Unsupported(Exception):
    """Part of the pattern is outside what the automaton runs."""


class TooComplex(ValueError):
    """The automaton would be larger than MAX_STATES."""


Test = Callable[[str], bool]


class LinearPattern:
    """A compiled pattern with `re.Pattern`'s `fullmatch(name)`, run in linear time."""

    def __init__(self, pattern: str, tests: list[Optional[Test]], edges: list[tuple[int, ...]],
                 looks: list[Optional[tuple[bool, Test]]], start: int, final: int) -> None:
        self.pattern = pattern
        self._tests = tests    # state -> the test of the character it consumes (None: an epsilon state)
        self._edges = edges    # state -> the states it leads to (after its character, or at once)
        self._looks = looks    # epsilon state -> (passes at the end, test of the next character) or None
        self._final = final
        self._start = frozenset((start,))
        self._lock = threading.Lock()  # the remembered sets are shared by every thread that matches
        self._reset()

    def _reset(self) -> None:
        """Forget the remembered sets (at the cap): the next names rebuild what they need."""
        self._sets: list[frozenset[int]] = [self._start]   # set id -> states
        self._ids = {self._start: 0}                        # states -> set id
        self._next: list[dict[str, int]] = [{}]             # set id -> character -> set id
        self._accepts: list[Optional[bool]] = [None]        # set id -> matches at the end

    def fullmatch(self, name: str) -> Optional[str]:
        """`name` if the whole of it matches, else None (compare with None: "" is a match too)."""
        with self._lock:
            current = 0
            for ch in name:
                found = self._next[current].get(ch)
                current = self._step(current, ch) if found is None else found
                if current < 0:
                    return None
            accepts = self._accepts[current]
            if accepts is None:
                accepts = self._accepts[current] = self._final in self._closure(self._sets[current], None)
            return name if accepts else None

    def _step(self, current: int, ch: str) -> int:
        """The set after `ch` from set `current`, remembered; -1 for the empty set (no match)."""
        states = self._sets[current]
        after = frozenset(
            nxt for s in self._closure(states, ch) if (test := self._tests[s]) is not None and test(ch)
            for nxt in self._edges[s]
        )
        if not after:
            self._next[current][ch] = -1
            return -1
        found = self._ids.get(after)
        if found is None:
            if len(self._sets) >= MAX_CACHED_SETS:
                self._reset()
                self._sets.append(states)  # keep the set being walked from reachable by its id
                self._ids[states] = current = 1
                self._next.append({})
                self._accepts.append(None)
            found = self._ids[after] = len(self._sets)
            self._sets.append(after)
            self._next.append({})
            self._accepts.append(None)
        self._next[current][ch] = found
        return found

    def _closure(self, states: frozenset[int], ahead: Optional[str]) -> set[int]:
        """The states reachable without consuming, given the next character (None at the end)."""
        seen = set(states)
        todo = list(states)
        while todo:
            s = todo.pop()
            if self._tests[s] is not None:
                continue
            look = self._looks[s]
            if look is not None and not (look[0] if ahead is None else look[1](ahead)):
                continue
            for nxt in self._edges[s]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen


class _Builder:
    """Thompson's construction over `re`'s parse tree."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.tests: list[Optional[Test]] = []
        self.edges: list[list[int]] = []
        self.looks: list[Optional[tuple[bool, Test]]] = []

    def node(self, test: Optional[Test] = None, look: Optional[tuple[bool, Test]] = None) -> int:
        if len(self.tests) >= MAX_STATES:
            raise TooComplex(f"the pattern needs more than {MAX_STATES} automaton states")
        self.tests.append(test)
        self.edges.append([])
        self.looks.append(look)
        return len(self.tests) - 1

    def char_test(self, items: list[Any]) -> Test:
        """A one-character test with exactly `re`'s meaning (and the pattern's flags)."""
        compiled = _compiler.compile(_parser.SubPattern(self.state, items), self.state.flags)
        return lambda ch: compiled.fullmatch(ch) is not None

    def sequence(self, items: Any) -> tuple[int, int]:
        """The fragment of a sequence of parse items: (entry state, exit state)."""
        entry = exit_ = self.node()
        for op, av in items:
            name = str(op)
            if name in _CHAR_OPS:
                a = self.node(self.char_test([(op, av)]))
                b = self.node()
                self.edges[a].append(b)
            elif name in ("ASSERT", "ASSERT_NOT"):
                direction, body = av
                if direction != 1 or not _one_char(body):
                    raise Unsupported(name)
                test = self.char_test(list(body))
                look = (False, test) if name == "ASSERT" else (True, lambda ch, t=test: not t(ch))
                a, b = self.node(look=look), self.node()  # b: reached only when the look passes
                self.edges[a].append(b)
            elif name == "SUBPATTERN":
                _group, add_flags, del_flags, body = av
                if add_flags or del_flags:
                    raise Unsupported("scoped flags")
                a, b = self.sequence(body)
            elif name == "BRANCH":
                a, b = self.node(), self.node()
                for alternative in av[1]:
                    x, y = self.sequence(alternative)
                    self.edges[a].append(x)
                    self.edges[y].append(b)
            elif name in ("MAX_REPEAT", "MIN_REPEAT"):
                a, b = self.repeat(*av)
            else:
                raise Unsupported(name)
            self.edges[exit_].append(a)
            exit_ = b
        return entry, exit_

    def repeat(self, low: int, high: int, body: Any) -> tuple[int, int]:
        """`body{low,high}` (high MAXREPEAT: unbounded) as copies of the body's fragment."""
        entry = exit_ = self.node()
        unbounded = high == _constants.MAXREPEAT
        for _ in range(low):
            a, b = self.sequence(body)
            self.edges[exit_].append(a)
            exit_ = b
        if unbounded:
            a, b = self.sequence(body)
            loop_exit = self.node()
            self.edges[exit_].extend((a, loop_exit))
            self.edges[b].extend((a, loop_exit))
            return entry, loop_exit
        end = self.node()
        for _ in range(high - low):
            a, b = self.sequence(body)
            self.edges[exit_].extend((a, end))
            exit_ = b
        self.edges[exit_].append(end)
        return entry, end


def _one_char(body: Any) -> bool:
    items = list(body)
    return len(items) == 1 and str(items[0][0]) in _CHAR_OPS


def compile_linear(regex: str, pattern: str) -> Optional[LinearPattern]:
    """The automaton of `regex` (`pattern` is what the user wrote); None if `re` must run it.

    Raises `re.error` for a regex that does not parse and `TooComplex` for one too large.
    """
    tree = _parser.parse(regex)
    builder = _Builder(tree.state)
    try:
        start, final = builder.sequence(tree)
    except Unsupported:
        return None
    return LinearPattern(pattern, builder.tests, [tuple(e) for e in builder.edges], builder.looks, start, final)


def regex_guard(regex: str) -> Optional[tuple[int, str]]:
    """Why `re` could take exponential time on `regex`, as (offset in it, reason); None if bounded.

    Only for a regex `compile_linear` cannot run (it uses backreferences or lookarounds):
    it must be short, hold few repeats, and no repeat may hold another repeat or an
    alternation, the shapes that make backtracking exponential (`(a+)+`, `(a|a)*`,
    `(\\w+\\s?)*`). The scan is conservative: it may refuse a harmless regex, never
    pass a nested one.
    """
    if len(regex) > MAX_REGEX_LENGTH:
        return MAX_REGEX_LENGTH, f"longer than {MAX_REGEX_LENGTH} characters"
    repeats = [m.start() for m in re.finditer(r"(?<!\\)(?:[*+]|\{\d*,\}?)", regex)]
    if len(repeats) > MAX_GUARDED_REPEATS:
        return repeats[MAX_GUARDED_REPEATS], f"more than {MAX_GUARDED_REPEATS} repeats (polynomial backtracking)"
    stack: list[tuple[int, bool]] = []  # open groups: (offset, holds a repeat or an alternation)
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _class_close(regex, i) + 1
            continue
        if c == "(":
            stack.append((i, False))
        elif c == "|" and stack:
            stack[-1] = (stack[-1][0], True)
        elif c == ")" and stack:
            opened, risky = stack.pop()
            if _quantified(regex, i + 1) and risky:
                return opened, "a repeated group holds a repeat or an alternation (exponential backtracking)"
            if stack and (risky or _quantified(regex, i + 1)):
                stack[-1] = (stack[-1][0], True)
        elif c in "*+?{" and stack and _quantified(regex, i):
            stack[-1] = (stack[-1][0], True)
        i += 1
    return None


def _quantified(regex: str, i: int) -> bool:
    """Whether a quantifier that repeats more than once starts at `i`."""
    if i >= len(regex):
        return False
    if regex[i] in "*+":
        return True
    match = re.match(r"\{(\d*)(,?)(\d*)\}", regex[i:])
    return match is not None and (bool(match.group(2)) or int(match.group(1) or 0) > 1)


def _class_close(regex: str, start: int) -> int:
    j = start + 1
    if j < len(regex) and regex[j] == "^":
        j += 1
    if j < len(regex) and regex[j] == "]":
        j += 1
    while j < len(regex) and regex[j] != "]":
        j += 2 if regex[j] == "\\" else 1
    return j
