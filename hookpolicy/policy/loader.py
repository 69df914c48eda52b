"""Read policy files: strict YAML in, a `Document` (plain data plus positions) out.

YAML is a large language and most of it has no place in a policy: anchors and aliases
(an alias bomb expands a few hundred bytes into gigabytes), merge keys, tags (which in
a careless loader construct arbitrary Python objects), several documents in one file.
This loader uses PyYAML's pure-Python scanner and parser, composes the node tree itself
and refuses all of these, each as a `Problem` with the file, line, column and JSON path,
so that `hookpolicy check` can print every one of them and no traceback.

The flow is one-way: `read_document` (here) gives a `document.Document`,
`build.build_policy` checks it (`schema.validate`, then the semantic checks) and builds
the Policy, and `sources.load_sources` does both for every file it is given. Loader and
builder share only `document`, and neither imports `sources`. Nothing on this side
imports torch.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Optional, Union, cast

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.error import Mark
from yaml.events import (
    AliasEvent, DocumentStartEvent, Event, MappingEndEvent, MappingStartEvent, ScalarEvent,
    SequenceEndEvent, SequenceStartEvent, StreamEndEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from ..errors import PolicyError, Problem
from .document import Document, JsonPath, Position, json_path

__all__ = ["MAX_BYTES", "MAX_NESTING", "Source", "read_document", "parse_document"]

#: A policy file larger than this is refused before it is parsed.
MAX_BYTES = 1 << 20
#: Collections (mappings, lists) nested deeper than this are refused while composing.
MAX_NESTING = 64
#: After this many problems in one file the YAML layer stops looking for more.
MAX_PROBLEMS = 100

Source = Union[str, "os.PathLike[str]"]

_TAG = "tag:yaml.org,2002:"
_KIND_OF_TAG = {
    _TAG + "int": "an integer", _TAG + "float": "a number",
    _TAG + "bool": "a boolean", _TAG + "null": "null",
}


# --------------------------------------------------------------------------- composing


class _Abort(Exception):
    """Stop composing: the problem that stopped it is already recorded."""


def _start(event: Event) -> Mark:
    """Where an event starts; the pure-Python parser always sets it."""
    return cast(Mark, event.start_mark)


def _end(event: Event) -> Mark:
    return cast(Mark, event.end_mark)


class _StrictLoader(Reader, Scanner, Parser, Composer, SafeConstructor, Resolver):
    """PyYAML's SafeLoader, composing by the policy rules instead of the full YAML ones.

    Anchors, aliases and tags become problems as soon as they are seen; an alias is
    replaced by an empty scalar, never by the node it names, so nothing is expanded
    (and only the first alias of each anchor is reported, not every use).
    Depth is counted while composing, so `[[[[...` is refused long before Python's
    recursion limit. The constructor is used only for the plain scalars the resolver
    recognises (int, float, bool); tags never reach it.
    """

    def __init__(self, text: str, file: str) -> None:
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self.file = file
        self.problems: list[Problem] = []
        self.path: list[Union[str, int]] = []
        self._depth = 0
        self._aliased: set[str] = set()

    # PyYAML's stubs leave the event API untyped; these three calls are the only ones.
    def _next(self) -> Event:
        event: Event = self.get_event()  # type: ignore[no-untyped-call]
        return event

    def _peek(self) -> Event:
        event: Event = self.peek_event()  # type: ignore[no-untyped-call]
        return event

    def _resolve(self, value: str, implicit: tuple[bool, bool]) -> str:
        tag: str = self.resolve(ScalarNode, value, implicit)  # type: ignore[no-untyped-call]
        return tag

    def report(self, mark: Mark, message: str) -> None:
        """Record a problem at `mark`; stop composing once there are too many."""
        where = (self.file, mark.line + 1, mark.column + 1, json_path(tuple(self.path)))
        self.problems.append(Problem(*where, message))
        if len(self.problems) >= MAX_PROBLEMS:
            self.problems.append(Problem(*where, f"stopped after {MAX_PROBLEMS} problems"))
            raise _Abort()

    def compose_node(self, parent: Optional[Node], index: Any) -> Node:
        """Compose the next node (the entry point `compose_document` calls)."""
        event = self._next()
        if isinstance(event, AliasEvent):
            if event.anchor not in self._aliased:  # once per anchor: a bomb repeats them
                self._aliased.add(event.anchor or "")
                self.report(
                    _start(event),
                    f"aliases (*{event.anchor}) are not allowed; write the value out in full",
                )
            return ScalarNode(_TAG + "null", "", _start(event), _end(event))
        self._refuse_anchor_and_tag(event)
        if isinstance(event, ScalarEvent):
            return self._scalar(event)
        if isinstance(event, SequenceStartEvent):
            return self._sequence(event)
        if isinstance(event, MappingStartEvent):
            return self._mapping(event)
        raise TypeError(f"unexpected YAML event {event!r}")  # the parser yields no other here

    def _refuse_anchor_and_tag(self, event: Event) -> None:
        anchor: Optional[str] = getattr(event, "anchor", None)
        if anchor is not None:
            self.report(
                _start(event),
                f"anchors (&{anchor}) are not allowed; write the value out where it is used",
            )
        tag: Optional[str] = getattr(event, "tag", None)
        if tag is not None:
            shown = "!!" + tag[len(_TAG):] if tag.startswith(_TAG) else tag
            self.report(
                _start(event), f"tags ({shown}) are not allowed; write a plain value without a tag"
            )

    def _scalar(self, event: ScalarEvent) -> ScalarNode:
        implicit = (True, False) if event.tag else event.implicit
        tag = self._resolve(event.value, implicit)
        return ScalarNode(tag, event.value, _start(event), _end(event), style=event.style)

    def _sequence(self, start: SequenceStartEvent) -> SequenceNode:
        self._enter(_start(start))
        node = SequenceNode(_TAG + "seq", [], _start(start), _end(start))
        while not isinstance(self._peek(), SequenceEndEvent):
            self.path.append(len(node.value))
            node.value.append(self.compose_node(node, None))
            self.path.pop()
        node.end_mark = _end(self._next())
        self._depth -= 1
        return node

    def _mapping(self, start: MappingStartEvent) -> MappingNode:
        self._enter(_start(start))
        node = MappingNode(_TAG + "map", [], _start(start), _end(start))
        while not isinstance(self._peek(), MappingEndEvent):
            key = self.compose_node(node, None)
            self.path.append(key.value if isinstance(key, ScalarNode) else "?")
            node.value.append((key, self.compose_node(node, key)))
            self.path.pop()
        node.end_mark = _end(self._next())
        self._depth -= 1
        return node

    def _enter(self, mark: Mark) -> None:
        """Count one more level of nesting; refuse the level past MAX_NESTING."""
        self._depth += 1
        if self._depth > MAX_NESTING:
            self.problems.append(Problem(
                self.file, mark.line + 1, mark.column + 1, json_path(tuple(self.path)),
                f"nested deeper than {MAX_NESTING} levels; a policy needs no more than 8",
            ))
            raise _Abort()

    def single_document(self) -> Optional[Node]:
        """The root node of the only document; a second document is a problem."""
        self._next()  # StreamStartEvent
        if isinstance(self._peek(), StreamEndEvent):
            return None
        root = self.compose_document()
        event = self._next()
        if isinstance(event, DocumentStartEvent):
            self.path.clear()
            self.report(
                _start(event),
                "a second YAML document ('---'); a policy file holds exactly one policy: "
                "put each policy in its own file",
            )
        return root


# --------------------------------------------------------------------------- data


class _Converter:
    """Turns a composed node tree into plain data, recording every node's position."""

    def __init__(self, loader: _StrictLoader, text: str) -> None:
        self.loader = loader
        self.text = text
        self.problems: list[Problem] = []
        self.values: dict[JsonPath, Position] = {}
        self.keys: dict[JsonPath, Position] = {}
        self.inline: dict[JsonPath, Position] = {}

    def problem(self, node: Node, path: JsonPath, message: str) -> None:
        mark = node.start_mark
        self.problems.append(Problem(
            self.loader.file, mark.line + 1, mark.column + 1, json_path(path), message
        ))

    def value(self, node: Node, path: JsonPath) -> Any:
        self.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if isinstance(node, MappingNode):
            return self.mapping(node, path)
        if isinstance(node, SequenceNode):
            return [self.value(item, path + (i,)) for i, item in enumerate(node.value)]
        if isinstance(node, ScalarNode):
            return self.scalar(node, path)
        raise TypeError(f"unexpected YAML node {node!r}")  # the composer makes no other kind

    def mapping(self, node: MappingNode, path: JsonPath) -> dict[str, Any]:
        result: dict[str, Any] = {}
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = self.key(key_node, path)
            if key is None:
                continue
            if key in first_line:
                self.problem(
                    key_node, path + (key,),
                    f"duplicate key {key!r} (first at line {first_line[key]}); "
                    "each key may appear once in a mapping",
                )
                continue
            mark = key_node.start_mark
            first_line[key] = mark.line + 1
            self.keys[path + (key,)] = (mark.line + 1, mark.column + 1)
            result[key] = self.value(value_node, path + (key,))
        return result

    def key(self, node: Node, path: JsonPath) -> Optional[str]:
        """The key as a string, or None (and a problem) for a key that is not one."""
        if not isinstance(node, ScalarNode):
            kind = "a mapping" if isinstance(node, MappingNode) else "a list"
            self.problem(node, path, f"a key must be a string, found {kind}")
            return None
        if node.tag == _TAG + "merge":
            self.problem(
                node, path + ("<<",), "merge keys (<<) are not allowed; write the keys out"
            )
            return None
        if node.tag in _KIND_OF_TAG:
            self.problem(
                node, path + (node.value,),
                f"the key {node.value!r} is read as {_KIND_OF_TAG[node.tag]} by YAML 1.1; keys "
                f"must be strings: quote it ('{node.value}') or use the intended key name",
            )
            return None
        return str(node.value)

    def scalar(self, node: ScalarNode, path: JsonPath) -> Any:
        self._record_inline(node, path)
        tag = node.tag
        try:
            if tag == _TAG + "int":
                return self.loader.construct_yaml_int(node)
            if tag == _TAG + "float":
                return self.loader.construct_yaml_float(node)
            if tag == _TAG + "bool":
                return self.loader.construct_yaml_bool(node)
        except (ValueError, OverflowError):
            shown = node.value if len(node.value) <= 40 else node.value[:37] + "..."
            self.problem(node, path, f"{shown!r} is not a valid number")
            return None
        if tag == _TAG + "null":
            return None
        return str(node.value)  # str, and timestamps, which a policy only ever holds as text

    def _record_inline(self, node: ScalarNode, path: JsonPath) -> None:
        start, end = node.start_mark, node.end_mark
        if start.line != end.line or node.style not in (None, "'", '"'):
            return
        raw = self.text[start.index:end.index]
        body = raw if node.style is None else raw[1:-1]
        if body == node.value:
            self.inline[path] = (start.line + 1, start.column + 1 + (node.style is not None))


