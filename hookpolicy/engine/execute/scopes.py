"""Which parameters a step covers, and whether an optimizer step begins one: from what backward passes wrote.

A GAN in one module (a LightningModule with a generator and a discriminator, each with
its own optimizer and its own backward pass) steps the model twice per iteration: the
discriminator's step, then the generator's. Each is a hookpolicy step, and at each one
the other optimizer's parameters still hold gradients from *its* backward pass (or from
this loss flowing through it), stale for this update. A `step` rule over the whole model
must not clip, count or skip on them: at an optimizer's step it sees only the parameters
that step updates. Several optimizers stepping after one backward pass (one per
parameter group), on the other hand, make one step.

**What a backward pass wrote** is known from PyTorch itself: every governed parameter
that requires grad carries a post-accumulate-grad hook
(`Tensor.register_post_accumulate_grad_hook`), which the autograd engine calls right after
it accumulated that parameter's gradient, whatever started the backward pass (the
model's forward or not, `zero_grad` with `set_to_none` or in place, a closure inside
`step()`). The hook adds the parameter's id to two sets and sets a flag: no tensor is
read, no host sync. `written`: since its optimizer's last step; `unseen`: since the last
step was evaluated. An optimizer's step

- **begins a step** when one of its parameters was written since the last evaluation
  (`begins` is True): a backward pass came after it;
- **belongs to the step evaluated last** when its parameters were written, but all
  before that evaluation (False): it steps after the same backward pass as the
  optimizer evaluated there;
- is **unknown** when none of its parameters was written by a backward pass since its
  last step (None): gradients assigned by the script, or a stack whose backward does not
  accumulate into these parameters (FSDP2 writes the sharded `.grad` itself). The caller
  falls back on the model's own backward passes (`steps`) and, where several optimizers
  step the model, says it cannot tell their steps apart.

**What a step updates** is learned from what stepped together: the optimizers that step
after one backward pass form a group, remembered per optimizer. At an optimizer's step
the rules leave out the parameters of every other optimizer seen stepping that was not
in its group the last time it stepped. Parameters no optimizer holds (frozen weights a
`target: weight` rule watches) are never left out; nor, on the very first step of an
optimizer, those of optimizers that have not stepped yet (nothing says yet that they step
apart: at worst that first step sees more than it updates).

Cost: one Python call per written parameter per backward pass (two set insertions and an
attribute store); at each optimizer step a few set operations done in C over its
parameter ids. Each optimizer's parameter ids are computed once and kept while its
`param_groups` look the same (the ids and lengths of the groups' lists, so an
`add_param_group` is seen); the left-out set is rebuilt only when a group or an
optimizer's parameters change. The hooks are on the parameters, not in the module's
dicts: copies, pickles and `torch.save` of the model do not carry them.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["Scopes"]

Optimizer = torch.optim.Optimizer
_Signature = tuple[tuple[int, int], ...]


def _signature(optimizer: Optimizer) -> _Signature:
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


class Scopes:
    """The backward passes' writes to one model's parameters, and the optimizers that step it, grouped by step."""

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._params = params
        #: each optimizer seen stepping -> the optimizers that stepped with it in its last step
        self._groups: "weakref.WeakKeyDictionary[Optimizer, weakref.WeakSet[Optimizer]]" = weakref.WeakKeyDictionary()
        self._current: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
        self._ids: "weakref.WeakKeyDictionary[Optimizer, tuple[_Signature, frozenset[int]]]" = (
            weakref.WeakKeyDictionary())
        self._left_out: dict[int, tuple[tuple[object, ...], frozenset[int]]] = {}
        self._written: set[int] = set()  # ids written by a backward pass since their optimizer's last step
        self._unseen: set[int] = set()  # ids written since the last evaluated step
        #: set by every write; whoever wants to know whether a backward pass wrote this model clears it first
        self.touched = False
        self._hooks: dict[int, tuple["weakref.ref[torch.Tensor]", RemovableHandle]] = {}
        self._hook_params()

    # -- the writes ------------------------------------------------------------------------
    def _wrote(self, param: torch.Tensor) -> None:
        """hook(param) -> None, after the autograd engine accumulated `param`'s gradient."""
        key = id(param)
        self._written.add(key)
        self._unseen.add(key)
        self.touched = True

    def _hook_params(self) -> None:
        """A post-accumulate-grad hook on every parameter that requires grad and has none of ours yet."""
        for p in self._params():
            known = self._hooks.get(id(p))
            if p.requires_grad and p.is_leaf and (known is None or known[0]() is not p):
                handle = p.register_post_accumulate_grad_hook(self._wrote)  # type: ignore[no-untyped-call]
                self._hooks[id(p)] = (weakref.ref(p), handle)

    def remove(self) -> None:
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def reset(self) -> None:
        """The model's parameters changed: hook the new ones, forget the parameter ids (the groups stay)."""
        self._ids = weakref.WeakKeyDictionary()
        self._left_out.clear()
        self._hook_params()

    # -- optimizer steps -------------------------------------------------------------------
    def param_ids(self, optimizer: Optimizer) -> frozenset[int]:
        """The ids of the parameters `optimizer` updates, recomputed when its param_groups changed."""
        signature = _signature(optimizer)
        cached = self._ids.get(optimizer)
        if cached is None or cached[0] != signature:
            cached = (signature, frozenset(id(p) for g in optimizer.param_groups for p in g["params"]))
            self._ids[optimizer] = cached
            self._hook_params()  # a parameter unfrozen since (requires_grad set) gets its hook now
        return cached[1]

    def begins(self, optimizer: Optimizer) -> Optional[bool]:
        """Whether `optimizer`'s step begins a step (True), belongs to the one evaluated last (False),
        or cannot be told from the writes (None); see the module docstring."""
        ids = self.param_ids(optimizer)
        if not self._unseen.isdisjoint(ids):
            return True
        if not self._written.isdisjoint(ids):
            return False
        return None

    def several(self, optimizer: Optimizer) -> bool:
        """Whether optimizers other than `optimizer` were seen stepping this model."""
        return any(o is not optimizer for o in self._groups)

    def evaluating(self, optimizer: Optimizer) -> frozenset[int]:
        """A step is evaluated at `optimizer`'s step: the ids of parameters its rules leave out."""
        self._unseen.clear()
        group = self._groups.get(optimizer)
        members = [optimizer] if group is None else list(group)
        if group is None or len(members) != 1:
            group = weakref.WeakSet([optimizer])
            self._groups[optimizer] = group
        self._current = group
        if len(self._groups) == len(members):
            return frozenset()
        apart = [o for o in self._groups if o not in members]
        own = [self.param_ids(o) for o in members]
        others = [self.param_ids(o) for o in apart]
        key = (tuple(map(id, members)), tuple(map(id, apart)), *own, None, *others)  # the sets themselves: no id reuse
        cached = self._left_out.get(id(optimizer))
        if cached is None or cached[0] != key:
            cached = (key, frozenset().union(*others).difference(*own))
            self._left_out[id(optimizer)] = cached
        return cached[1]

    def continuing(self, optimizer: Optimizer) -> None:
        """`optimizer` steps in the step evaluated last (after the same backward pass)."""
        self._current.add(optimizer)
        self._groups[optimizer] = self._current

    def used_up(self) -> None:
        """A step without an optimizer (one per backward pass) was evaluated: every write so far is its."""
        self._written.clear()
        self._unseen.clear()

    def stepped(self, optimizer: Optimizer) -> None:
        """`optimizer` updated its parameters: what was written to them is used up."""
        ids = self.param_ids(optimizer)
        self._written.difference_update(ids)
        self._unseen.difference_update(ids)
