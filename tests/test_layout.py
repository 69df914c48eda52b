"""The package layout: imports point one way, from the policy stage down to the edges.

The README's "The code": `policy` imports none of the other stages, `plan` reads typed
policies, the `engine` runs a plan and writes into the `export` stage's collector and
sinks, and `apply` and the top-level modules use them all; no import circle. Every module
of the package belongs to one layer of `LAYERS`, and imports only from its own layer and
the ones that table allows; a new module must be placed there (and on the module map of
docs/semantics.md; a new folder on the README's).
Inside the engine the same holds for its parts (`ENGINE_PARTS`): each subpackage imports
only the parts before it, and the step (`cycle`, `runtime`) sits on top of them all.

Read from the source with `ast`, never by importing, so every import counts: one inside a
function, and one under `if TYPE_CHECKING:` too (a reader follows it all the same; the
loader's circle of old was `loader -> build` at run time, `build -> loader` for mypy).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hookpolicy"

#: The top-level modules every stage may use: what they import of hookpolicy is each other.
BASE = {"errors", "say", "environment", "process"}

#: The edge: the command line and the package itself, which may import anything.
EDGE = {"cli", "__main__", ""}

#: layer -> the layers its modules may import besides their own. A layer is a stage
#: (a subpackage), `base` (BASE), `api` (the Python entry) or `edge` (EDGE).
LAYERS: dict[str, set[str]] = {
    "base": set(),
    "policy": {"base"},
    "plan": {"base", "policy"},
    "export": {"base", "policy"},
    "engine": {"base", "policy", "plan", "export"},
    "api": {"base", "policy", "plan", "engine", "export"},
    "apply": {"base", "policy", "plan", "engine", "export", "api"},
    "edge": {"base", "policy", "plan", "engine", "export", "api", "apply"},
}

#: The engine's parts: part -> the parts its modules may import besides their own. A part is a
#: subpackage of `hookpolicy/engine/`, or `step`: the modules at the engine's top (`STEP`).
ENGINE_PARTS: dict[str, set[str]] = {
    "hooks": set(),
    "measure": {"hooks"},
    "execute": {"hooks", "measure"},
    "decide": {"hooks", "measure", "execute"},
    "heal": {"hooks", "measure", "execute", "decide"},
    "step": {"hooks", "measure", "execute", "decide", "heal"},
}

#: The modules at the top of the engine, outside its parts: the step and the handle `attach` returns.
STEP = {"hookpolicy.engine", "hookpolicy.engine.cycle", "hookpolicy.engine.replay", "hookpolicy.engine.runtime"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p) for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports anywhere in its body, relative imports resolved."""
    module = _module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text("utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            # `from .. import environment` imports the module hookpolicy.environment
            # (and the package only as its parent, as every import does).
            submodules = {f"{name}.{alias.name}" for alias in node.names} & MODULES
            found.update(submodules or {name})
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path) & MODULES - {name} for name, path in paths.items()}


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` as the list of modules along it, or [] when none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = walk(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return []


def test_the_package_has_no_import_circle() -> None:
    circle = _circle(_graph())
    assert not circle, " -> ".join(circle)


def test_every_import_of_the_package_names_a_module_of_it() -> None:
    """A module moved or folded leaves no import of its old name behind (mypy, with missing imports
    ignored, would not say so; the import would fail only when that line runs)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    stale = [f"{module} imports {name}" for module, path in sorted(paths.items())
             for name in sorted(_imports(path)) if name.split(".")[0] == "hookpolicy" and name not in MODULES]
    assert not stale, "\n".join(stale)


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circle(graph) == ["a", "b", "c", "a"]


def _layer(module: str) -> str:
    """The layer of `module` (a name under `hookpolicy`), or "" when it is in none."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in EDGE:
        return "edge"
    if parts[0] in BASE:
        return "base"
    return parts[0] if parts[0] in LAYERS.keys() - {"base", "edge"} else ""


def test_every_module_is_in_a_layer() -> None:
    assert not sorted(m for m in MODULES if not _layer(m)), "place these in test_layout.LAYERS (and the README's map)"


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_layer_imports_only_the_layers_before_it(layer: str) -> None:
    allowed = {layer} | LAYERS[layer]
    wrong = [f"{module} imports {name} ({_layer(name)})" for module, names in sorted(_graph().items())
             if _layer(module) == layer for name in sorted(names) if _layer(name) not in allowed]
    assert not wrong, "\n".join(wrong)


def test_the_layers_are_an_order() -> None:
    """Each layer may import only layers that may not import it back: no circle between stages."""
    graph = {layer: set(allowed) for layer, allowed in LAYERS.items()}
    assert not _circle(graph), " -> ".join(_circle(graph))
    assert all(LAYERS[earlier] <= LAYERS[later] for later in LAYERS for earlier in LAYERS[later])


def test_the_layer_rule_catches_an_import_against_the_flow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: an engine module importing `apply` and `export` importing the engine are caught."""
    graph = _graph()
    monkeypatch.setitem(graph, "hookpolicy.engine.measure.stats", graph["hookpolicy.engine.measure.stats"] | {"hookpolicy.apply.reload"})
    monkeypatch.setitem(graph, "hookpolicy.export.sinks", graph["hookpolicy.export.sinks"] | {"hookpolicy.engine.measure.stats"})
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: graph)
    for layer, culprit in (("engine", "hookpolicy.apply.reload"), ("export", "hookpolicy.engine.measure.stats")):
        with pytest.raises(AssertionError, match=culprit):
            test_a_layer_imports_only_the_layers_before_it(layer)


def _part(module: str) -> str:
    """The engine part of `module` (a name under `hookpolicy.engine`), or "" when it is in none."""
    parts = module.split(".")[2:]
    if parts and parts[0] in ENGINE_PARTS.keys() - {"step"}:
        return parts[0]
    return "step" if module in STEP else ""


ENGINE = sorted(m for m in MODULES if _layer(m) == "engine")


def test_every_engine_module_is_in_a_part() -> None:
    assert not [m for m in ENGINE if not _part(m)], "place these in a subpackage of test_layout.ENGINE_PARTS (or STEP)"


@pytest.mark.parametrize("part", sorted(ENGINE_PARTS))
def test_an_engine_part_imports_only_the_parts_before_it(part: str) -> None:
    allowed = {part} | ENGINE_PARTS[part]
    wrong = [f"{module} imports {name} ({_part(name)})" for module, names in sorted(_graph().items())
             if module in ENGINE and _part(module) == part for name in sorted(names)
             if _layer(name) == "engine" and _part(name) not in allowed]
    assert not wrong, "\n".join(wrong)


def test_the_engine_parts_are_an_order() -> None:
    graph = {part: set(allowed) for part, allowed in ENGINE_PARTS.items()}
    assert not _circle(graph), " -> ".join(_circle(graph))
    assert all(ENGINE_PARTS[earlier] <= ENGINE_PARTS[later] for later in ENGINE_PARTS for earlier in ENGINE_PARTS[later])


def test_the_engine_part_rule_catches_an_import_against_the_flow(monkeypatch: pytest.MonkeyPatch) -> None:
    """A statistic importing the read-back and a hook owner importing the step are caught."""
    graph = _graph()
    stats, hooks = "hookpolicy.engine.measure.stats", "hookpolicy.engine.hooks.module_hooks"
    monkeypatch.setitem(graph, stats, graph[stats] | {"hookpolicy.engine.decide.readback"})
    monkeypatch.setitem(graph, hooks, graph[hooks] | {"hookpolicy.engine.cycle"})
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: graph)
    for part, culprit in (("measure", "hookpolicy.engine.decide.readback"), ("hooks", "hookpolicy.engine.cycle")):
        with pytest.raises(AssertionError, match=culprit):
            test_an_engine_part_imports_only_the_parts_before_it(part)


def test_the_policy_stage_imports_neither_torch_nor_click() -> None:
    """`hookpolicy check` and the bootstrap load policies without torch or click."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    seen: set[str] = set()
    todo = ["hookpolicy.policy.sources"]
    while todo:
        module = todo.pop()
        seen.add(module)
        for name in _imports(paths[module]):
            assert name.split(".")[0] not in ("torch", "click"), f"{module} imports {name}"
            if name in paths and name not in seen:
                todo.append(name)
    assert {f"hookpolicy.policy.{m}" for m in ("loader", "schema", "build", "document")} <= seen


def _section(path: Path, title: str) -> str:
    text = path.read_text("utf-8")
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_readmes_map_names_every_folder() -> None:
    """The README's "The code" gives each folder of the package a row: `engine/hooks/`, `policy/`, ..."""
    section = _section(PACKAGE.parent / "README.md", "## The code")
    folders = sorted({path.parent for path in PACKAGE.rglob("*.py")} - {PACKAGE})
    missing = [f"{folder.relative_to(PACKAGE).as_posix()}/" for folder in folders
               if f"`{folder.relative_to(PACKAGE).as_posix()}/`" not in section and folder.name != "_bootstrap"]
    assert not missing, f"the README's 'The code' has no row for {missing}"


def test_the_module_map_names_every_module() -> None:
    """docs/semantics.md's "The code, module by module" names each module (`name`, `name.py`), or its folder (`_bootstrap/`)."""
    section = _section(PACKAGE.parent / "docs" / "semantics.md", "## The code, module by module")
    missing = [
        str(path.relative_to(PACKAGE.parent)) for path in sorted(PACKAGE.rglob("*.py"))
        if path.stem != "__init__" and not any(
            name in section for name in (f"`{path.stem}`", f"`{path.name}`", f"`{path.parent.name}/`"))
    ]
    assert not missing, f"docs/semantics.md's 'The code, module by module' does not name {missing}"
