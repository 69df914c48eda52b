"""Statistics without host syncs: device-side partials in hooks, finished on the host once a step.

A hook never reads a value back. It reduces each target tensor to a few *partials*
(its norm, sum, min, max, count of zeros, count of non-finite elements) with as few
passes as it can (one `_foreach_norm` over a list of tensors, one `aminmax` per tensor),
and leaves a small float64 matrix on the device: one row per tensor, one column per
partial. The runtime concatenates every matrix of a step and reads them back with one
transfer; `combine` and `finish` then turn rows into the statistics of spec section 4 in
plain Python. Partials combine exactly across tensors, calls and micro-batches, so
`per: module` (weight and bias together) and `per: rule` are a sum over rows, not a
second pass over the data.

Conventions: `std` is the unbiased standard deviation (`torch.std`'s default); every
statistic but `nonfinite` and `numel` propagates NaN and Inf, as torch's reductions do.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Sequence

import torch

__all__ = ["PARTIALS", "partials_for", "tensor_partials", "combine", "finish"]

#: The partials a hook computes, in column order.
PARTIALS: tuple[str, ...] = ("norm", "sum", "m2", "min", "max", "zeros", "nonfinite")

_NEEDS: Mapping[str, tuple[str, ...]] = {
    "l2_norm": ("norm",),
    "mean": ("sum",),
    "std": ("sum", "m2"),
    "rms": ("norm",),
    "min": ("min",),
    "max": ("max",),
    "abs_max": ("min", "max"),
    "zero_fraction": ("zeros",),
    "nonfinite": ("nonfinite",),
    "numel": (),
}


def partials_for(stats: Iterable[str]) -> tuple[str, ...]:
    """The partial columns needed for `stats`, in `PARTIALS` order (computed once, at compile time)."""
    wanted = {p for s in stats for p in _NEEDS[s]}
    return tuple(p for p in PARTIALS if p in wanted)


def tensor_partials(tensors: Sequence[torch.Tensor], kinds: Sequence[str]) -> torch.Tensor:
    """Reduce each tensor to the partials `kinds`: a `[len(tensors), len(kinds)]` float64 matrix.

    Runs on the tensors' device and never synchronizes. Tensors must be non-empty and
    floating point; the caller filters. `numel` is not a column: shapes are known on the
    host already.
    """
    n = len(tensors)
    if not kinds:
        return torch.empty((n, 0), dtype=torch.float64, device=tensors[0].device)
    with torch.no_grad():
        columns: list[torch.Tensor] = []
        minmax = _minmax(tensors) if ("min" in kinds or "max" in kinds) else None
        moments = _moments(tensors) if "m2" in kinds else None
        for kind in kinds:
            if kind == "norm":
                col = torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32))
            elif kind == "sum":
                col = (moments[0] if moments is not None
                       else torch.stack([t.sum(dtype=torch.float64) for t in tensors]))
            elif kind == "m2" and moments is not None:
                col = moments[1]
            elif kind == "min" and minmax is not None:
                col = minmax[0]
            elif kind == "max" and minmax is not None:
                col = minmax[1]
            elif kind == "zeros":
                col = torch.stack([torch.count_nonzero(t == 0) for t in tensors])
            else:  # nonfinite
                col = torch.stack([torch.count_nonzero(~torch.isfinite(t)) for t in tensors])
            columns.append(col.to(torch.float64))
        return torch.stack(columns, dim=1)


def _minmax(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [torch.aminmax(t.detach()) for t in tensors]
    return torch.stack([p.min.float() for p in pairs]), torch.stack([p.max.float() for p in pairs])


def _moments(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor (sum, m2) from `var_mean`, which is accurate where sum-of-squares cancels."""
    sums, m2s = [], []
    for t in tensors:
        var, mean = torch.var_mean(t.float(), correction=0)
        sums.append(mean * t.numel())
        m2s.append(var * t.numel())
    return torch.stack(sums), torch.stack(m2s)


def combine(
    rows: Sequence[Sequence[float]], numels: Sequence[int], kinds: Sequence[str]
) -> dict[str, float]:
    """Merge partial rows (of several tensors, calls or micro-batches) into one set of partials.

    `m2` (the sum of squared deviations from the mean) merges with Chan et al.'s
    parallel formula, which needs each row's element count.
    """
    merged: dict[str, float] = {}
    for i, kind in enumerate(kinds):
        values = [row[i] for row in rows]
        if kind == "m2":
            merged[kind] = _merge_m2(values, [row[kinds.index("sum")] for row in rows], numels)
        elif kind == "norm":
            merged[kind] = math.sqrt(math.fsum(v * v for v in values))
        elif kind == "min":
            merged[kind] = _nan_aware(min, values)
        elif kind == "max":
            merged[kind] = _nan_aware(max, values)
        else:
            merged[kind] = math.fsum(values)
    return merged


def _merge_m2(m2s: Sequence[float], sums: Sequence[float], numels: Sequence[int]) -> float:
    n_a, mean_a, m2_a = 0, 0.0, 0.0
    for m2_b, sum_b, n_b in zip(m2s, sums, numels):
        if n_b == 0:
            continue
        mean_b = sum_b / n_b
        n = n_a + n_b
        delta = mean_b - mean_a
        m2_a = m2_a + m2_b + delta * delta * n_a * n_b / n
        mean_a = mean_a + delta * n_b / n
        n_a = n
    return m2_a


def _nan_aware(pick: Callable[[Sequence[float]], float], values: Sequence[float]) -> float:
    return math.nan if any(math.isnan(v) for v in values) else pick(values)


def finish(partials: Mapping[str, float], numel: int, stats: Iterable[str]) -> dict[str, float]:
    """Turn merged partials into the named statistics."""
    out: dict[str, float] = {}
    for stat in stats:
        out[stat] = _finish_one(stat, partials, numel)
    return out


def _finish_one(stat: str, p: Mapping[str, float], n: int) -> float:
    if stat == "numel":
        return float(n)
    if stat == "nonfinite":
        return p["nonfinite"]
    if stat == "l2_norm":
        return p["norm"]
    if stat == "min":
        return p["min"]
    if stat == "max":
        return p["max"]
    if stat == "abs_max":
        return max(abs(p["min"]), abs(p["max"])) if not math.isnan(p["min"] + p["max"]) else math.nan
    if n == 0:
        return math.nan
    if stat == "mean":
        return p["sum"] / n
    if stat == "rms":
        return p["norm"] / math.sqrt(n)
    if stat == "zero_fraction":
        return p["zeros"] / n
    # std, unbiased like torch.std
    if n < 2:
        return math.nan
    return math.sqrt(max(p["m2"], 0.0) / (n - 1)) if not math.isnan(p["m2"]) else math.nan
