"""Which modules a rule selects: globs over canonical names, type names, root, exclude.

Matching runs once, when a plan is built, never inside a hook, so patterns are compiled
up front and cached. Nothing here imports torch: the model is any object tree with
`named_children()` and `named_parameters(recurse=False)`, and types are compared by
name, never imported, so a policy naming `my_pkg.Adapter` loads where `my_pkg` does not.

Names are canonical: the attribute names that wrappers insert (`module` of DDP and
DataParallel, `_orig_mod` of `torch.compile`, `_checkpoint_wrapped_module`,
`_fsdp_wrapped_module`) are removed, so one policy selects the same modules of the
wrapped and the unwrapped model.

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
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, NamedTuple, Optional

from ..policy.model import Match

__all__ = [
    "PatternError", "compile_glob", "WRAPPER_SEGMENTS", "ModuleEntry", "iter_modules",
    "type_matches", "Matcher", "select",
]

#: wrapper attribute -> the parent class names under which it is removed (None: always).
#: `module` is an ordinary attribute name in user code, so it is removed only under the
#: data-parallel wrappers that insert it.
WRAPPER_SEGMENTS: Mapping[str, Optional[frozenset[str]]] = MappingProxyType({
    "_orig_mod": None,
    "_checkpoint_wrapped_module": None,
    "_fsdp_wrapped_module": None,
    "module": frozenset({"DistributedDataParallel", "DataParallel"}),
})

_REGEX_PREFIX = "re:"
_ANY_SEGMENTS_LEADING = r"(?:.+\.)?"
_ANY_SEGMENTS_MIDDLE = r"\.(?:.+\.)?"
_ANY_SEGMENTS_TRAILING = r"(?:\..+)?"


class PatternError(ValueError):
    """A glob or `re:` pattern that does not compile; `pattern` is the offending text."""

    def __init__(self, message: str, pattern: str = "") -> None:
        self.pattern = pattern
        super().__init__(message)


# --------------------------------------------------------------------------- globs


@functools.lru_cache(maxsize=4096)
def compile_glob(pattern: str) -> re.Pattern[str]:
    """Compile a glob or `re:` pattern; match the result with `fullmatch`, never `match`.

    Cached because the same few patterns recur in every rule of every policy reload.
    """
    if not pattern:
        raise PatternError("empty pattern", pattern)
    if pattern.startswith(_REGEX_PREFIX):
        return _compile_regex(pattern)
    return _compile(_glob_to_regex(pattern), pattern)


def _compile_regex(pattern: str) -> re.Pattern[str]:
    """Compile the regex after `re:`; an empty one would silently match only the root."""
    body = pattern[len(_REGEX_PREFIX):]
    if not body:
        raise PatternError("empty regular expression after 're:'", pattern)
    return _compile(body, pattern)


def _compile(regex: str, pattern: str) -> re.Pattern[str]:
    """`re.compile`, with its error turned into a PatternError that keeps re's message."""
    try:
        return re.compile(regex)
    except re.error as exc:
        raise PatternError(f"invalid pattern {pattern!r}: {exc}", pattern) from None
    except (RecursionError, OverflowError) as exc:  # nested too deep, or a repeat count too large
        raise PatternError(f"invalid pattern {pattern!r}: too complex ({type(exc).__name__})", pattern) from None


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
        raise PatternError(f"unterminated character class '[' at {start}", pattern)
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
        raise PatternError(f"bad character range {low}-{high} at {i}", pattern)
    return f"{re.escape(low)}-{re.escape(high)}"


# --------------------------------------------------------------------------- the tree


@dataclass(frozen=True)
class ModuleEntry:
    """One module of a model: its canonical `name`, its `qualname` as named_modules gives it."""

    name: str
    qualname: str
    module: Any


class _Pending(NamedTuple):
    """A child waiting on the walk's stack, with what is needed to name and place it."""

    qualname: str
    name: str
    module: Any
    parent_slot: int
    unwraps: bool  # the child is what its parent wraps: it takes the parent's place


