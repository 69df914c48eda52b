"""Distributed training: statistics of sharded tensors (FSDP2, DTensor).

**Sharded tensors.** Under FSDP2 (`fully_shard`) parameters and gradients are `DTensor`s,
each rank holding a shard; tensor-parallel layers may return `DTensor` activations. A
statistic of such a tensor is the statistic of the *full* tensor. In the hook, `shard_partials`
reduces each rank's `to_local()` shard to the usual partials (an empty shard contributes
the identity: sums 0, min +inf, max -inf). At the readback, before anything is read to the
host, `reduce_shards` combines the shards' partials over the process groups of the mesh
dimensions the tensor is sharded on: one `all_reduce(SUM)` and one `all_reduce(MAX)` per
process group for all sharded rows of the step at once (minima travel negated in the MAX
reduction). A mesh dimension with a `Replicate` placement holds the same data on every
rank and is not reduced over, so nothing is counted twice. A `Partial` placement (a sum
still pending across ranks) cannot be measured from its pieces without that sum: the rule
raises (handled by `onError`) rather than report a wrong number.

Exactness: sums, counts and extrema combine exactly. The centred second moment (std)
travels as `m2 + sum**2 / n` per shard and comes back as `M2 = Q - S**2 / N`, in float64:
this cancels only when the mean is 10**8 times the standard deviation or more. NaN in a
minimum or maximum is carried by a count of its own (a MAX reduction need not propagate
NaN), and comes back as NaN.

The rank agreement on a step's decision lives in `agreement`; the DDP and FSDP wrappers
around a model are found by `hooks.wrappers`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from .stats import tensor_partials

__all__ = ["Shards", "Units", "full_value", "local_shards", "reduce_shards", "shard_name", "shard_partials", "sum_over_groups",
           "unit_shards"]

#: What an empty shard contributes to each partial.
_IDENTITY = {
    "sumsq": 0.0, "sum": 0.0, "m2": 0.0, "min": math.inf, "max": -math.inf, "nonzero": 0.0, "finite": 0.0, "ref_sumsq": 0.0,
}
#: The partials that add up across shards, in the layout of the SUM reduction; a NaN count last.
_SUMMED = ("sumsq", "sum", "m2", "nonzero", "finite", "ref_sumsq")


@dataclass(frozen=True)
class Shards:
    """Per row of a partial matrix: the process groups to reduce it over (none: nothing to reduce), its shard's size."""

    groups: tuple[tuple[Any, ...], ...]
    local_numels: tuple[int, ...]


#: Tensor types that are never a DTensor: checked first, since `isinstance(t, DTensor)` costs ~2.5 us a tensor.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


_DTENSOR: Optional[type] = None


def _dtensor_type() -> Optional[type]:
    """DTensor, once `torch.distributed.tensor` is imported (no DTensor exists before; importing it costs ~0.5 s)."""
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(module, "DTensor", None) if module is not None else None
    return _DTENSOR


