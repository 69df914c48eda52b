"""The one owner of hookpolicy's hooks on modules: kept on the governed model, never copied with it.

A governed model must stay an ordinary model: `torch.save(model)`, `pickle`,
`copy.deepcopy` (and so `torch.optim.swa_utils.AveragedModel`, EMA helpers) behave exactly
as without hookpolicy. The trap: PyTorch keeps a module's hooks in the module's own dicts
(`_forward_hooks`, `_forward_pre_hooks`, their `_with_kwargs` / `_always_called` companions),
and `Module.__getstate__` hands the whole `__dict__` to pickle and to deepcopy. Hooks
living there would travel into every copy and file, dragging the runtime (locks, sinks)
along: a copy would keep feeding the original's metrics, and a save would fail with
`cannot pickle '_thread.lock' object`.

Three mechanisms, all here and nowhere else (`hookpolicy/process.py` lists every
process-wide change; the ones below are made and given back through its `Shared`):

- **Per-module forward hooks**, registered through `forward_pre_hook` / `forward_hook`,
  which record the handle's id. While any is installed, `torch.nn.Module.__reduce_ex__`
  (what pickle, `torch.save`, `copy.copy` and `copy.deepcopy` call on every module) is
  `object.__reduce_ex__` with those ids left out of the state it returns: a copy or a file
  is, byte for byte, what it would be without hookpolicy, and carries no hook of ours. A
  module without hookpolicy's hooks reduces exactly as before. The hooks themselves stay
  where PyTorch expects them, so nothing changes on the hot path: a module without hooks
  keeps `_call_impl`'s fast path, `torch.compile` sees per-module hooks as it always did
  (no process-wide module hook, no warning), forward pre-hooks keep their kwargs, and a
  user's own hooks run and come off as before.
  Process-wide module call hooks (`register_module_forward_hook`) would have kept the
  module dicts clean too, but they take every module of the process off the fast path
  (about 2 µs a call), cannot see keyword arguments before a forward, and make
  `torch.compile(model)` warn at every call; see docs/semantics.md.
- **Tree changes**: `watch(root, subscriber)` reports a module or parameter assigned
  inside a governed model (`model.head = nn.Linear(...)`, LoRA injection, `load_state_dict
  (assign=True)`), through PyTorch's process-wide *registration* hooks (they run when a
  module's attribute is set, never on a call, and `torch.compile` ignores them).
- **A hook before every module call** (`global_forward_pre_hook`), for what must see
  modules no plan names: `apply`'s discovery, until it found the models. One PyTorch
  forward pre-hook, calling its subscribers by priority; while it is in, torch.compile's
  warning about global hooks is filtered, and the filter comes out with the last subscriber.

The subscriber contract, as a literal signature:

    subscriber.tree_changed(parent, name, value) -> None   # before `parent.name = value` lands

Limits: a class (or a user's patch) that defines its own `__reduce_ex__` or `__reduce__`
bypasses the filter (`attach` says so, except for `torch.compile`'s wrapper, which is
rebuilt from the module it wraps); so does a `__getstate__` that returns something other
than a dict. Changes made behind `Module.__setattr__` (`model._modules[name] = m`,
`ModuleList.insert`, `del model.head`) are not seen.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional, Protocol

import torch
from torch.nn.modules.module import (
    register_module_forward_pre_hook, register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.hooks import RemovableHandle

from ... import process
from ...errors import Halt
from .contain import Part, fault_of

__all__ = [
    "OwnHandle", "TreeSubscriber", "Watching", "reduces_itself", "forward_hook", "forward_pre_hook",
    "global_forward_pre_hook", "watch",
]

#: The module dicts a forward hook's id lands in.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
)

_lock = threading.Lock()
#: ids of the hook handles hookpolicy holds on modules right now
_ours: set[int] = set()
#: what `nn.Module.__reduce_ex__` was before ours went in (None: not defined on Module itself)
_saved: list[Optional[Any]] = []


class OwnHandle:
    """A hook hookpolicy put on a module; `remove()` takes it off (safe to call twice)."""

    __slots__ = ("_handle",)

    def __init__(self, handle: RemovableHandle) -> None:
        self._handle = handle

    def remove(self) -> None:
        self._handle.remove()
        with _lock:
            if self._handle.id not in _ours:
                return
            _ours.discard(self._handle.id)
        _REDUCE_EX.release()


def forward_pre_hook(module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> OwnHandle:
    """`module.register_forward_pre_hook`, left out of copies, pickles and saves of `module`."""
    return _own(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))


def forward_hook(
    module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False, always_call: bool = False,
) -> OwnHandle:
    """`module.register_forward_hook`, left out of copies, pickles and saves of `module`."""
    return _own(module.register_forward_hook(hook, with_kwargs=with_kwargs, always_call=always_call))


def global_forward_pre_hook(hook: Callable[..., Any], priority: int = 0) -> RemovableHandle:
    """Before every module call of the process (discovery's): `hook(module, args) -> None or new args`."""
    return _CALLS.add(hook, priority)


class _CallHandle(RemovableHandle):
    """A subscriber to the process-wide module call hook; `remove()` is safe to call twice."""

    def __init__(self, calls: "_Calls", hook: Callable[..., Any], priority: int) -> None:
        super().__init__(OrderedDict())
        self.calls, self.hook = calls, hook
        self.sort_key = (priority, self.id)
        self.part = Part(f"the hook before every module call ({getattr(hook, '__qualname__', 'a subscriber')})")

    def remove(self) -> None:
        self.calls.discard(self)


class _Calls:
    """The process-wide module call hook: one PyTorch forward pre-hook, calling its subscribers in order.

    Order: by `priority` (lower first), then by subscription. One function calls them in
    turn, each seeing the arguments the previous one returned, as PyTorch chains its own
    hooks; each is contained (a fault of it is said once, and after 3 it is not called
    again: the module is called as the script called it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: tuple[_CallHandle, ...] = ()
        self._torch: Optional[RemovableHandle] = None

    def add(self, hook: Callable[..., Any], priority: int) -> _CallHandle:
        handle = _CallHandle(self, hook, priority)
        _COMPILE_WARNING.acquire()
        with self._lock:
            self._subscribers = tuple(sorted((*self._subscribers, handle), key=lambda h: h.sort_key))
            self._register()
        return handle

    def discard(self, handle: _CallHandle) -> None:
        with self._lock:
            if handle not in self._subscribers:
                return
            self._subscribers = tuple(h for h in self._subscribers if h is not handle)
            self._register()
        _COMPILE_WARNING.release()

    def _register(self) -> None:
        """Swap PyTorch's hook for one that calls the subscribers now (safe inside a call: PyTorch iterates a copy)."""
        if self._torch is not None:
            self._torch.remove()
            self._torch = None
        if self._subscribers:
            self._torch = register_module_forward_pre_hook(_chain(self._subscribers))


def _chain(handles: tuple[_CallHandle, ...]) -> Callable[..., Any]:
    """One forward pre-hook calling each subscriber in turn, each contained (`contain.Part`: off after 3 faults)."""
    def pre(module: torch.nn.Module, args: Any) -> Any:
        changed = False
        for handle in handles:
            if handle.part.off:
                continue
            try:
                result = handle.hook(module, args)
            except Halt:
                raise
            except Exception as exc:  # noqa: BLE001 - hookpolicy's part: the module is called as it was
                handle.part.failed(exc)
                continue
            if result is not None:
                args, changed = (result if isinstance(result, tuple) else (result,)), True
        return args if changed else None
    return pre


#: torch.compile's warning about global module hooks, silenced while ours are in (see `_quiet`).
_COMPILE_FILTER = process.WarningFilter(r"Using `torch\.compile\(module\)` when there are global hooks", UserWarning)


def _quiet() -> None:
    """Keep torch.compile from blaming the user's `model(x)` line for hookpolicy's global hooks.

    `OptimizedModule.__call__` warns whenever any global module hook exists, because such
    a hook fires once more for the wrapper. Ours handles the wrapper on purpose (discovery
    governs it), so the warning would be hookpolicy's
    noise at the user's line. It is silenced only when the process has no global module
    hooks of its own when the first of ours goes in, and the filter comes out with the
    last of ours.
    """
    from torch.nn.modules import module as hooks

    if not any((hooks._global_forward_pre_hooks, hooks._global_forward_hooks, hooks._global_backward_pre_hooks,
                hooks._global_backward_hooks)):
        _COMPILE_FILTER.install()


_COMPILE_WARNING = process.Shared("torch.compile global-hook warning filter", _quiet, _COMPILE_FILTER.remove)
_CALLS = _Calls()


#: classes that reduce themselves without their own hook dicts: `torch.compile`'s wrapper is
#: rebuilt from the module it wraps (`OptimizedModule.__reduce__`), which reduces through the filter
_REBUILT = {("torch._dynamo.eval_frame", "OptimizedModule")}


def reduces_itself(cls: type) -> bool:
    """Whether copies of a module of class `cls` bypass the filter: the class reduces itself."""
    if (cls.__module__, cls.__qualname__) in _REBUILT:
        return False
    return any(
        "__reduce_ex__" in vars(k) or "__reduce__" in vars(k)
        for k in cls.__mro__[: cls.__mro__.index(torch.nn.Module)]
    )


def _own(handle: RemovableHandle) -> OwnHandle:
    """`handle`'s hook as hookpolicy's (the copy filter in place while one is on); where that fails, the hook
    comes off again and nothing is counted: no hook is left that no `OwnHandle` can take off."""
    try:
        own = OwnHandle(handle)
        _REDUCE_EX.acquire()
    except BaseException:
        handle.remove()
        raise
    with _lock:
        _ours.add(handle.id)
    return own


def _patch() -> None:
    _saved.append(torch.nn.Module.__dict__.get("__reduce_ex__"))
    _reducer[:] = [_saved[0] if _saved[0] is not None else object.__reduce_ex__]
    torch.nn.Module.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign,assignment]


