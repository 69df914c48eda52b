"""hookpolicy's process-wide changes: each made by one owner and given back with the last remove().

The references are the process's own records: `warnings.filters`, PyTorch's global hook
dicts, `threading.enumerate()`, and the warning a `torch.compile`d model gives with a
global module hook in place (PyTorch's own `OptimizedModule.__call__`).
"""

from __future__ import annotations

import ast
import gc
import re
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.modules.module as torch_module
from prometheus_client import CollectorRegistry
from torch import nn

from hookpolicy import process
from hookpolicy.engine.hooks import module_hooks


def compile_filters() -> list[tuple[object, ...]]:
    """The entries of `warnings.filters` about torch.compile's global-hook warning (read without hookpolicy)."""
    return [f for f in warnings.filters if f[1] is not None and "global hooks" in f[1].pattern]


def compile_warnings() -> list[str]:
    """The warnings a call of a `torch.compile`d module gives now about global hooks (none are raised)."""
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        compiled(torch.ones(1, 2))
    return [str(w.message) for w in seen if "global hooks" in str(w.message)]


def test_the_warnings_filter_comes_out_with_the_last_global_hook() -> None:
    """hookpolicy's every-call hook silences torch.compile's global-hook warning while it is in, and only then."""
    assert compile_filters() == []
    handle = module_hooks.global_forward_pre_hook(lambda module, args: None)  # discovery's, in `apply`
    try:
        assert len(torch_module._global_forward_pre_hooks) == 1
        assert len(compile_filters()) == 1
        assert compile_warnings() == []
    finally:
        handle.remove()
    assert compile_filters() == []
    mine = torch_module.register_module_forward_hook(lambda module, args, output: None)
    try:  # a global hook of the user's afterwards: PyTorch's warning reaches the user, as without hookpolicy
        assert compile_warnings() != []
    finally:
        mine.remove()
    assert len(torch_module._global_forward_pre_hooks) == 0


def test_two_users_share_the_filter_until_the_second_leaves() -> None:
    first = module_hooks.global_forward_pre_hook(lambda module, args: None)
    second = module_hooks.global_forward_pre_hook(lambda module, args: None, priority=5)
    try:
        first.remove()
        first.remove()  # twice is harmless: the other user still holds the filter
        assert len(compile_filters()) == 1
    finally:
        second.remove()
    assert compile_filters() == []


def test_a_user_global_hook_keeps_its_warning() -> None:
    """The filter is not installed when the process had a global module hook of its own: its warning stays the user's."""
    mine = torch_module.register_module_forward_hook(lambda module, args, output: None)
    try:
        ours = module_hooks.global_forward_pre_hook(lambda module, args: None)
        try:
            assert compile_warnings() != []
        finally:
            ours.remove()
    finally:
        mine.remove()


def test_call_subscribers_run_by_priority_and_see_what_the_previous_returned() -> None:
    """One PyTorch hook per kind, however many subscribers; the chain as PyTorch chains its own hooks."""
    seen: list[tuple[str, float]] = []

    def first(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        seen.append(("first", float(args[0].sum())))
        return (args[0] * 2,)

    def second(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append(("second", float(args[0].sum())))

    layer = nn.Identity()
    late = module_hooks.global_forward_pre_hook(second, priority=10)
    early = module_hooks.global_forward_pre_hook(first, priority=0)
    try:
        assert len(torch_module._global_forward_pre_hooks) == 1
        out = layer(torch.ones(3))
    finally:
        late.remove()
        early.remove()
    assert seen == [("first", 3.0), ("second", 6.0)]
    assert torch.equal(out, torch.full((3,), 2.0))  # = the reference: what `first` returned reached forward
    assert len(torch_module._global_forward_pre_hooks) == 0


def test_once_says_each_key_once_within_its_limit() -> None:
    once = process.Once(limit=2)
    assert [once("a"), once("a"), once("b"), once("c")] == [True, False, True, False]
    once.forget("a")
    assert once("a") and not once("a")


def test_hookpolicy_threads_are_listed() -> None:
    stop = threading.Event()
    thread = process.start_thread("test", stop.wait)
    thread.start()
    try:
        assert "hookpolicy-test" in process.snapshot()["threads"]  # type: ignore[operator]
    finally:
        stop.set()
        thread.join()
    assert "hookpolicy-test" not in process.snapshot()["threads"]  # type: ignore[operator]


def test_only_process_changes_the_warnings_filters() -> None:
    """Every filter hookpolicy installs is a `process.WarningFilter`, so `snapshot()` (and the leak fixture) sees it."""
    package = Path(process.__file__).parent
    changers = {"filterwarnings", "simplefilter", "resetwarnings"}
    calls = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in package.rglob("*.py") if path.name != "process.py"
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.Attribute) and node.attr in changers
    ]
    assert calls == []


