"""The package layout: imports point one way, from the policy stage down to the edges.

Read from the source with `ast`, never by importing, so every import counts: one inside a
function, and one under `if TYPE_CHECKING:` too (a reader follows it all the same; the
loader's circle of old was `loader -> build` at run time, `build -> loader` for mypy).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hookpolicy"

#: stage -> the stages (and top-level modules) it may import besides itself.
ALLOWED = {
    "policy": {"errors"},
    "plan": {"errors", "policy"},
}


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


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circle(graph) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_an_early_stage_imports_no_later_one(stage: str) -> None:
    allowed = {"hookpolicy", f"hookpolicy.{stage}"}
    allowed |= {f"hookpolicy.{other}" for other in ALLOWED[stage]}
    for path in (PACKAGE / stage).rglob("*.py"):
        for name in _imports(path):
            if name.startswith("hookpolicy."):
                top = ".".join(name.split(".")[:2])
                assert top in allowed, f"{_module_name(path)} imports {name}"


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