# --------------------------------------------------------------------------- files


def _file_problem(file: str, message: str, line: int = 0, column: int = 0) -> PolicyError:
    return PolicyError([Problem(file, line, column, "$", message)])


def read_document(source: Source) -> Document:
    """Read and parse one policy file; raises PolicyError.

    At most `MAX_BYTES + 1` bytes are read, so a huge (or endless) file is refused
    before anything parses it.
    """
    file = os.fspath(source)
    try:
        with open(file, "rb") as stream:
            raw = stream.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise _file_problem(file, "no such file") from None
    except IsADirectoryError:
        raise _file_problem(file, "is a folder, not a policy file") from None
    except OSError as exc:
        raise _file_problem(file, f"cannot read the file: {exc.strerror or exc}") from None
    return parse_document(raw, file)


def parse_document(content: Union[bytes, str], file: str = "<string>") -> Document:
    """Parse policy text (UTF-8 bytes or a str) into a Document; raises PolicyError."""
    raw = content.encode("utf-8") if isinstance(content, str) else content
    if len(raw) > MAX_BYTES:
        raise _file_problem(
            file, f"the file is larger than 1 MiB ({MAX_BYTES} bytes); a policy must be smaller"
        )
    text = _text(raw, file)
    loader = _StrictLoader(text, file)
    try:
        root = _compose(loader, text)
        converter = _Converter(loader, text)
        data: dict[str, Any] = converter.value(root, ()) if isinstance(root, MappingNode) else {}
    finally:
        loader.dispose()
    problems = loader.problems + converter.problems
    if problems:
        raise PolicyError(problems)
    if root is None:
        raise _file_problem(
            file, "the file holds no policy; a policy starts with 'apiVersion: hookpolicy/v1'", 1, 1
        )
    if not isinstance(root, MappingNode):
        line, column = root.start_mark.line + 1, root.start_mark.column + 1
        raise _file_problem(
            file, "the top level must be a mapping with apiVersion, kind, metadata and spec",
            line, column,
        )
    revision = hashlib.sha256(raw).hexdigest()[:12]
    return Document(file, revision, data, converter.values, converter.keys, converter.inline)


