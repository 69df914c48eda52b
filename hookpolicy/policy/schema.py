"""The JSON Schema of a policy, and checking a Document against it with positioned problems.

The schema (`hookpolicy-v1.schema.json`, shipped in the package) is the one the editor
uses through yaml-language-server, so editors and `hookpolicy check` agree on the
shape of a policy. jsonschema's own messages speak about the schema ("Additional
properties are not allowed"); here every error becomes a Problem at the offending node
that says what would be right (`unknown key 'modles'; did you mean 'modules'? ...`).

JSON has no NaN or infinity, so non-finite numbers (YAML's `.nan`, `.inf`) are refused
here as well, before the schema sees them; so are integers too large for 64 bits.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import json
import math
from typing import Any, Iterator, Optional, Sequence

from jsonschema import Draft7Validator
from jsonschema.exceptions import ValidationError

from ..errors import Problem
from .document import Document, JsonPath
from .model import API_VERSION, KIND

__all__ = ["SCHEMA_FILE", "schema", "schema_json", "validate"]

SCHEMA_FILE = "hookpolicy-v1.schema.json"
_INT64_MAX = (1 << 63) - 1

_TYPE_WORDS = {
    "object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer",
    "number": "a number", "boolean": "a boolean (true or false)", "null": "null",
}
#: what each `pattern` of the schema means, in words.
_PATTERN_HELP = {
    "^[a-z0-9]([a-z0-9-]*[a-z0-9])?$":
        "a name is lowercase letters, digits and '-', starting and ending with a letter or digit",
    "^(?!__)[a-zA-Z_][a-zA-Z0-9_]*$":
        "a label key must be a Prometheus label name: letters, digits and '_', not starting "
        "with a digit or '__'",
    "^([a-z0-9]([a-z0-9-]*[a-z0-9])?/)?[a-z0-9]([a-z0-9-]*[a-z0-9])?$":
        "an alert is named by its rule, POLICY/RULE (or RULE of this policy): each part lowercase letters, digits "
        "and '-', starting and ending with a letter or digit",
    "^[A-Za-z_][A-Za-z0-9_]*(\\.[A-Za-z_][A-Za-z0-9_]*)*$":
        "a type is a class name such as Linear or a dotted path such as torch.nn.Linear",
    "^[a-z0-9]([a-z0-9-]*[a-z0-9])?/[a-z0-9]([a-z0-9-]*[a-z0-9])?$":
        "a rule is named policy/rule, as in loss-spike-guard/loss-spike",
}


def schema_json() -> str:
    """The schema as text, exactly as shipped (what `hookpolicy schema` prints)."""
    return _schema_text()


def schema() -> dict[str, Any]:
    """The schema as a fresh dict (the caller may change it)."""
    loaded: dict[str, Any] = json.loads(_schema_text())
    return loaded


@functools.lru_cache(maxsize=1)
def _schema_text() -> str:
    return importlib.resources.files("hookpolicy.policy").joinpath(SCHEMA_FILE).read_text("utf-8")


@functools.lru_cache(maxsize=1)
def _validator() -> Draft7Validator:
    return Draft7Validator(schema())


def validate(document: Document) -> list[Problem]:
    """Every way `document` breaks the schema (all of them, not the first), as Problems."""
    problems = list(_unrepresentable(document, document.data, ()))
    try:
        for error in _validator().iter_errors(document.data):
            if _not_json(error.instance) is None:  # else reported above, once is enough
                problems.extend(_problems(document, error))
    except (RecursionError, ValueError, TypeError) as exc:  # a jsonschema bug must not escape
        problems.append(document.problem((), f"the policy could not be validated: {exc}"))
    return problems


def _not_json(value: Any) -> Optional[str]:
    """Why a number cannot be a JSON (and policy) number: NaN, infinities, huge integers."""
    if isinstance(value, float) and not math.isfinite(value):
        spelled = ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
        return f"{spelled} is not a finite number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT64_MAX:
        return "the integer is too large (more than 64 bits)"
    return None


def _unrepresentable(document: Document, value: Any, path: JsonPath) -> Iterator[Problem]:
    """A Problem for every number in the document that `_not_json` refuses."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _unrepresentable(document, item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _unrepresentable(document, item, path + (index,))
    else:
        reason = _not_json(value)
        if reason is not None:
            yield document.problem(path, reason)


# --------------------------------------------------------------------------- messages


def _problems(document: Document, error: ValidationError) -> Iterator[Problem]:
    """The Problems of one jsonschema error, each at the node a user has to change."""
    path: JsonPath = tuple(error.absolute_path)
    keyword = error.validator
    if "propertyNames" in error.relative_schema_path:
        yield document.problem(path + (error.instance,), _message(error, path), key=True)
    elif keyword == "additionalProperties":
        yield from _unknown_keys(document, error, path)
    elif keyword == "maxProperties":
        yield from _extra_actions(document, error, path)
    elif keyword == "uniqueItems":
        yield from _repeated_items(document, error, path)
    elif keyword == "required":  # at the key of the mapping that lacks it, `metadata:`
        yield document.problem(path, _message(error, path), key=True)
    else:
        yield document.problem(path, _message(error, path))