def _restore() -> None:
    previous = _saved.pop()
    if previous is None:
        del torch.nn.Module.__reduce_ex__
    else:
        torch.nn.Module.__reduce_ex__ = previous  # type: ignore[method-assign]


_REDUCE_EX = process.Shared("nn.Module.__reduce_ex__", _patch, _restore)
#: the reduction ours calls first: what `nn.Module.__reduce_ex__` was before (`object.__reduce_ex__` if not defined)
_reducer: list[Callable[[Any, Any], Any]] = [object.__reduce_ex__]


def _reduce_ex(self: torch.nn.Module, protocol: Any) -> Any:
    """`object.__reduce_ex__` (or what was there before), minus hookpolicy's hooks in the state.

    Runs for every module of every copy, pickle and save while hookpolicy holds a hook
    anywhere: a module whose hook dicts hold none of hookpolicy's keys (most of a large
    model) gets the original reduction itself, after one look at each of its five dicts.
    """
    reduced = _reducer[0](self, protocol)
    state = _state_of(reduced)
    if not state:
        return reduced
    if not _REDUCE_PART.off:
        try:
            return _without(reduced, state, _ours.intersection)
        except Exception as exc:  # noqa: BLE001 - hookpolicy's part: contained
            _REDUCE_PART.failed(exc)
    # the ids failed us: hookpolicy's hooks told by where their code lives, so a copy still carries none of them
    return _without(reduced, state, _keys_defined_here(state).intersection)


