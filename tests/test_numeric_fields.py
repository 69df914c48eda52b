"""Every numeric field of the policy refuses out-of-range input with a position.

The fields are not a hand list: `_numeric_sites` walks the shipped JSON Schema beside a
policy that sets every numeric field it has, and finds each number the schema types as
`integer` or `number`. A field added to the schema that `FULL` does not set fails
`test_full_sets_every_numeric_field_of_the_schema`, so the walk keeps covering them all.
For each field: a 400-digit integer, a float that overflows to infinity, and the values
just past the schema's own `minimum`/`maximum`/`exclusiveMinimum` are each refused as a
`PolicyError` whose problem sits at that field's line and JSON path (never an
`OverflowError` or a traceback, as `steps.until: 10**400` was).
"""

from __future__ import annotations

import importlib.resources
import json
from typing import Any, Iterator

import pytest
import yaml

import hookpolicy
from hookpolicy.errors import PolicyError

SCHEMA: dict[str, Any] = json.loads(
    importlib.resources.files("hookpolicy.policy").joinpath("hookpolicy-v1.schema.json").read_text("utf-8")
)

#: A valid policy that sets every numeric field of the schema at least once.
FULL: dict[str, Any] = {
    "apiVersion": "hookpolicy/v1",
    "kind": "HookPolicy",
    "metadata": {"name": "numbers"},
    "spec": {
        "limits": {"maxSeries": 100, "maxJobSeries": 200, "maxHistoryValues": 1000, "maxSnapshotBytes": 4096,
                   "maxRingBytes": 1 << 20, "maxDumps": 3, "maxDumpBytes": 1 << 16},
        "snapshots": {"every": 10, "keep": 2},
        "rules": [
            {
                "name": "acts",
                "priority": 3,
                "match": {"modules": ["**"]},
                "trigger": {"at": "forward", "every": 2, "steps": {"from": 1, "until": 50},
                            "after": {"alert": "guard", "steps": 50}},
                "target": "output",
                "select": [0],
                "actions": [
                    {"capture": {"stats": ["l2_norm"], "tensors": {"dir": "t", "max_files": 4, "max_bytes": 1000},
                                 "log": {"path": "a.jsonl", "max_bytes": 1000, "keep": 2},
                                 "keep": {"steps": 20, "dump": {"alerts": ["numbers/guard"], "before": 5, "after": 2}}}},
                    {"clip": {"min": -1.0, "max": 1.0}},
                    {"scale": {"factor": 0.5}},
                ],
            },
            {
                "name": "norm",
                "match": {"modules": ["**"]},
                "trigger": {"at": "step"},
                "target": "grad",
                "actions": [{"clip": {"max_norm": "ema(norm, 0.9) + 3 * ema_std(norm, 0.9)", "warmup": 5}},
                            {"clip": {"max_norm": 1.0}}],
            },
            {
                "name": "agc",
                "match": {"modules": ["**"]},
                "trigger": {"at": "step"},
                "target": "grad",
                "actions": [{"clip": {"unitwise_ratio": 0.01, "eps": 0.001}}],
            },
            {
                "name": "guard",
                "match": {"root": True},
                "trigger": {"at": "step"},
                "target": "loss",
                "actions": [
                    {"alert": {"if": "max > 10", "warmup": 3, "for": 2, "then": "cool_down",
                               "cool_down": {"factor": 0.5, "steps": 10}}},
                    {"alert": {"if": "max > 20", "then": "rewind", "rewind": {"back": 1, "max_rewinds": 2}}},
                    {"alert": {"if": "max > 30", "then": "skip_step", "skip_step": {"max_in_a_row": 2}}},
                ],
            },
        ],
    },
}

NUMERIC = {"integer", "number"}


def node_ref(ref: str) -> list[str]:
    return ref.lstrip("#/").split("/")