def _unknown_keys(
    document: Document, error: ValidationError, path: JsonPath
) -> Iterator[Problem]:
    allowed = list(error.schema.get("properties", {}))
    for key in error.instance:
        if key not in allowed:
            hint = _did_you_mean(key, allowed)
            yield document.problem(
                path + (key,), f"unknown key {key!r};{hint} allowed keys: {', '.join(allowed)}",
                key=True,
            )


def _extra_actions(
    document: Document, error: ValidationError, path: JsonPath
) -> Iterator[Problem]:
    keys = list(error.instance)
    names = [_plain(k) for k in keys]
    for key, name in zip(keys[1:], names[1:]):
        example = f" ('- {name}: ...')" if name == key else ""
        yield document.problem(
            path + (key,),
            f"an actions item holds exactly one action, found {' and '.join(names)}; "
            f"write {str(key)!r} as its own list item{example}",
            key=True,
        )


def _plain(key: Any) -> str:
    """A key as written when it is plain text, else quoted: every message stays one line."""
    text = str(key)
    return text if text and text.isprintable() and text.strip() == text else repr(text)


def _repeated_items(
    document: Document, error: ValidationError, path: JsonPath
) -> Iterator[Problem]:
    seen: list[Any] = []
    for index, item in enumerate(error.instance):
        if item in seen:
            yield document.problem(path + (index,), f"{_show(item)} is listed twice")
        else:
            seen.append(item)


def _message(error: ValidationError, path: JsonPath) -> str:
    """jsonschema's error in words: what is wrong, and what would be right."""
    keyword, value, bound = error.validator, error.instance, error.validator_value
    if keyword == "enum" and path in (("apiVersion",), ("kind",)):
        supported = API_VERSION if path == ("apiVersion",) else KIND
        return f"unsupported {path[0]} {_show(value)}; the supported {path[0]} is {supported}"
    if keyword == "enum":
        options = [str(option) for option in bound]
        hint = _did_you_mean(value, options) if isinstance(value, str) else ""
        return f"{_show(value)} is not one of: {', '.join(options)}" + (f";{hint}" if hint else "")
    if keyword == "type":
        wanted = [bound] if isinstance(bound, str) else list(bound)
        message = f"expected {' or '.join(_TYPE_WORDS[t] for t in wanted)}, got {_describe(value)}"
        if wanted == ["string"] and isinstance(value, (bool, int, float)):
            message += "; quote the value to make it a string"
        message += _shorthand_hint(error, path)
        return message
    if keyword == "required":
        missing = [key for key in bound if error.message.startswith(repr(key))]
        return f"missing required key {', '.join(map(repr, missing[:1] or bound))}"
    if keyword == "pattern":
        help_text = _PATTERN_HELP.get(bound, f"it must match {bound}")
        return f"{_show(value)} is not valid: {help_text}"
    return _range_message(error) or error.message


def _shorthand_hint(error: ValidationError, path: JsonPath) -> str:
    """For a bare value where a mapping with one required key belongs (`scale: 0.5`,
    `log: runs/x.jsonl`), the mapping meant: `; write scale: {factor: 0.5}`."""
    schema = error.schema if isinstance(error.schema, dict) else {}
    required, properties, value = schema.get("required") or [], schema.get("properties") or {}, error.instance
    key = required[0] if len(required) == 1 else "path" if isinstance(value, str) and "path" in properties else None
    if schema.get("type") != "object" or key is None or not path or not isinstance(path[-1], str) \
            or isinstance(value, (dict, list)):
        return ""
    # a string as it was written where it reads so on one line; else quoted (JSON is a YAML flow scalar)
    plain = isinstance(value, str) and value.isprintable() and value == value.strip() and value != ""
    shown = value if plain else json.dumps(value)
    return f"; write {path[-1]}: {{{key}: {shown}}}"


def _range_message(error: ValidationError) -> str:
    """Bounds on numbers, lengths and sizes, in words; "" for any other keyword."""
    keyword, value, bound = error.validator, error.instance, error.validator_value
    if keyword == "minimum":
        return f"{_show(value)} is below the minimum {bound}"
    if keyword == "maximum":
        return f"{_show(value)} is above the maximum {bound}"
    if keyword == "exclusiveMinimum":
        return f"{_show(value)} is too small: it must be greater than {bound}"
    if keyword == "exclusiveMaximum":
        return f"{_show(value)} is too large: it must be less than {bound}"
    if keyword in ("minLength", "minItems"):
        unit = "characters" if keyword == "minLength" else "items"
        return "must not be empty" if bound == 1 else f"needs at least {bound} {unit}"
    if keyword == "maxLength":
        return f"is {len(value)} characters long; at most {bound} are allowed"
    if keyword == "maxItems":
        return f"has {len(value)} items; at most {bound} are allowed"
    if keyword == "minProperties":
        return f"needs at least one of: {', '.join(error.schema.get('properties', {}))}"
    return ""


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


def _show(value: Any) -> str:
    """A value as the user wrote it: strings quoted, numbers and booleans in YAML spelling."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return repr(value)


def _describe(value: Any) -> str:
    """A value with its kind, for type errors: `string 'abc'`, `boolean true`, `a list`."""
    if value is None:
        return "null (an empty value)"
    if isinstance(value, bool):
        return f"boolean {_show(value)}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value!r}"
    if isinstance(value, str):
        return f"string {_show(value)}"
    return _show(value)
