"""Actions compiled once per rule, and the tensor operations that clip and scale.

A rule's action list becomes a `Program`: runs of `capture`/`alert` actions collapse
into one `StatsOp` (one pass of statistics serves them all, since nothing changes the
tensors in between), and each `clip`/`scale` is a `MutateOp`. Hooks only execute the
program; all decisions about *what* to compute were made here.

`clip_norm` mirrors `torch.nn.utils.clip_grad_norm_` operation for operation (same
foreach norms, the same `1e-6`, the same clamp), so a `per: rule` clip at `step` gives
the same gradients as calling it on the rule's parameters.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from ..policy.model import Alert, Capture, Clip, Rule, Scale
from .stats import partials_for

__all__ = ["StatsOp", "MutateOp", "Program", "compile_rule", "mutate", "clip_norm"]


@dataclass(frozen=True)
class StatsOp:
    """One statistics pass serving consecutive captures and alerts."""

    segment: int
    kinds: tuple[str, ...]
    actions: tuple[tuple[int, Union[Capture, Alert]], ...]
    #: the captures whose hooks keep a device copy of each tensor (tensor files, histograms)
    tensors: tuple[tuple[int, Capture], ...]

    @property
    def stats(self) -> tuple[str, ...]:
        wanted: set[str] = set()
        for _, action in self.actions:
            wanted.update(action.stats)
        return tuple(sorted(wanted))


@dataclass(frozen=True)
class MutateOp:
    index: int
    action: Union[Clip, Scale]

    @property
    def name(self) -> str:
        return "clip" if isinstance(self.action, Clip) else "scale"


Program = tuple[Union[StatsOp, MutateOp], ...]


def compile_rule(rule: Rule) -> Program:
    """Group a rule's actions into statistics passes and mutations, keeping list order."""
    ops: list[Union[StatsOp, MutateOp]] = []
    pending: list[tuple[int, Union[Capture, Alert]]] = []

    def flush() -> None:
        if pending:
            stats = {s for _, a in pending for s in a.stats}
            files = tuple((i, a) for i, a in pending if isinstance(a, Capture) and a.copies)
            ops.append(StatsOp(len(ops), partials_for(stats), tuple(pending), files))
            pending.clear()

    for index, action in enumerate(rule.actions):
        if isinstance(action, (Capture, Alert)):
            pending.append((index, action))
        else:
            flush()
            ops.append(MutateOp(index, action))
    flush()
    return tuple(ops)


def mutate(
    action: Union[Clip, Scale], tensors: list[torch.Tensor], groups: Sequence[Sequence[int]], inplace: bool
) -> list[torch.Tensor]:
    """Apply a clip or scale to `tensors`; in place (parameters, gradients) or returning new ones.

    `groups` lists the tensor indices that share one norm (`per: module` / `per: rule`).
    """
    with torch.no_grad() if inplace else nullcontext():
        if isinstance(action, Scale):
            if inplace:
                torch._foreach_mul_(tensors, action.factor)
                return tensors
            return [t * action.factor for t in tensors]
        if action.max_norm is None:
            if inplace:
                for t in tensors:
                    t.clamp_(min=action.min, max=action.max)
                return tensors
            return [t.clamp(min=action.min, max=action.max) for t in tensors]
        return clip_norm(tensors, action.max_norm, action.norm_type, groups, inplace)


def clip_norm(
    tensors: list[torch.Tensor], max_norm: float, norm_type: float,
    groups: Sequence[Sequence[int]], inplace: bool,
) -> list[torch.Tensor]:
    """Clip each group of tensors to a joint `norm_type` norm of at most `max_norm`."""
    with torch.no_grad():
        norms = torch._foreach_norm(tensors, norm_type)
        group_coefs: list[torch.Tensor] = []
        for group in groups:
            if len(group) == 1:
                total = norms[group[0]]
            else:
                total = torch.linalg.vector_norm(torch.stack([norms[i] for i in group]), norm_type)
            group_coefs.append(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        if inplace and len(groups) == 1:  # the common case (`per: rule`): one coefficient, no list
            torch._foreach_mul_(tensors, group_coefs[0])
            return tensors
        coefs: list[torch.Tensor] = [group_coefs[0]] * len(tensors)
        for group, coef in zip(groups, group_coefs):
            for i in group:
                coefs[i] = coef
        if inplace:
            torch._foreach_mul_(tensors, coefs)
            return tensors
    # Out of place (forward and backward targets): outside no_grad, so autograd sees the scaling.
    return [t * c for t, c in zip(tensors, coefs)]