_REDUCE_PART = Part("the filter of nn.Module.__reduce_ex__ (copies and saves of a governed model)")


def _state_of(reduced: Any) -> Optional[dict[str, Any]]:
    """The state of a module's reduction, where its hook dicts are (None for a reduction of another shape)."""
    if isinstance(reduced, tuple) and len(reduced) > 2 and isinstance(reduced[2], dict):
        return reduced[2]
    return None


def _without(reduced: Any, state: dict[str, Any], ours: Callable[[Any], set[Any]]) -> Any:
    """`reduced` with the keys `ours(hook_dict)` names left out of its hook dicts; `reduced` itself if none is there.

    By key in every hook dict: the flags torch keeps under a hook's key
    (`_forward_hooks_with_kwargs`, `_forward_hooks_always_called`) go with the hook, and a
    dict a shallow copy shares with the original is filtered in either. A kept dict is a
    copy of the module's own (its type and order) less our keys, exactly what torch leaves
    once `RemovableHandle.remove()` deleted them.
    """
    copied: Optional[dict[str, Any]] = None
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if not hooks:
            continue
        keys = ours(hooks)
        if not keys:
            continue
        if copied is None:
            copied = dict(state)  # a __getstate__ may hand out the live __dict__: never edit it
        kept = copied[name] = hooks.copy()
        for key in keys:
            del kept[key]
    return reduced if copied is None else (*reduced[:2], copied, *reduced[3:])


