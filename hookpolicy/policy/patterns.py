"""The pattern language of `match.modules`, `match.exclude` and `match.params`.

It belongs to the policy stage: `build` compiles every pattern while checking a policy
(a bad one is a problem with its position), and `plan.matcher` uses the compiled
patterns to select modules. Nothing here imports torch.

Glob syntax, matched against the whole dotted name:

- `*`: any run of characters inside one segment (never a dot);
- `?`: one character other than a dot;
- `[abc]`, `[a-z]`, `[!abc]`: a character class; a class never matches a dot;
- `**`: any run of characters, dots included; as a whole segment it also matches zero
  segments (`**.attn` matches `attn`, `layers.**` matches `layers`, `a.**.b` matches `a.b`);
- `re:<regex>`: a Python regular expression that must match the whole name;
- anything else is literal (`.` is a literal dot, regex metacharacters mean themselves).
"""

from __future__ import annotations

import functools
import re
from typing import Iterator, NamedTuple, Optional, Protocol

from .linear import LinearPattern, TooComplex, compile_linear, regex_guard

__all__ = ["NamePattern", "PatternError", "compile_glob"]

_REGEX_PREFIX = "re:"
#: A glob with at most this many `*`/`**` runs on `re` (its backtracking is at most
#: O(len(name)^2), and `re` is ~50x faster per name); one with more, on `linear`'s automaton.
MAX_BACKTRACKING_WILDCARDS = 2
_ANY_SEGMENTS_LEADING = r"(?:.+\.)?"
_ANY_SEGMENTS_MIDDLE = r"\.(?:.+\.)?"
_ANY_SEGMENTS_TRAILING = r"(?:\..+)?"


class PatternError(ValueError):
    """A glob or `re:` pattern that does not compile; `pattern` is the offending text.

    `offset` is where in the pattern the problem is, when it is known.
    """

    def __init__(self, message: str, pattern: str = "", offset: Optional[int] = None) -> None:
        self.pattern = pattern
        self.offset = offset
        super().__init__(message)


class NamePattern(Protocol):
    """What `compile_glob` returns: `re.Pattern` or a `LinearPattern`, both with `fullmatch`."""

    def fullmatch(self, name: str) -> Optional[object]: ...


# --------------------------------------------------------------------------- globs


@functools.lru_cache(maxsize=4096)
def compile_glob(pattern: str) -> NamePattern:
    """Compile a glob or `re:` pattern; match the result with `fullmatch`, never `match`.

    Globs with more than two wildcards, and regexes within what `linear` runs, match in
    time linear in the name's length (no backtracking); any other regex must pass
    `linear.regex_guard`. Cached because the same few patterns recur in every rule of
    every policy reload.
    """
    if not pattern:
        raise PatternError("empty pattern", pattern)
    if pattern.startswith(_REGEX_PREFIX):
        return _compile_regex(pattern)
    regex = _glob_to_regex(pattern)
    glob = _compile(regex, pattern)
    if glob is None:  # the translation only uses what the automaton runs
        raise PatternError(f"invalid pattern {shown(pattern)}: cannot be matched in linear time", pattern)
    if sum(t.kind in ("star", "globstar") for t in _tokens(pattern)) <= MAX_BACKTRACKING_WILDCARDS:
        return re.compile(regex)  # backtracking bounded by O(len(name)^2): re's C speed is worth it
    return glob


def _compile_regex(pattern: str) -> NamePattern:
    """Compile the regex after `re:`; an empty one would silently match only the root."""
    body = pattern[len(_REGEX_PREFIX):]
    if not body:
        raise PatternError("empty regular expression after 're:'", pattern)
    linear = _compile(body, pattern, shift=len(_REGEX_PREFIX))
    if linear is not None:
        return linear
    refused = regex_guard(body)
    if refused is not None:
        offset, reason = refused
        raise PatternError(
            f"invalid pattern {shown(pattern)}: {reason} at {offset + len(_REGEX_PREFIX)}; a regex with anchors, "
            "backreferences or lookbehinds runs on Python's re and must stay simple (a pattern matches the "
            "whole name: ^ and $ are not needed)",
            pattern, offset + len(_REGEX_PREFIX),
        )
    return re.compile(body)


def _compile(regex: str, pattern: str, shift: Optional[int] = None) -> Optional[LinearPattern]:
    """The linear-time automaton of `regex` (None: `re` must run it), errors as PatternError.

    `shift` is where `regex` starts in `pattern` (None: it is a translation, not the text).
    """
    try:
        re.compile(regex)  # re's own messages for a regex that does not compile
        return compile_linear(regex, pattern)
    except re.error as exc:
        at = None if shift is None or exc.pos is None else exc.pos + shift
        raise PatternError(f"invalid pattern {shown(pattern)}: {exc}", pattern, at) from None
    except (RecursionError, OverflowError, TooComplex) as exc:  # nested too deep, a repeat count too large
        raise PatternError(f"invalid pattern {shown(pattern)}: too complex ({exc or type(exc).__name__})", pattern) from None


