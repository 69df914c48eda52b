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

Whether an optimizer steps after the same backward pass as the step evaluated last is
read from its gradients (`rewritten`): a backward pass that does not go through the
model's own forward (a discriminator on a detached fake) is not seen by step tracking.
For an optimizer seen stepping before, one of its parameters' `.grad` is noted at each
evaluation; for one not seen yet, while optimizers are still being learned (`LEARNING`
evaluations after the last new one), the `.grad` of every parameter no known optimizer
holds is.

Cost: each optimizer's parameter ids are computed once and kept while its
`param_groups` look the same (the ids and lengths of the groups' lists, so an
`add_param_group` is seen); the left-out set is rebuilt only when a group or an
optimizer's parameters change. A step with one optimizer pays a few dictionary lookups
(plus, during its first `LEARNING` steps, a look at each parameter's `.grad`).
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

import torch

__all__ = ["LEARNING", "Scopes"]

#: evaluations after the last new optimizer during which parameters no optimizer holds are watched
LEARNING = 16

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

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._params = params
        #: each optimizer seen stepping -> the optimizers that stepped with it in its last step
        self._groups: "weakref.WeakKeyDictionary[Optimizer, weakref.WeakSet[Optimizer]]" = weakref.WeakKeyDictionary()
        self._current: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
        self._ids: "weakref.WeakKeyDictionary[Optimizer, tuple[_Signature, frozenset[int]]]" = (
            weakref.WeakKeyDictionary())
        self._left_out: dict[int, tuple[tuple[object, ...], frozenset[int]]] = {}
        self._marks: "weakref.WeakKeyDictionary[Optimizer, _Probe]" = weakref.WeakKeyDictionary()
        self._evaluations = 0
        self._learned_at = 0  # the evaluation that met the last new optimizer
        self._loose: Optional[list[torch.Tensor]] = None  # parameters no known optimizer holds (None: to find)
        self._loose_grads: dict[int, Optional["weakref.ref[torch.Tensor]"]] = {}

    def reset(self) -> None:
        """The model's parameters changed: forget the parameter ids (the groups stay)."""
        self._ids = weakref.WeakKeyDictionary()
        self._left_out.clear()
        self._loose = None
        self._learned_at = self._evaluations

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
        self._evaluations += 1
        group = self._groups.get(optimizer)
        if group is None:  # a new optimizer: who holds what anew
            self._learned_at, self._loose = self._evaluations, None
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

    def mark(self, evaluating: Optimizer) -> None:
        """After a step's rules ran: note the gradients the other optimizers hold now (for `rewritten`)."""
        if len(self._groups) > 1 or self._marks:
            self._marks = weakref.WeakKeyDictionary()
            for optimizer in self._groups:
                if optimizer is not evaluating:
                    probe = _probe(optimizer)
                    if probe is not None:
                        self._marks[optimizer] = probe
        self._loose_grads.clear()
        if self._evaluations - self._learned_at < LEARNING:
            if self._loose is None:
                held = frozenset().union(*(self.param_ids(o) for o in self._groups))
                self._loose = [p for p in self._params() if id(p) not in held]
            for p in self._loose:
                self._loose_grads[id(p)] = None if p.grad is None else weakref.ref(p.grad)

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
        if mark is not None:
            now = _probe(optimizer)
            return now is None or now[0] is not mark[0] or now[1]() is not mark[1]()
        if optimizer in self._groups or not self._loose_grads:
            return False
        for group in optimizer.param_groups:  # not seen stepping yet: its parameters were loose at the evaluation
            for p in group["params"]:
                if p.grad is not None and id(p) in self._loose_grads:
                    before = self._loose_grads[id(p)]
                    return before is None or before() is not p.grad
        return False

    def continuing(self, optimizer: Optimizer) -> None:
        """`optimizer` steps in the step evaluated last (after the same backward pass)."""
        if optimizer not in self._groups:
            self._learned_at, self._loose = self._evaluations, None
        self._current.add(optimizer)
        self._groups[optimizer] = self._current
