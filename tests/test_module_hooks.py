"""`engine/hooks/module_hooks`' filter of `nn.Module.__reduce_ex__`, branch by branch, against torch's own reduction.

The reference is what torch itself gives: `object.__reduce_ex__` of the same module once
hookpolicy's hooks came off through their `RemovableHandle`s (torch deletes the hook and
its flags), or the original reduction object itself where nothing of hookpolicy's is in
the module's dicts. The whole-model promises (a save is the untouched twin's bytes, a copy
feeds no metric) are test_ordinary.py's.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from prometheus_client import CollectorRegistry

from hookpolicy.engine.hooks import module_hooks

from helpers.models import tiny
from helpers.policies import load_policy

#: every hook dict of a module (those the filter looks at, and those it must leave alone)
HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks",
    "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)

#: the output of every Linear, forward and backward: hookpolicy's forward hooks (with kwargs) on both
RULES = """
- name: act
  match: {types: [Linear]}
  trigger: {at: forward}
  target: output
  actions: [{capture: {stats: [l2_norm]}}]
- name: out-grad
  match: {types: [Linear]}
  trigger: {at: backward}
  target: grad_output
  actions: [{capture: {stats: [l2_norm]}}]
"""


def only(module: str) -> str:
    """One rule capturing the output of the module named `module`."""
    return f"""
- name: one
  match: {{modules: ["{module}"]}}
  trigger: {{at: forward}}
  target: output
  actions: [{{capture: {{stats: [l2_norm]}}}}]
"""


def hook_dicts(reduced: Any) -> dict[str, tuple[type, list[tuple[Any, Any]]]]:
    """The hook dicts of a reduction's state: name -> (type, entries in order)."""
    state = reduced[2]
    return {name: (type(state[name]), list(state[name].items())) for name in HOOK_DICTS if name in state}


def shape(dicts: dict[str, tuple[type, list[tuple[Any, Any]]]]) -> dict[str, tuple[type, list[Any]]]:
    """The hook dicts without their keys (a handle's id), each hook by its code (torch wraps some: `_WrappedHook`)."""
    return {name: (kind, [getattr(getattr(v, "hook", v), "__code__", v) for _, v in entries])
            for name, (kind, entries) in dicts.items()}


def torchs(module: nn.Module) -> dict[str, tuple[type, list[tuple[Any, Any]]]]:
    """The hook dicts in torch's own reduction of `module` (no filter: call it once hookpolicy's hooks are off)."""
    return hook_dicts(object.__reduce_ex__(module, 4))


def users_hooks(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """A user's hooks of every kind on every module, with and without the flags torch keeps beside them."""
    handles = []
    for module in model.modules():
        handles += [
            module.register_forward_pre_hook(lambda m, a: None),
            module.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True),
            module.register_forward_hook(lambda m, a, o: None),
            module.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True),
            module.register_forward_hook(lambda m, a, o: None, always_call=True),
            module.register_full_backward_pre_hook(lambda m, g: None),
            module.register_full_backward_hook(lambda m, gi, go: None),
            module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: None),
            module.register_state_dict_post_hook(lambda m, sd, prefix, local: None),
            module.register_load_state_dict_pre_hook(lambda *a: None),
            module.register_load_state_dict_post_hook(lambda m, keys: None),
        ]
    return handles