def _text(raw: bytes, file: str) -> str:
    """The file as text: UTF-8 (a leading BOM allowed) holding only characters YAML allows."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[:exc.start]
        line = before.count(b"\n") + 1
        column = len(before[before.rfind(b"\n") + 1:].decode("utf-8", "replace")) + 1
        raise _file_problem(
            file, f"not UTF-8 (byte 0x{raw[exc.start]:02x}); save the file as UTF-8", line, column
        ) from None
    text = text.removeprefix("\ufeff")
    special = Reader.NON_PRINTABLE.search(text)
    odd_break = _ODD_BREAK.search(text)
    for found, why in ((special, "is not allowed in YAML"), (odd_break, _ODD_BREAK_WHY)):
        if found is not None:
            at = found.start()
            line = text.count("\n", 0, at) + 1
            column = at - (text.rfind("\n", 0, at) + 1) + 1
            raise _file_problem(file, f"the character U+{ord(found.group()):04X} {why}", line, column)
    return text


#: Line breaks YAML counts but editors, grep and git do not (a lone CR, NEL, U+2028, U+2029):
#: with one in the file, every position after it would name a line the user cannot find.
_ODD_BREAK = re.compile("\r(?!\n)|[\x85\u2028\u2029]")
_ODD_BREAK_WHY = "is a line break that YAML counts and editors do not; end lines with \\n (or \\r\\n)"


def _compose(loader: _StrictLoader, text: str) -> Optional[Node]:
    """The root node, or None when the file is empty or composing had to stop.

    Every YAML error becomes a Problem in `loader.problems`; after one the composer
    cannot go on, so the problems found before it are reported with it.
    """
    try:
        return loader.single_document()
    except _Abort:
        return None
    except yaml.MarkedYAMLError as exc:
        loader.problems.append(_syntax_problem(exc, text, loader.file, tuple(loader.path)))
    except yaml.YAMLError as exc:  # no other kind is raised today; keep the promise anyway
        loader.problems.append(Problem(loader.file, 1, 1, "$", f"invalid YAML: {exc}"))
    return None


def _syntax_problem(exc: yaml.MarkedYAMLError, text: str, file: str, path: JsonPath) -> Problem:
    """A scanner or parser error at the scanner's position, in words a person can act on."""
    mark = exc.problem_mark or exc.context_mark
    line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    if mark is not None and text[mark.index:mark.index + 1] == "\t":
        return Problem(
            file, line, column, json_path(path), "a tab character; YAML indentation must use spaces"
        )
    misplaced = _out_of_line(exc, text)
    if misplaced is not None:
        return Problem(file, line, column, json_path(path), f"invalid YAML: {misplaced}")
    message = exc.problem or "invalid YAML"
    if exc.context:
        where = ""
        if exc.context_mark is not None and exc.context_mark is not mark:
            where = f" (line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
        message = f"{exc.context}{where}: {message}"
    return Problem(file, line, column, json_path(path), f"invalid YAML: {message}")


_KEY_AT = re.compile(r"([^\s:#'\"\[\]{},][^:#]*?)\s*:(\s|$)")


def _out_of_line(exc: yaml.MarkedYAMLError, text: str) -> Optional[str]:
    """For PyYAML's "expected <block end>" at a key: which key is out of line, and where it belongs.

    The parser reports the position right (the key) but not in words that say what to fix
    (`expected <block end>, but found '<block mapping start>'`).
    """
    mark, context = exc.problem_mark, exc.context_mark
    if mark is None or context is None or not (exc.problem or "").startswith("expected <block end>"):
        return None
    found = _KEY_AT.match(text, mark.index)
    if found is None:
        return None
    key, column, where = found[1], mark.column + 1, f"line {context.line + 1}, column {context.column + 1}"
    if "mapping" in (exc.context or ""):
        return (f"key {key!r} is out of line: it starts at column {column}, but the keys of the mapping it "
                f"follows (from {where}) start at column {context.column + 1}; indent it like them")
    return (f"key {key!r} is out of line: it starts at column {column}, inside the list that starts at {where}; "
            "a key of a list item is indented like the item's first key, past its '-'")