def _defined_here(hook: Any) -> bool:
    """Whether `hook` is a function or bound method of hookpolicy's own code."""
    function = getattr(hook, "__func__", hook)
    return str(getattr(function, "__module__", "") or "").startswith("hookpolicy.")


def _keys_defined_here(state: dict[str, Any]) -> set[Any]:
    """The keys of the hooks `_defined_here` in a reduction's hook dicts (the flags under them go with them)."""
    return {key for name in _HOOK_DICTS for key, hook in (state.get(name) or {}).items()
            if callable(hook) and _defined_here(hook)}


# -- tree changes ----------------------------------------------------------------------
class TreeSubscriber(Protocol):
    """What `watch` reports to."""

    def tree_changed(self, parent: torch.nn.Module, name: str, value: object) -> None:
        """`parent.name = value` (a module or a parameter) is about to land inside a watched model."""


class _Watch:
    """One pair of process-wide registration hooks, calling the subscribers watching a module."""

    def __init__(self) -> None:
        #: id of every module of a watched model -> (weak ref to it, its subscribers)
        self._modules: dict[int, tuple["weakref.ref[torch.nn.Module]", list[TreeSubscriber]]] = {}
        self._handles: list[RemovableHandle] = []

    def add(self, modules: list[torch.nn.Module], subscriber: TreeSubscriber) -> None:
        for module in modules:
            entry = self._modules.get(id(module))
            if entry is None or entry[0]() is not module:
                entry = self._modules[id(module)] = (weakref.ref(module), [])
            if subscriber not in entry[1]:
                entry[1].append(subscriber)
        if not self._handles and self._modules:
            self._handles = [register_module_module_registration_hook(self._registered),
                             register_module_parameter_registration_hook(self._registered)]

    def discard(self, subscriber: TreeSubscriber) -> None:
        for key, (_, subscribers) in list(self._modules.items()):
            if subscriber in subscribers:
                subscribers.remove(subscriber)
                if not subscribers:
                    del self._modules[key]
        if not self._modules:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def _registered(self, parent: torch.nn.Module, name: str, value: object) -> None:
        """hook(module, name, submodule_or_param) -> None: runs on every such assignment in the process."""
        entry = self._modules.get(id(parent))
        if entry is None or entry[0]() is not parent:
            return None
        for subscriber in list(entry[1]):
            try:
                subscriber.tree_changed(parent, name, value)
            except Halt:
                raise
            except Exception as exc:  # noqa: BLE001 - hookpolicy's part: the assignment lands as the script made it
                fault_of(subscriber, "the tree watch (module/parameter registration hook)", exc, _WATCH_PART)
        return None


_WATCH_PART = Part("the tree watch (module/parameter registration hook)")
_WATCH = _Watch()


class Watching:
    """What `watch` returns: `update(modules)` after a re-plan, `remove()` when done."""

    def __init__(self, subscriber: TreeSubscriber) -> None:
        self._subscriber = subscriber

    def update(self, modules: list[torch.nn.Module]) -> None:
        """Watch exactly `modules` from now on (the model's modules after a change)."""
        _WATCH.discard(self._subscriber)
        _WATCH.add(modules, self._subscriber)

    def add(self, modules: list[torch.nn.Module]) -> None:
        """Watch `modules` too (a subtree that joined the model)."""
        _WATCH.add(modules, self._subscriber)

    def remove(self) -> None:
        _WATCH.discard(self._subscriber)


def watch(root: torch.nn.Module, subscriber: TreeSubscriber) -> Watching:
    """Report to `subscriber` every module or parameter assigned anywhere inside `root`."""
    watching = Watching(subscriber)
    watching.update(list(root.modules()))
    return watching
