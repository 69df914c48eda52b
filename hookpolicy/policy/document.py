"""A policy file as plain data plus where every value came from: `Document`, `JsonPath`.

Its own module so that every stage of the policy side can name a Document without
importing the one that makes it: `loader` produces Documents, `schema`, `checks` and
`build` consume them, `sources` ties the two together; none of them imports another's callers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from ..errors import Problem

__all__ = ["JsonPath", "Position", "Document", "json_path"]

JsonPath = tuple[Union[str, int], ...]
Position = tuple[int, int]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def json_path(path: JsonPath) -> str:
    """`('spec', 'rules', 0, 'match')` -> `$.spec.rules[0].match`."""
    parts = ["$"]
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif _IDENTIFIER.match(part):
            parts.append(f".{part}")
        else:
            parts.append(f"['{_escape_key(part)}']")
    return "".join(parts)


_KEY_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_key(key: str) -> str:
    """A key quoted for a JSON path on one line: line breaks and other unprintables escaped.

    A key may hold any character YAML allows, including line breaks (`"a\\nb": 1`,
    U+2028); printed raw, one problem would span several lines of `hookpolicy check`.
    """
    return "".join(
        _KEY_ESCAPES.get(c) or (c if c.isprintable() else f"\\u{ord(c):04x}") for c in key
    )


@dataclass(frozen=True)
class Document:
    """A policy file's plain data with the 1-based position of every node.

    `values` maps the JSON path of every value to where it starts; `keys` maps the path
    of every mapping entry to where its key starts (an unknown key is reported at the
    key, a wrong value at the value). `inline` holds, for scalars whose characters map
    one to one onto the source line, where their first character is, so that a problem
    found at a character offset inside a string (an `alert.if` that does not parse)
    points at that very character.
    """

    file: str
    revision: str
    data: dict[str, Any]
    values: Mapping[JsonPath, Position] = field(default_factory=dict)
    keys: Mapping[JsonPath, Position] = field(default_factory=dict)
    inline: Mapping[JsonPath, Position] = field(default_factory=dict)

    def position(self, path: JsonPath, *, key: bool = False) -> Position:
        """Where `path` starts; the nearest known ancestor for a path with no node."""
        if key and path in self.keys:
            return self.keys[path]
        while path not in self.values and path:
            path = path[:-1]
        return self.values.get(path, (1, 1))

    def problem(
        self, path: JsonPath, message: str, *, key: bool = False, offset: Optional[int] = None
    ) -> Problem:
        """A Problem at `path` (its key with `key=True`, a character inside with `offset`)."""
        line, column = self.position(path, key=key)
        if offset is not None and path in self.inline:
            line, column = self.inline[path]
            column += offset
        return Problem(self.file, line, column, json_path(path), message)
