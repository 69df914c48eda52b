"""Which parameters a step covers, when several optimizers step one model in turn.

A GAN in one module (a LightningModule with a generator and a discriminator, each with
its own optimizer and its own backward pass) steps the model twice per iteration: the
discriminator's step, then the generator's. Each is a hookpolicy step, and at each one
the other optimizer's parameters still hold gradients from *its* backward pass, stale
for this update. A `step` rule over the whole model must not clip, count or skip on
them: at an optimizer's step it sees only the parameters that step updates.

What a step updates is learned from what stepped together: the optimizers that step
after one backward pass (one step, see `steps`) form a group, remembered per optimizer.
At an optimizer's step the rules leave out the parameters of every other optimizer seen
stepping that was not in its group the last time it stepped. Parameters no optimizer
holds (frozen weights a `target: weight` rule watches) are never left out; nor, on the
very first step of an optimizer, those of optimizers that have not stepped yet (nothing
says yet that they step apart: at worst that first step sees more than it updates).

Cost: each optimizer's parameter ids are computed once and kept while its
`param_groups` look the same (the ids and lengths of the groups' lists, so an
`add_param_group` is seen); the left-out set is rebuilt only when a group or an
optimizer's parameters change, so a step pays a few dictionary lookups.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["Scopes"]

Optimizer = torch.optim.Optimizer
_Signature = tuple[tuple[int, int], ...]
_Probe = tuple[torch.Tensor, "weakref.ref[torch.Tensor]"]  # a parameter and its .grad


def _probe(optimizer: Optimizer) -> Optional[_Probe]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return p, weakref.ref(p.grad)
    return None


def _signature(optimizer: Optimizer) -> _Signature:
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


class Scopes:
    """The optimizers that step one model, grouped by step, and what each step leaves out."""

    def __init__(self) -> None:
        #: each optimizer seen stepping -> the optimizers that stepped with it in its last step
        self._groups: "weakref.WeakKeyDictionary[Optimizer, weakref.WeakSet[Optimizer]]" = weakref.WeakKeyDictionary()
        self._current: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
        self._ids: "weakref.WeakKeyDictionary[Optimizer, tuple[_Signature, frozenset[int]]]" = (
            weakref.WeakKeyDictionary())
        self._left_out: dict[int, tuple[tuple[object, ...], frozenset[int]]] = {}
        self._marks: "weakref.WeakKeyDictionary[Optimizer, _Probe]" = weakref.WeakKeyDictionary()

    def reset(self) -> None:
        """The model's parameters changed: forget the parameter ids (the groups stay)."""
        self._ids = weakref.WeakKeyDictionary()
        self._left_out.clear()

    def param_ids(self, optimizer: Optimizer) -> frozenset[int]:
        """The ids of the parameters `optimizer` updates, recomputed when its param_groups changed."""
        signature = _signature(optimizer)
        cached = self._ids.get(optimizer)
        if cached is None or cached[0] != signature:
            cached = (signature, frozenset(id(p) for g in optimizer.param_groups for p in g["params"]))
            self._ids[optimizer] = cached
        return cached[1]

    def evaluating(self, optimizer: Optimizer) -> frozenset[int]:
        """A step is evaluated at `optimizer`'s step: the ids of parameters its rules leave out."""
        group = self._groups.get(optimizer)
        members = list(group) if group is not None else [optimizer]
        self._current = weakref.WeakSet([optimizer])
        self._groups[optimizer] = self._current
        apart = [o for o in self._groups if o not in members]
        if not apart:
            return frozenset()
        own = [self.param_ids(o) for o in members]
        others = [self.param_ids(o) for o in apart]
        key = (tuple(map(id, members)), tuple(map(id, apart)), *own, None, *others)  # the sets themselves: no id reuse
        cached = self._left_out.get(id(optimizer))
        if cached is None or cached[0] != key:
            cached = (key, frozenset().union(*others).difference(*own))
            self._left_out[id(optimizer)] = cached
        return cached[1]

    def mark(self, evaluating: Optimizer) -> None:
        """After a step's rules ran: note the gradients the other known optimizers hold now (for `rewritten`)."""
        self._marks = weakref.WeakKeyDictionary()
        for optimizer in self._groups:
            if optimizer is not evaluating:
                probe = _probe(optimizer)
                if probe is not None:
                    self._marks[optimizer] = probe

    def rewritten(self, optimizer: Optimizer) -> bool:
        """Whether `optimizer`'s gradients are not the ones it held when the last step was evaluated.

        Then a backward pass the step tracking did not see (one that does not go through
        the model's own forward, as a discriminator's) wrote them: its step is a step of
        its own. Read from one parameter's `.grad`: a new tensor since, or none, as
        `zero_grad()` (set_to_none, the default) and a backward pass leave it. Gradients
        zeroed in place (`set_to_none=False`) look the same as before; the version counter
        cannot tell that from GradScaler unscaling the next optimizer's gradients in place.
        """
        mark = self._marks.get(optimizer)
        if mark is None:
            return False
        now = _probe(optimizer)
        return now is None or now[0] is not mark[0] or now[1]() is not mark[1]()

    def continuing(self, optimizer: Optimizer) -> None:
        """`optimizer` steps in the step evaluated last (after the same backward pass)."""
        self._current.add(optimizer)
        self._groups[optimizer] = self._current

    def group(self, optimizer: Optimizer) -> Optional[list[Optimizer]]:
        """The optimizers that stepped with `optimizer` in its last step (None: it has not stepped)."""
        group = self._groups.get(optimizer)
        return None if group is None else list(group)