def _deref(node: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`node` with its `$ref` followed, and the schema pointer it ends at."""
    pointer = ""
    while "$ref" in node:
        pointer = node["$ref"]
        target: Any = SCHEMA
        for part in node_ref(pointer):
            target = target[part]
        node = target
    return node, pointer


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type", ())
    return {kind} if isinstance(kind, str) else set(kind)


def _numeric_sites(node: dict[str, Any], value: Any, path: tuple[Any, ...], pointer: str) -> Iterator[
        tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """(schema pointer, instance path, schema node) of every number `value` holds where the schema types one."""
    node, ref = _deref(node)
    pointer = ref or pointer
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)) and _types(node) & NUMERIC:
        yield pointer, path, node
    elif isinstance(value, dict):
        properties = node.get("properties", {})
        for key, item in value.items():
            if key in properties:
                yield from _numeric_sites(properties[key], item, path + (key,), f"{pointer}/properties/{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for index, item in enumerate(value):
            yield from _numeric_sites(node["items"], item, path + (index,), f"{pointer}/items")


def _schema_numeric_fields(node: Any, pointer: str) -> Iterator[str]:
    """Every pointer in the schema whose node types a number (the fields `FULL` must cover)."""
    if isinstance(node, dict):
        if _types(node) & NUMERIC:
            yield pointer
        for key, item in node.items():
            if key not in ("enum", "examples", "default", "const"):
                yield from _schema_numeric_fields(item, f"{pointer}/{key}")


SITES = list(_numeric_sites(SCHEMA, FULL, (), "#"))


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    policy = json.loads(json.dumps(FULL))
    holder = policy
    for part in path[:-1]:
        holder = holder[part]
    holder[path[-1]] = value
    return policy


def _json_path(path: tuple[Any, ...]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _refused(policy: dict[str, Any], path: tuple[Any, ...], tmp_path: Any, text: str = "") -> list[Any]:
    file = tmp_path / "policy.yaml"
    file.write_text(text or yaml.safe_dump(policy, sort_keys=False, width=10_000), "utf-8")
    with pytest.raises(PolicyError) as raised:
        hookpolicy.load(file)
    here = [p for p in raised.value.problems if p.path == _json_path(path)]
    assert here, f"{_json_path(path)}: no problem there; got {[str(p) for p in raised.value.problems]}"
    assert all(p.line > 0 and p.column > 0 for p in here), [str(p) for p in here]
    return here


def test_full_is_valid(tmp_path: Any) -> None:
    file = tmp_path / "full.yaml"
    file.write_text(yaml.safe_dump(FULL, sort_keys=False), "utf-8")
    hookpolicy.load(file)


def test_full_sets_every_numeric_field_of_the_schema() -> None:
    covered = {pointer for pointer, _, _ in SITES}
    fields = set(_schema_numeric_fields(SCHEMA, "#"))
    assert len(fields) >= 25, fields  # the walk finds the schema's fields at all
    assert fields - covered == set(), "numeric fields FULL does not set"


@pytest.mark.parametrize("pointer, path", [(p, path) for p, path, _ in SITES], ids=[p for p, _, _ in SITES])
def test_an_integer_past_every_range_is_refused_at_its_position(pointer: str, path: tuple[Any, ...], tmp_path: Any) -> None:
    huge = "9" * 400
    dumped = yaml.safe_dump(_with(path, 123456789), sort_keys=False, width=10_000)
    assert dumped.count("123456789") == 1
    _refused({}, path, tmp_path, dumped.replace("123456789", huge))


@pytest.mark.parametrize("pointer, path", [(p, path) for p, path, _ in SITES], ids=[p for p, _, _ in SITES])
def test_a_float_that_overflows_is_refused_at_its_position(pointer: str, path: tuple[Any, ...], tmp_path: Any) -> None:
    dumped = yaml.safe_dump(_with(path, 123456789), sort_keys=False, width=10_000)
    _refused({}, path, tmp_path, dumped.replace("123456789", "1.0e+400"))


def _past_bounds(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    if "minimum" in node:
        yield "below minimum", node["minimum"] - 1
    if "exclusiveMinimum" in node:
        yield "at exclusiveMinimum", node["exclusiveMinimum"]
    if "maximum" in node:
        yield "above maximum", node["maximum"] + 1


BOUNDS = [(pointer, path, why, value) for pointer, path, node in SITES for why, value in _past_bounds(node)]


@pytest.mark.parametrize("pointer, path, why, value", BOUNDS, ids=[f"{p} {w}" for p, _, w, _ in BOUNDS])
def test_a_value_past_the_schemas_bound_is_refused_at_its_position(
        pointer: str, path: tuple[Any, ...], why: str, value: Any, tmp_path: Any) -> None:
    _refused(_with(path, value), path, tmp_path)