def test_the_snapshot_shows_hookpolicy_filter_while_it_is_in() -> None:
    handle = module_hooks.global_forward_pre_hook(lambda module, args: None)
    try:
        assert len(process.snapshot()["warnings filters"]) == 1  # type: ignore[arg-type]
    finally:
        handle.remove()
    assert process.snapshot()["warnings filters"] == []


def test_the_singletons_listed_exist_where_the_list_says() -> None:
    """process.py's table of hookpolicy's own singletons names real module attributes (it cannot go stale silently)."""
    import importlib

    rows = re.findall(r"^\| (`_\w+`(?:, `_\w+`)*) +\| `([\w/]+)\.py` +\|", process.__doc__ or "", re.MULTILINE)
    assert len(rows) >= 9
    for names, path in rows:
        module = importlib.import_module("hookpolicy." + path.replace("/", "."))
        for name in re.findall(r"`(\w+)`", names):
            assert hasattr(module, name), f"{path}.py has no {name}"


#: calls whose result, kept at module level, is state of the process (a lock only guards one listed)
_STATEFUL = {"WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "Once", "local", "dict", "set", "list", "defaultdict"}


def _module_state(tree: ast.Module) -> set[str]:
    """The module-level state of a module: names its functions rebind (`global`), and names bound
    at its top to a container (a display, or a call of `_STATEFUL`) that are not CONSTANTS."""
    names = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        if target is None or target == "__all__":
            continue
        call = value.func if isinstance(value, ast.Call) else None
        called = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", "")
        if called in _STATEFUL or (isinstance(value, (ast.Dict, ast.Set, ast.List)) and not target.isupper()):
            names.add(target)
    return names


def test_the_table_names_every_module_level_state() -> None:
    """Every module-level state of the package is in process.py's tables, with the module that holds it."""
    package = Path(process.__file__).parent
    doc = process.__doc__ or ""
    rows = {line for line in doc.splitlines() if line.startswith("|")}
    missing = [
        f"{path.relative_to(package)}: {name}"
        for path in sorted(package.rglob("*.py")) if path.name != "process.py"
        for name in sorted(_module_state(ast.parse(path.read_text("utf-8"))))
        if not any(f"`{name}`" in row and f"{path.relative_to(package).as_posix()}" in row for row in rows)
    ]
    assert missing == []


def test_the_state_finder_finds_state() -> None:
    tree = ast.parse("import weakref\n_A = weakref.WeakSet()\n_b: dict[str, int] = {}\nLIMITS = {1: 2}\n"
                     "_c = None\ndef f():\n    global _c\n    _c = 1\n")
    assert _module_state(tree) == {"_A", "_b", "_c"}


class _Recording(torch.nn.Sequential):
    """A container that records whether the cyclic garbage collector runs whenever its children are listed."""

    seen: list[bool] = []

    def named_children(self):  # type: ignore[no-untyped-def]
        _Recording.seen.append(gc.isenabled())
        return super().named_children()


def test_the_collector_is_paused_while_planning_and_attaching_and_given_back_as_it_was(tmp_path: Path) -> None:
    """gc.isenabled() as read by the model's own named_children during plan and attach; after them, as before."""
    from hookpolicy import load

    path = tmp_path / "p.yaml"
    path.write_text("apiVersion: hookpolicy/v1\nkind: HookPolicy\nmetadata: {name: p}\nspec:\n  rules:\n"
                    "    - {name: a, match: {types: [Linear]}, trigger: {at: forward}, target: output,\n"
                    "       actions: [{capture: {stats: [l2_norm]}}]}\n")
    policies = load(path)
    model = _Recording(nn.Linear(2, 2))
    assert gc.isenabled()
    _Recording.seen = []
    policies.plan(model)
    attached = policies.attach(model, registry=CollectorRegistry())
    attached.remove()
    assert _Recording.seen and not any(_Recording.seen)
    assert gc.isenabled()
    gc.disable()  # the user's own choice stays: a pause does not turn the collector on afterwards
    try:
        with process.collector_paused():
            with process.collector_paused():
                assert not gc.isenabled()
        policies.plan(model)
        assert not gc.isenabled()
    finally:
        gc.enable()