def _glob_to_regex(pattern: str) -> str:
    """Translate a glob segment by segment, so a whole-segment `**` can match zero segments."""
    segments = _collapse_globstars(_split_segments(pattern))
    last = len(segments) - 1
    parts: list[str] = []
    for i, segment in enumerate(segments):
        if segment is None:
            parts.append(_globstar_regex(i, last))
            continue
        if i > 0 and segments[i - 1] is not None:
            parts.append(r"\.")
        parts.append(segment)
    return "".join(parts)


def _globstar_regex(i: int, last: int) -> str:
    """The regex of a whole-segment `**`, which absorbs the dot(s) next to it."""
    if last == 0:
        return ".*"
    if i == 0:
        return _ANY_SEGMENTS_LEADING
    if i == last:
        return _ANY_SEGMENTS_TRAILING
    return _ANY_SEGMENTS_MIDDLE


def _collapse_globstars(segments: list[Optional[str]]) -> list[Optional[str]]:
    """`**.**` means the same as `**`; merging them keeps the dot bookkeeping simple."""
    out: list[Optional[str]] = []
    for segment in segments:
        if segment is None and out and out[-1] is None:
            continue
        out.append(segment)
    return out


def _split_segments(pattern: str) -> list[Optional[str]]:
    """Regex text of each dotted segment; None stands for a segment that is exactly `**`.

    The split happens while scanning, not with `str.split`, because a dot inside a
    character class is not a segment separator.
    """
    segments: list[Optional[str]] = []
    current: list[_Token] = []
    for token in _tokens(pattern):
        if token.kind == "dot":
            segments.append(_segment_regex(current))
            current = []
        else:
            current.append(token)
    segments.append(_segment_regex(current))
    return segments


def _segment_regex(tokens: list[_Token]) -> Optional[str]:
    """The regex of one segment's tokens, or None when the segment is exactly `**`."""
    if len(tokens) == 1 and tokens[0].kind == "globstar":
        return None
    return "".join(t.text for t in tokens)


class _Token(NamedTuple):
    kind: str  # "dot", "globstar", "star", "any", "class" or "literal"
    text: str  # the regex for it


def _tokens(pattern: str) -> Iterator[_Token]:
    """Scan a glob into tokens, each carrying its regex; a run of 2+ stars is `**`."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            j = i
            while j < n and pattern[j] == "*":
                j += 1
            yield _Token("globstar", ".*") if j - i > 1 else _Token("star", "[^.]*")
            i = j
        elif c == "?":
            yield _Token("any", "[^.]")
            i += 1
        elif c == "[":
            end = _class_end(pattern, i)
            yield _Token("class", _class_regex(pattern, i, end))
            i = end + 1
        elif c == ".":
            yield _Token("dot", r"\.")
            i += 1
        else:
            yield _Token("literal", re.escape(c))
            i += 1


def _class_end(pattern: str, start: int) -> int:
    """Index of the `]` closing the class opened at `start`.

    As in fnmatch, a `]` right after `[` or `[!` is a member, not the end.
    """
    j = start + 1
    if j < len(pattern) and pattern[j] == "!":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    end = pattern.find("]", j)
    if end < 0:
        raise PatternError(f"unterminated character class '[' at {start}", pattern, start)
    return end


def _class_regex(pattern: str, start: int, end: int) -> str:
    """Regex of the class `pattern[start:end + 1]`; a class never matches a dot."""
    i = start + 1
    negated = pattern[i] == "!"
    if negated:
        i += 1
    members: list[str] = []
    while i < end:
        if i + 2 < end and pattern[i + 1] == "-":
            members.append(_class_range(pattern, i))
            i += 3
        else:
            members.append(re.escape(pattern[i]))
            i += 1
    body = "".join(members)
    return f"[^{body}.]" if negated else rf"(?!\.)[{body}]"


def _class_range(pattern: str, i: int) -> str:
    """The range `pattern[i:i + 3]` (`a-z`), refused when it runs backwards."""
    low, high = pattern[i], pattern[i + 2]
    if low > high:
        raise PatternError(f"bad character range {low}-{high} at {i}", pattern, i)
    return f"{re.escape(low)}-{re.escape(high)}"


def shown(pattern: str) -> str:
    """A pattern quoted as the user typed it: `'re:\\d+'`, not repr's doubled backslashes.

    Only a pattern holding a quote or an unprintable character falls back to repr.
    """
    if pattern.isprintable() and "'" not in pattern:
        return f"'{pattern}'"
    return repr(pattern)
