"""Which modules a rule selects: globs over canonical names, type names, root, exclude.

Matching runs once, when a plan is built, never inside a hook, so patterns are compiled
up front and cached. Nothing here imports torch: the model is any object tree with
`named_children()` and `named_parameters(recurse=False)`, and types are compared by
name, never imported, so a policy naming `my_pkg.Adapter` loads where `my_pkg` does not.

Names are canonical: the attribute names that wrappers insert (`module` of DDP and
DataParallel, `_orig_mod` of `torch.compile`, `_checkpoint_wrapped_module`,
`_fsdp_wrapped_module`, PEFT's `base_model.model`) are removed, so one policy selects the
same modules of the wrapped and the unwrapped model. A PEFT tuner layer (`lora.Linear`)
stands for the layer it adapts, under that layer's name and type (see `adapters`).

The glob syntax and its compiler live in `policy.patterns`: the policy checks refuse a
pattern that does not compile before a plan is ever built.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, NamedTuple, Optional

from ..policy.model import Match
from ..policy.patterns import NamePattern, compile_glob
from .adapters import ADAPTER_ROLES, TunerLayer, tuner_layer

__all__ = [
    "WRAPPER_SEGMENTS", "ModuleEntry", "iter_modules", "model_class", "type_matches", "Matcher", "Target",
]

#: wrapper attribute -> the parent class names under which it is removed (None: always).
#: `module` is an ordinary attribute name in user code, so it is removed only under the
#: data-parallel wrappers that insert it; PEFT's `base_model` (under PeftModel) and
#: `model` (under its tuner, LoraModel and the other BaseTuner classes) likewise.
WRAPPER_SEGMENTS: Mapping[str, Optional[frozenset[str]]] = MappingProxyType({
    "_orig_mod": None,
    "_checkpoint_wrapped_module": None,
    "_fsdp_wrapped_module": None,
    "module": frozenset({"DistributedDataParallel", "DataParallel"}),
    "base_model": frozenset({"PeftModel"}),
    "model": frozenset({"BaseTuner"}),
})


# --------------------------------------------------------------------------- the tree


@dataclass(frozen=True)
class ModuleEntry:
    """One module of a model: its canonical `name`, its `qualname` as named_modules gives it.

    `tuner` is set on a PEFT tuner layer: the layer it adapts and the adapter's pieces.
    """

    name: str
    qualname: str
    module: Any
    tuner: Optional[TunerLayer] = None

    @property
    def typed(self) -> Any:
        """The module whose class `types` is compared with: a tuner layer's base layer."""
        return self.tuner.base if self.tuner is not None else self.module


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
    subtree is not walked again (as named_modules does). A PEFT tuner layer is one entry;
    its base layer and adapter pieces are not walked (they are in its `tuner`).
    """
    entries = [ModuleEntry("", "", model)]
    seen = {id(model)}
    stack = _children(model, "", "", 0)
    while stack:
        item = stack.pop()
        if id(item.module) in seen:
            continue
        seen.add(id(item.module))
        tuner = tuner_layer(item.module, item.name, item.qualname)
        entry = ModuleEntry(item.name, item.qualname, item.module, tuner)
        if item.unwraps:
            slot = item.parent_slot
            entries[slot] = entry
        else:
            slot = len(entries)
            entries.append(entry)
        if tuner is not None:
            seen.update(id(m) for m in _descendants(item.module))
            continue
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


def _descendants(module: Any) -> Iterator[Any]:
    for _, child in module.named_children():
        if child is not None:
            yield child
            yield from _descendants(child)


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


def model_class(model: Any) -> str:
    """The class name of the user's model: the innermost of its wrappers (DDP, torch.compile),
    and under FSDP2 the class `fully_shard` replaced (it swaps in a subclass `FSDP<Name>` of
    `FSDPModule` and the original class), so the name does not change with the wrapping."""
    cls: type = type(_root_module(model))
    fsdp = sys.modules.get("torch.distributed.fsdp")
    marker = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if marker is not None and issubclass(cls, marker):
        cls = next((c for c in cls.__mro__ if not issubclass(c, marker)), cls)
    return cls.__name__


def _root_module(model: Any) -> Any:
    """`iter_modules(model)[0].module` without walking the whole tree: down the wrapper segments.

    Only the root's own children can take its place, and only through a wrapper segment; a
    wrapper (DDP, torch.compile's module, FSDP1) holds that one child. Anything else (a
    wrapper segment beside other children) is left to `iter_modules`.
    """
    module, seen = model, {id(model)}
    while True:
        children = [(segment, child) for segment, child in module.named_children() if child is not None]
        if not any(_is_wrapper_segment(segment, module) for segment, _ in children):
            return module
        if len(children) != 1 or id(children[0][1]) in seen:
            return iter_modules(model)[0].module
        module = children[0][1]
        seen.add(id(module))


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

    def select(self, entries: list[ModuleEntry]) -> list[ModuleEntry]:
        """The entries of `iter_modules(model)` this rule selects, in model order (the root is named "")."""
        return [e for e in entries if self.matches(e.name, e.typed, e.name == "")]

    def param_names(self, module: Any) -> list[str]:
        """The module's own parameter names that `params` selects (all when it is empty)."""
        return [n for n, _ in self._select_params([(n, n) for n, _ in module.named_parameters(recurse=False)])]

    def targets(self, entry: ModuleEntry, params: bool) -> list[Target]:
        """What a selected module binds: itself, or with `match.adapters` its adapter's pieces.

        `params` asks for the (label, path) of the parameters `match.params` selects. A
        module that is not a tuner layer has no adapter: `adapters` leaves nothing of it.
        """
        adapters = self.match.adapters
        if adapters is None:
            if not params:  # an activation rule: the module alone, its parameters not listed
                return [Target(entry.name, entry.qualname, entry.module, ())]
            own = entry.tuner.params() if entry.tuner is not None else [
                (n, n) for n, _ in entry.module.named_parameters(recurse=False)]
            return [Target(entry.name, entry.qualname, entry.module, tuple(self._select_params(own)))]
        if entry.tuner is None:
            return []
        roles = ADAPTER_ROLES[adapters]
        return [
            Target(part.name, part.qualname, part.module, tuple(self._select_params(
                [(n, n) for n, _ in part.module.named_parameters(recurse=False)])) if params else ())
            for part in entry.tuner.parts if part.role in roles and (params or part.called)
        ]

    def _select_params(self, params: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The (label, path) pairs whose label `params` selects (all when it is empty)."""
        if not self._params:
            return params
        return [(label, path) for label, path in params if _any_fullmatch(self._params, label)]


class Target(NamedTuple):
    """A module a rule binds: its canonical name, and for `grad`/`weight` its parameters.

    `params` holds (label, path): the label names the parameter in metrics, the dotted path
    finds it from `module` (they differ for a tuner layer's base weight: `weight`,
    `base_layer.weight`).
    """

    name: str
    qualname: str
    module: Any
    params: tuple[tuple[str, str], ...]


def _any_fullmatch(patterns: tuple[NamePattern, ...], name: str) -> bool:
    return any(p.fullmatch(name) is not None for p in patterns)

