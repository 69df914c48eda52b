"""Actions compiled once per rule, and the tensor operations that clip and scale.

A rule's action list becomes a `Program`: runs of `capture`/`alert` actions collapse
into one `StatsOp` (one pass of statistics serves them all, since nothing changes the
tensors in between), and each `clip`/`scale` is a `MutateOp`. Hooks only execute the
program; all decisions about *what* to compute were made here.

`clip_norm` mirrors `torch.nn.utils.clip_grad_norm_` operation for operation (same
foreach norms, the same `1e-6`, the same clamp), so a `per: rule` clip at `step` gives
the same gradients as calling it on the rule's parameters. It also leaves, on the device,
each group's measured norm and whether it was clipped, which the read-back turns into
`hookpolicy_clipped_total` and (for a `max_norm` expression) the clip's norm history.
`clip_unitwise` is AGC (NFNets, Brock et al. 2021), written from the paper's equations as
timm's `adaptive_clip_grad` is.
"""

from __future__ import annotations

import math

from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Sequence, Union

import torch

from ...policy.model import Alert, Capture, Clip, Rule, Scale
from .distributed import full_value
from .stats import partials_for

__all__ = ["StatsOp", "MutateOp", "Program", "compile_rule", "mutate", "clip_norm", "clip_unitwise"]


@dataclass(frozen=True)
class StatsOp:
    """One statistics pass serving consecutive captures and alerts."""

    segment: int
    kinds: tuple[str, ...]
    actions: tuple[tuple[int, Union[Capture, Alert]], ...]
    #: the captures whose hooks keep a device copy of each tensor (tensor files, histograms)
    tensors: tuple[tuple[int, Capture], ...]

    @cached_property
    def stats(self) -> tuple[str, ...]:
        """The statistics the pass finishes (computed once: the read-back asks every step)."""
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

    @property
    def unitwise(self) -> bool:
        """AGC: a clip that reads the parameters' weights (`clip_unitwise`)."""
        return isinstance(self.action, Clip) and self.action.unitwise


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


def mutate(action: Union[Scale, Clip], tensors: list[torch.Tensor], groups: Sequence[Sequence[int]], inplace: bool) -> list[torch.Tensor]:
    """Apply a scale or a clamp (`clip` with min/max) to `tensors`; in place (parameters, gradients) or returning new ones.

    Norm clips go through `clip_norm`, which also reports what it did.
    """
    with torch.no_grad() if inplace else nullcontext():
        if isinstance(action, Scale):
            if inplace:
                torch._foreach_mul_(tensors, action.factor)
                return tensors
            return [t * action.factor for t in tensors]
        if inplace:
            for t in tensors:
                t.clamp_(min=action.min, max=action.max)
            return tensors
        return [t.clamp(min=action.min, max=action.max) for t in tensors]


#: A threshold computed on the device from a group's norm (a 0-dim tensor): a 0-dim float64
#: tensor, +inf where the group is not to be clipped.
DeviceLimit = Callable[[torch.Tensor], torch.Tensor]
#: A group's max_norm: a number, one computed on the device from its norm, or None (not clipped now).
Limit = Union[None, float, DeviceLimit]