def spy(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every reduction the original reducer gives the filter from now on, in order (call it once the filter is in)."""
    seen: list[Any] = []

    def original(module: nn.Module, protocol: Any) -> Any:
        seen.append(object.__reduce_ex__(module, protocol))
        return seen[-1]

    monkeypatch.setattr(module_hooks, "_reducer", [original])
    return seen


def test_a_module_with_none_of_ours_gets_the_original_reduction_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast branches: hook dicts all empty, or holding only the user's hooks and flags (every kind)."""
    governed, bare, users = tiny(), tiny(seed=1), tiny(seed=2)
    users_hooks(users)
    with load_policy(tmp_path, RULES).attach(governed, registry=CollectorRegistry()):  # the filter is in
        assert nn.Module.__dict__["__reduce_ex__"] is module_hooks._reduce_ex
        returned = spy(monkeypatch)
        for module in [*bare.modules(), *users.modules()]:
            assert module.__reduce_ex__(4) is returned[-1]
        assert all(getattr(m, name) for m in users.modules() for name in HOOK_DICTS)  # every kind was there


def test_ours_are_left_out_and_the_users_kept_as_torch_keeps_them(tmp_path: Path) -> None:
    """A user's hooks of every kind, registered before and after the attach, on governed modules: each reduction's
    hook dicts are, key for key and in order, those torch's own reduction has once hookpolicy's hooks are off."""
    model = tiny()
    users_hooks(model)
    attached = load_policy(tmp_path, RULES).attach(model, registry=CollectorRegistry())
    users_hooks(model)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    modules = list(model.modules())
    live = [{name: list(getattr(m, name).items()) for name in HOOK_DICTS} for m in modules]
    filtered = [hook_dicts(m.__reduce_ex__(4)) for m in modules]
    ours = {name for m in modules for name in HOOK_DICTS if set(getattr(m, name)) & module_hooks._ours}
    attached.remove()
    assert ours == {"_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
                    "_forward_hooks_always_called"}  # what is at stake: ours and their flags in four dicts
    assert filtered == [torchs(m) for m in modules]
    assert live != [{name: list(getattr(m, name).items()) for name in HOOK_DICTS} for m in modules]  # not edited
    assert all(torchs(m)[name][1] for m in modules for name in HOOK_DICTS)  # the user's of every kind are kept


def test_a_dict_shared_with_a_shallow_copy_is_filtered_in_the_copy_too(tmp_path: Path) -> None:
    """`copy.copy` of a module shares its hook dicts (torch's own semantics): hooks hookpolicy puts on the
    original later are in the copy's dicts too, and a save of the copy leaves them out, by key."""
    model = tiny()
    shallow = copy.copy(model[0])  # made before the attach, so torch's reduction: the same dict objects
    assert shallow._forward_hooks is model[0]._forward_hooks
    twin = copy.deepcopy(shallow)
    with load_policy(tmp_path, RULES).attach(model, registry=CollectorRegistry()):
        assert set(shallow._forward_hooks) & module_hooks._ours
        assert _saved(shallow) == _saved(twin)
        assert hook_dicts(shallow.__reduce_ex__(4)) == torchs(twin)


def test_a_module_governed_after_a_reload_and_one_no_longer_governed(tmp_path: Path) -> None:
    """A reload swaps the attachment (the old removed, the new attached: `apply/reload.py`): the module the new
    policy governs leaves its new hooks out, the one the old governed has none left; both are the twin's."""
    model, twin = tiny(), tiny()
    users_hooks(model)
    users_hooks(twin)
    old = load_policy(tmp_path, only("0"), name="old").attach(model, registry=CollectorRegistry())
    model(torch.randn(3, 4))
    old.remove()
    new = load_policy(tmp_path, only("2"), name="new").attach(model, registry=CollectorRegistry())
    try:
        model(torch.randn(3, 4))
        assert set(model[2]._forward_hooks) & module_hooks._ours
        assert not set(model[0]._forward_hooks) & module_hooks._ours
        reduced = [hook_dicts(m.__reduce_ex__(4)) for m in model.modules()]
    finally:
        new.remove()
    assert reduced == [torchs(m) for m in model.modules()]
    assert [shape(r) for r in reduced] == [shape(torchs(m)) for m in twin.modules()]  # the twin's, in its order


class StateAsTuple(nn.Linear):
    """A module whose `__getstate__` returns no dict: the filter cannot reach its hook dicts (a documented limit)."""

    def __getstate__(self) -> Any:
        return (super().__getstate__(),)

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state[0])


def test_a_state_that_is_not_a_dict_is_the_original_reduction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(StateAsTuple(4, 2))
    with load_policy(tmp_path, RULES).attach(model, registry=CollectorRegistry()):
        returned = spy(monkeypatch)
        assert set(model[0]._forward_hooks) & module_hooks._ours
        assert model[0].__reduce_ex__(4) is returned[-1]


def test_without_any_hook_of_ours_the_reducer_is_torchs(tmp_path: Path) -> None:
    """The patch is in exactly while hookpolicy holds a module hook: before the first attach, after the last remove."""
    assert "__reduce_ex__" not in nn.Module.__dict__
    with load_policy(tmp_path, RULES).attach(tiny(), registry=CollectorRegistry()):
        assert nn.Module.__dict__["__reduce_ex__"] is module_hooks._reduce_ex
    assert "__reduce_ex__" not in nn.Module.__dict__ and not module_hooks._ours


def _saved(module: nn.Module) -> bytes:
    out = io.BytesIO()
    torch.save(module, out)
    return out.getvalue()