def iter_modules(model: Any) -> list[ModuleEntry]:
    """Every module of `model` in named_modules() pre-order, named canonically.

    A wrapper and the module it wraps share a canonical name; only the innermost is kept,
    in the wrapper's place, so `root: true` on a DDP- or compile-wrapped model selects the
    user's model. A module reachable twice appears once, under its first name, and its
    subtree is not walked again (as named_modules does).
    """
    entries = [ModuleEntry("", "", model)]
    seen = {id(model)}
    stack = _children(model, "", "", 0)
    while stack:
        item = stack.pop()
        if id(item.module) in seen:
            continue
        seen.add(id(item.module))
        entry = ModuleEntry(item.name, item.qualname, item.module)
        if item.unwraps:
            slot = item.parent_slot
            entries[slot] = entry
        else:
            slot = len(entries)
            entries.append(entry)
        stack.extend(_children(item.module, item.qualname, item.name, slot))
    return entries


def _children(parent: Any, qualname: str, name: str, slot: int) -> list[_Pending]:
    """The children of `parent`, reversed so that popping the stack visits them in order."""
    pending = []
    for segment, child in parent.named_children():
        if child is None:
            continue
        unwraps = _is_wrapper_segment(segment, parent)
        pending.append(_Pending(
            qualname=_join(qualname, segment),
            name=name if unwraps else _join(name, segment),
            module=child,
            parent_slot=slot,
            unwraps=unwraps,
        ))
    pending.reverse()
    return pending


def _is_wrapper_segment(segment: str, parent: Any) -> bool:
    """Whether `segment` is an attribute that a wrapper inserted, given who holds it."""
    if segment not in WRAPPER_SEGMENTS:
        return False
    parents = WRAPPER_SEGMENTS[segment]
    if parents is None:
        return True
    return any(cls.__name__ in parents for cls in type(parent).__mro__)


def _join(prefix: str, segment: str) -> str:
    return f"{prefix}.{segment}" if prefix else segment


# --------------------------------------------------------------------------- types


def type_matches(cls: type, spec: str) -> bool:
    """Whether `cls` or one of its bases is what `spec` names, by comparing names only.

    A bare name (`Linear`) compares `__name__`. A dotted path matches the exact
    `module.qualname`, or the same class name defined in or under the path's package:
    users write the public path (`torch.nn.Linear`) while the class lives deeper
    (`torch.nn.modules.linear.Linear`).
    """
    if "." not in spec:
        return any(c.__name__ == spec for c in cls.__mro__)
    prefix, _, name = spec.rpartition(".")
    return any(_dotted_matches(c, spec, prefix, name) for c in cls.__mro__)


def _dotted_matches(c: type, spec: str, prefix: str, name: str) -> bool:
    module = getattr(c, "__module__", None) or ""
    if f"{module}.{c.__qualname__}" == spec:
        return True
    return c.__name__ == name and (module == prefix or module.startswith(prefix + "."))


# --------------------------------------------------------------------------- rules


class Matcher:
    """A compiled `Match`: build it once per rule, then ask it about every module.

    A module matches when it passes every field that is given (`modules`, `types`,
    `root`), any entry within a field sufficing, and no `exclude` glob matches its
    canonical name. A Match with none of those fields set matches every module that is
    not excluded; the policy checks refuse such a rule before it gets here.
    """

    def __init__(self, match: Match) -> None:
        self.match = match
        self._modules = tuple(compile_glob(p) for p in match.modules)
        self._exclude = tuple(compile_glob(p) for p in match.exclude)
        self._params = tuple(compile_glob(p) for p in match.params)
        self._types = match.types

    def matches(self, name: str, module: Any, is_root: bool) -> bool:
        """Whether the module with canonical `name` is selected; `exclude` always wins."""
        if _any_fullmatch(self._exclude, name):
            return False
        if self._modules and not _any_fullmatch(self._modules, name):
            return False
        if self._types and not any(type_matches(type(module), t) for t in self._types):
            return False
        return is_root or not self.match.root

    def param_names(self, module: Any) -> list[str]:
        """The module's own parameter names that `params` selects (all when it is empty)."""
        names = [n for n, _ in module.named_parameters(recurse=False)]
        if not self._params:
            return names
        return [n for n in names if _any_fullmatch(self._params, n)]


def _any_fullmatch(patterns: tuple[re.Pattern[str], ...], name: str) -> bool:
    return any(p.fullmatch(name) is not None for p in patterns)


def select(model: Any, match: Match) -> list[ModuleEntry]:
    """The modules of `model` that `match` selects, in model order."""
    matcher = Matcher(match)
    entries = iter_modules(model)
    root = entries[0]
    return [e for e in entries if matcher.matches(e.name, e.module, e is root)]