def clip_norm(
    tensors: list[torch.Tensor], limits: Sequence[Limit], norm_type: float,
    groups: Sequence[Sequence[int]], inplace: bool, apply: bool = True,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Clip each group of tensors to a joint `norm_type` norm of at most its limit; report what it did.

    `groups` lists the tensor indices that share one norm (`per: module` / `per: rule`),
    `limits` the max_norm of each group (None: this group is not clipped now; a callable:
    computed on the device from the group's norm, with no read-back: NaN where it is not
    usable, +inf where the group is not to be clipped). The coefficient is
    `clamp(limit / (norm + 1e-6), max=1)`, as `clip_grad_norm_`'s. Returns the tensors
    (clipped unless `apply` is False: audit mode measures and reports only) and a
    `[len(groups), 3]` float64 device matrix, for the read-back: each group's norm as it
    left the clip, `min(norm, limit)` (what an adaptive clip's history appends), 1.0
    where it was clipped (or would have been), and 1.0 where a device limit was not usable
    (so nothing was clipped). Nothing is read back here.
    """
    with torch.no_grad():
        norms = torch._foreach_norm(tensors, norm_type)
        totals: list[torch.Tensor] = []
        for group in groups:
            if len(group) == 1:
                totals.append(norms[group[0]])
            else:
                totals.append(torch.linalg.vector_norm(torch.stack([norms[i] for i in group]), norm_type))
        raw = [limit(full_value(total)) if callable(limit) else limit for total, limit in zip(totals, limits)]
        unusable = [torch.isnan(b) if isinstance(b, torch.Tensor) else None for b in raw]
        bounds = [torch.where(b.isnan(), math.inf, b) if isinstance(b, torch.Tensor) else b for b in raw]
        group_coefs = [None if bound is None else _coefficient(bound, total) for total, bound in zip(totals, bounds)]
        report = _clip_report(totals, bounds, group_coefs, unusable)
        if not apply or all(c is None for c in group_coefs):
            return tensors, report
        only = group_coefs[0]
        if inplace and len(groups) == 1 and only is not None:  # the common case (`per: rule`): one coefficient
            torch._foreach_mul_(tensors, only)
            return tensors, report
        scaled: list[tuple[int, torch.Tensor]] = [
            (i, coef) for group, coef in zip(groups, group_coefs) if coef is not None for i in group]
        if inplace:
            torch._foreach_mul_([tensors[i] for i, _ in scaled], [coef for _, coef in scaled])
            return tensors, report
    # Out of place (forward and backward targets): outside no_grad, so autograd sees the scaling.
    out = list(tensors)
    for i, coef in scaled:
        out[i] = tensors[i] * coef
    return out, report


def _coefficient(bound: Union[float, torch.Tensor], total: torch.Tensor) -> torch.Tensor:
    """`clamp(bound / (total + 1e-6), max=1)`; with a device bound (float64, as ZClip's host
    floats) computed in float64 and cast to the norm's dtype, as a Python float multiplier is."""
    if isinstance(bound, float):
        return torch.clamp(bound / (total + 1e-6), max=1.0)
    return torch.clamp(bound / (full_value(total).double() + 1e-6), max=1.0).to(total.dtype)


def _clip_report(totals: Sequence[torch.Tensor], bounds: Sequence[Union[None, float, torch.Tensor]],
                 coefs: Sequence[Optional[torch.Tensor]], unusable: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """Per group (norm as it left the clip, clipped? 1.0 : 0.0, unusable limit? 1.0 : 0.0) as one
    float64 matrix on the norms' device (`CLIP_COLUMNS`).

    One stack (dtypes promote: a bool flag becomes 1.0) and one cast, besides a comparison
    and a minimum per clipped group: a clip costs a few more small kernels, no sync.
    """
    cells: list[torch.Tensor] = []
    for total, bound, coef, bad in zip(totals, bounds, coefs, unusable):
        total = full_value(total).double()
        left = total if bound is None else (torch.clamp(total, max=bound) if isinstance(bound, float)
                                            else torch.minimum(total, bound))
        zero = total.new_zeros(())
        cells += [left, zero if coef is None else full_value(coef) < 1.0, zero if bad is None else bad]
    return torch.stack(cells).view(len(totals), CLIP_COLUMNS).to(torch.float64)


#: The columns of a clip's report: the norm as it left the clip, clipped, the limit not usable.
CLIP_COLUMNS = 3


#: Reduces squared unit norms of shards to those of whole units: (squares, groups per tensor) -> squares.
UnitReduce = Callable[[list[torch.Tensor], Sequence[tuple[object, ...]]], list[torch.Tensor]]


def clip_unitwise(
    grads: list[torch.Tensor], weights: list[torch.Tensor], ratio: float, eps: float, apply: bool,
    spans: Sequence[tuple[object, ...]] = (), reduce: Optional[UnitReduce] = None,
) -> torch.Tensor:
    """AGC: g_i <- g_i * max_i / max(|g_i|, 1e-6) where |g_i| > max_i = ratio * max(|w_i|, eps).

    A unit i is a slice along dim 0 (an output row of a Linear, an output channel of a
    conv); a tensor of ndim <= 1 is one unit. Gradients change in place when `apply`
    (enforce), else nothing changes (audit). Returns per tensor how many of its units
    were (or would have been) clipped: a float64 vector on the first tensor's device.

    `grads`/`weights` may be local shards: `spans[k]` then names the process groups over
    which tensor k's units are split, and `reduce` sums squared unit norms over them.
    The coefficients are computed on one flat vector per device, so a rule costs two
    norm kernels and one multiplication per tensor plus a constant number of kernels.
    """
    with torch.no_grad():
        g_norms, w_norms = _unit_norms(grads), _unit_norms(weights)
        if reduce is not None and any(spans):
            wide = [k for k, groups in enumerate(spans) if groups]
            squares = reduce([g_norms[k].square() for k in wide] + [w_norms[k].square() for k in wide],
                             [spans[k] for k in wide] * 2)
            for j, k in enumerate(wide):
                g_norms[k], w_norms[k] = squares[j].sqrt(), squares[len(wide) + j].sqrt()
        counts: list[tuple[list[int], torch.Tensor]] = []
        for indices in _by_device(grads):
            sizes = [g_norms[k].numel() for k in indices]
            g_norm = torch.cat([g_norms[k] for k in indices])
            limit = torch.cat([w_norms[k] for k in indices]).clamp(min=eps) * ratio
            over = g_norm > limit
            counts.append((indices, _count_per_tensor(over, sizes)))
            if apply:
                coef = torch.where(over, limit / g_norm.clamp(min=1e-6), 1.0)
                shaped = [c.reshape(_unit_shape(grads[k])) for k, c in zip(indices, torch.split(coef, sizes))]
                torch._foreach_mul_([grads[k] for k in indices], shaped)
        if len(counts) == 1:
            return counts[0][1]
        first = grads[0].device  # several devices (a model split by hand): rare, a copy each
        by_tensor = {k: c.to(first) for indices, vector in counts for k, c in zip(indices, vector.unbind())}
        return torch.stack([by_tensor[k] for k in range(len(grads))])


def _count_per_tensor(flags: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The number of true flags per consecutive run of `sizes`: the L1 norms of the runs, one foreach kernel.

    (A segment sum would need the runs' indices on the device, a host-to-device copy that
    PyTorch synchronises; counts below 2**24 are exact in float32.)
    """
    ones = flags.to(torch.float32)
    return torch.stack(torch._foreach_norm(list(torch.split(ones, sizes)), 1)).to(torch.float64)


def _unit_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norms over all dims but the first (ndim <= 1: of the whole tensor, as a 1-vector)."""
    norms: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    whole = [k for k, t in enumerate(tensors) if t.ndim <= 1]
    if whole:  # biases and norm scales: one foreach kernel for all of them
        for k, norm in zip(whole, torch._foreach_norm([tensors[k] for k in whole])):
            norms[k] = norm.reshape(1)
    for k, t in enumerate(tensors):
        if t.ndim > 1:
            norms[k] = torch.linalg.vector_norm(t, dim=tuple(range(1, t.ndim)))
    return norms


def _unit_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape a tensor's per-unit coefficients broadcast from."""
    return () if t.ndim <= 1 else (t.shape[0],) + (1,) * (t.ndim - 1)


def _by_device(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Tensor indices grouped by device, in first-seen order (one flat coefficient vector per device)."""
    groups: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(k)
    return list(groups.values())