def local_shards(tensors: Sequence[torch.Tensor]) -> Optional[tuple[list[torch.Tensor], Shards]]:
    """Each tensor's local shard and the groups its partials must be reduced over; None when no DTensor is among them.

    Raises ValueError for a `Partial` placement (see the module docstring).
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return None
    for t in tensors:
        if type(t) not in _PLAIN and isinstance(t, dtensor):
            break
    else:
        return None
    locals_: list[torch.Tensor] = []
    groups: list[tuple[Any, ...]] = []
    for tensor in tensors:
        if not isinstance(tensor, dtensor):
            locals_.append(tensor)
            groups.append(())
            continue
        t = cast("DTensor", tensor)
        mesh = t.device_mesh
        dims = []
        for dim, placement in enumerate(t.placements):
            if placement.is_partial():
                raise ValueError(
                    f"a DTensor with placements {tuple(t.placements)} holds a pending reduction across ranks; "
                    "its statistics are not those of its pieces (measure it after the reduction)")
            if not placement.is_replicate():
                dims.append(dim)
        locals_.append(t.to_local())
        groups.append(tuple(mesh.get_group(d) for d in dims))
    return locals_, Shards(tuple(groups), tuple(t.numel() for t in locals_))


@dataclass(frozen=True)
class Units:
    """For AGC, the local shards of gradients and weights, and per tensor two lists of process groups.

    `split`: the groups each of its units is split over (sum squared norms over them);
    `apart`: the groups over which its units are dealt out whole, one rank each (sum counts
    of units over them to count those of the full tensor).
    """

    grads: list[torch.Tensor]
    weights: list[torch.Tensor]
    split: list[tuple[Any, ...]]
    apart: list[tuple[Any, ...]]


def unit_shards(grads: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> Optional[Units]:
    """For AGC: local shards of gradients and weights, and per tensor the groups its units span.

    A unit is a slice along dim 0 (a whole tensor of ndim <= 1). A mesh dimension that
    shards dim 0 of a tensor with ndim >= 2 (FSDP2's default `Shard(0)`, `_StridedShard(0)`)
    keeps each unit on one rank: nothing to reduce. One that shards any other dim (a
    `shard_placement_fn` returning `Shard(1)`, tensor-parallel `RowwiseParallel`), or a
    tensor of ndim <= 1, splits units across its group, whose squared norms are summed
    (`sum_over_groups`), and the units dealt out over the mesh dimensions sharding
    dim 0 are counted over their groups. None when no DTensor is among `grads`.

    Raises ValueError for a `Partial` gradient (a sum still pending) or a weight that is
    not laid out as its gradient (its units would not line up).
    """
    found = local_shards(grads)
    if found is None:
        return None
    dtensor = cast(type, _dtensor_type())  # not None: local_shards found a DTensor
    units = Units(found[0], [], [], [])
    for g, w in zip(grads, weights):
        if not isinstance(g, dtensor):
            units.weights.append(w)
            units.split.append(())
            units.apart.append(())
            continue
        dg, dw = cast("DTensor", g), cast("DTensor", w)
        if not isinstance(w, dtensor) or dw.placements != dg.placements or dw.device_mesh != dg.device_mesh:
            layout = tuple(dw.placements) if isinstance(w, dtensor) else "a plain tensor"
            raise ValueError(f"a gradient with placements {tuple(dg.placements)} belongs to a weight laid out as "
                             f"{layout}: AGC needs both laid out alike to pair their units")
        units.weights.append(dw.to_local())
        sharded = [(d, getattr(p, "dim", 0)) for d, p in enumerate(dg.placements) if p.is_shard()]
        whole = g.ndim > 1  # a unit is a slice along dim 0, else the whole tensor
        units.split.append(tuple(dg.device_mesh.get_group(d) for d, dim in sharded if not (whole and dim == 0)))
        units.apart.append(tuple(dg.device_mesh.get_group(d) for d, dim in sharded if whole and dim == 0))
    return units


def sum_over_groups(vectors: list[torch.Tensor], spans: Sequence[tuple[Any, ...]]) -> list[torch.Tensor]:
    """Each vector summed over the process groups in its `spans` entry (one all_reduce per group in all).

    Collective, inside the step pre-hook where every rank is at the same step: every rank
    must pass the same tensors in the same order (as for `reduce_shards`).
    """
    import torch.distributed as dist

    sizes = [v.numel() for v in vectors]
    order: list[Any] = []
    for groups in spans:
        order.extend(g for g in groups if g not in order)
    if not order:
        return vectors
    flat = torch.cat(vectors)
    for group in order:
        rows = [k for k, groups in enumerate(spans) if group in groups]
        if len(rows) == len(vectors):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            continue
        pieces = list(torch.split(flat, sizes))
        part = torch.cat([pieces[k] for k in rows])
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        for k, reduced in zip(rows, torch.split(part, [sizes[k] for k in rows])):
            pieces[k] = reduced
        flat = torch.cat(pieces)
    return list(torch.split(flat, sizes))


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the value of `t`: a DTensor's full value (a collective when it is
    sharded or pending: a clip's norm under FSDP2), any other tensor itself."""
    dtensor = _dtensor_type()
    if dtensor is None or type(t) in _PLAIN or not isinstance(t, dtensor):
        return t
    return cast("DTensor", t).full_tensor()


def shard_partials(
    locals_: Sequence[torch.Tensor], kinds: Sequence[str], references: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`stats.tensor_partials` of the local shards, where an empty shard gets the identity row."""
    full = [i for i, t in enumerate(locals_) if t.numel() > 0]
    if len(full) == len(locals_):
        return tensor_partials(locals_, kinds, references=references)
    device = locals_[0].device
    out = torch.tensor([_IDENTITY[k] for k in kinds], dtype=torch.float64, device=device).repeat(len(locals_), 1)
    if full:
        out[full] = tensor_partials([locals_[i] for i in full], kinds,
                                    references=None if references is None else references[full])
    return out


def shard_name(name: str) -> str:
    """The name of this rank's shard of the tensor `name` (for tensor files)."""
    import torch.distributed as dist
    return (f"{name}-" if name else "") + f"shard{dist.get_rank()}"


def reduce_shards(items: Sequence[tuple[torch.Tensor, Sequence[str], Shards, Sequence[int]]]) -> list[torch.Tensor]:
    """Per (matrix, kinds, shards, global numels): the matrix with its sharded rows' partials those of the full tensors.

    Collective: every rank of each group must call it with the same sharded rows in the
    same order (the same rules over the same modules, as FSDP's own collectives assume).
    """
    import torch.distributed as dist

    summed: list[torch.Tensor] = []
    maxed: list[torch.Tensor] = []
    order: list[Any] = []  # the groups, in first-seen order (the same on every rank)
    rows_of: dict[Any, list[int]] = {}
    picks: list[list[int]] = []
    position = 0
    for matrix, kinds, shards, _ in items:
        rows = [r for r, g in enumerate(shards.groups) if g]
        picks.append(rows)
        if not rows:
            continue
        s, m = _canonical(matrix[rows], kinds, [shards.local_numels[r] for r in rows])
        summed.append(s)
        maxed.append(m)
        for r in rows:
            for group in shards.groups[r]:
                if group not in rows_of:
                    rows_of[group] = []
                    order.append(group)
                rows_of[group].append(position)
            position += 1
    if not summed:
        return [matrix for matrix, *_ in items]
    total_s, total_m = torch.cat(summed), torch.cat(maxed)
    for group in order:
        rows = rows_of[group]
        if len(rows) == position:
            dist.all_reduce(total_s, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(total_m, op=dist.ReduceOp.MAX, group=group)
            continue
        part_s, part_m = total_s[rows], total_m[rows]
        dist.all_reduce(part_s, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(part_m, op=dist.ReduceOp.MAX, group=group)
        total_s[rows], total_m[rows] = part_s, part_m
    out: list[torch.Tensor] = []
    start = 0
    for (matrix, kinds, _, numels), rows in zip(items, picks):
        if not rows:
            out.append(matrix)
            continue
        end = start + len(rows)
        matrix = matrix.clone()
        matrix[rows] = _restore(total_s[start:end], total_m[start:end], kinds, [numels[r] for r in rows])
        out.append(matrix)
        start = end
    return out


def _canonical(
    rows: torch.Tensor, kinds: Sequence[str], local_numels: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of partials in the layout of the two reductions: SUM `[*_SUMMED, nan]`, MAX `[-min, max]`."""
    n = rows.shape[0]
    s = torch.zeros((n, len(_SUMMED) + 1), dtype=torch.float64, device=rows.device)
    m = torch.full((n, 2), -math.inf, dtype=torch.float64, device=rows.device)
    nan = torch.zeros(n, dtype=torch.bool, device=rows.device)
    for j, kind in enumerate(kinds):
        col = rows[:, j]
        if kind == "m2":  # m2 + sum**2 / n adds up across shards (see the module docstring)
            counts = torch.tensor(local_numels, dtype=torch.float64, device=rows.device).clamp(min=1)
            col = col + rows[:, list(kinds).index("sum")].square() / counts
        if kind in _SUMMED:
            s[:, _SUMMED.index(kind)] = col
            continue
        nan |= col.isnan()
        m[:, 0 if kind == "min" else 1] = (-col if kind == "min" else col).nan_to_num(nan=-math.inf)
    s[:, -1] = nan.double()
    return s, m


def _restore(s: torch.Tensor, m: torch.Tensor, kinds: Sequence[str], numels: Sequence[int]) -> torch.Tensor:
    """The partial columns `kinds` back from the reduced SUM and MAX rows."""
    cols: list[torch.Tensor] = []
    nan = s[:, -1] > 0
    for kind in kinds:
        if kind == "m2":
            counts = torch.tensor(numels, dtype=torch.float64, device=s.device).clamp(min=1)
            m2 = s[:, _SUMMED.index("m2")] - s[:, _SUMMED.index("sum")].square() / counts
            cols.append(m2.clamp(min=0))  # rounding may leave -0.0...; NaN stays NaN
        elif kind in _SUMMED:
            cols.append(s[:, _SUMMED.index(kind)])
        else:
            col = -m[:, 0] if kind == "min" else m[:, 1]
            cols.append(col.masked_fill(nan, math.nan))
    return torch.stack(cols, dim=1)
