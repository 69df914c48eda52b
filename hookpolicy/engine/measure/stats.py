"""Statistics without host syncs: device-side partials in hooks, finished on the host once a step.

A hook never reads a value back. It reduces each target tensor to a few *partials*
(its sum of squares, sum, min, max, count of nonzero and of finite elements) with as few passes
over the data as it can, and leaves a small float64 matrix on the device: one row per
tensor, one column per partial, built with one `stack`. The runtime concatenates every
matrix of a step and reads them back with one transfer; `combine` and `finish` then turn
rows into the statistics of spec section 4 in plain Python. Partials combine exactly
across tensors, calls and micro-batches, so `per: module` (weight and bias together) and
`per: rule` are a sum over rows, not a second pass over the data.

The passes, chosen by measurement (`bench/run.py`; numbers in docs/benchmarks.md):

- l2_norm, rms (the `sumsq` partial): for a single contiguous float32/float64 CPU tensor
  (a forward or backward target) one `dot(x, x)` (MKL's dot is faster than torch's norm
  kernel on data still in cache, and more accurate: blocked sums); otherwise (a step
  rule's parameter list, CUDA, half types, strided tensors) one `_foreach_norm` over the
  whole list, accumulating in float32: one fused kernel on CUDA, a C++ loop on CPU.
- min, max, abs_max: one `aminmax` per tensor (abs_max is `max(-min, max)`).
- mean, std (`sum`, `m2`): on CPU the sum, then `x - mean` into the scratch buffer and its
  dot product with itself (two passes, vectorized: `var_mean` is a scalar loop there,
  about 30x slower); on CUDA one `var_mean`. With `m2` at hand, l2_norm and rms need no
  pass of their own: `sumsq = m2 + sum**2 / n`.
- zero_fraction: `count_nonzero(x)`, one pass; on CPU, for a hook's one tensor within the
  scratch buffer's size, `x != 0` written as 1.0 and 0.0 into the scratch buffer and its
  `sum` into the row buffer: two vectorized passes, faster than `count_nonzero`'s scalar loop,
  and the same exact count (NaN and Inf are nonzero in both; a sum of ones is an exact integer).
- update_ratio (`target: update` only): the update's sum of squares (`sumsq`) and its
  parameter's before the update (`ref_sumsq`), which the caller measured before the
  update and hands over (`references`): `sqrt(sumsq / ref_sumsq)`, so `per: module`
  is the joint norm of the module's updates over the joint norm of its parameters.
- nonfinite: an exact count of NaN and +-Inf without `isfinite` (which is four
  element-wise kernels on CPU): `1 + 0 * x` is 1 where x is finite and NaN elsewhere, so
  its `nansum` counts the finite elements, and `nonfinite = numel - finite` on the host.
  The sum is exact: float32 up to 2**24 elements, float64 beyond.

**The rule per device.** On CUDA a hook never reads a value back (a read is a host-device
sync, which stalls the training thread until the GPU catches up): every partial, the
count of finite elements included, stays on the device until the readback. On CPU a read
is not a sync (the values are in memory when the operator returns), so the hook takes the
path with the fewest passes: it reads the partials it has computed anyway and counts the
finite elements only when they do not prove the count. A finite `min` and `max` prove that
no element is NaN or +-Inf (both propagate NaN, and an infinite element is one of them),
exactly; so does a finite sum, sum of squares or `m2` (a NaN or infinite element makes them
NaN or infinite). Only where the proof fails (a non-finite element, or a sum of squares that
overflowed) is the count taken, so the result is the same count, exactly, with one pass
less in a normal step (two kernels on CPU: the costliest statistic of all). A `step` rule
defers its count to the readback on either device (`defer_counts`).

Conventions: `std` is the unbiased standard deviation (`torch.std`'s default); every
statistic but `nonfinite` and `numel` propagates NaN and Inf, as torch's reductions do.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import torch

__all__ = [
    "PARTIALS", "RowPlan", "partials_for", "tensor_partials", "host_partials", "host_row", "row_plan",
    "reads_at_once", "sums_of_squares", "resolve_counts", "combine", "combine_sums", "exact_sum", "finish", "summed",
]

#: The partials a hook computes, in column order.
PARTIALS: tuple[str, ...] = ("sumsq", "sum", "m2", "min", "max", "nonzero", "finite", "ref_sumsq")

_NEEDS: Mapping[str, tuple[str, ...]] = {
    "l2_norm": ("sumsq",),
    "mean": ("sum",),
    "std": ("sum", "m2"),
    "rms": ("sumsq",),
    "min": ("min",),
    "max": ("max",),
    "abs_max": ("min", "max"),
    "zero_fraction": ("nonzero",),
    "nonfinite": ("finite",),
    "numel": (),
    "update_ratio": ("sumsq", "ref_sumsq"),
}

#: float32 holds every integer up to 2**24 exactly: a count of ones summed in float32 is exact up to there.
_EXACT_FLOAT32 = 1 << 24
_DOT_DTYPES = (torch.float32, torch.float64)


def partials_for(stats: Iterable[str]) -> tuple[str, ...]:
    """The partial columns needed for `stats`, in `PARTIALS` order (computed once, at compile time).

    With `sum` and `m2` at hand, the sum of squares is `m2 + sum**2 / n` (two positive
    terms, no cancellation), so `sumsq` is then not a pass of its own.
    """
    wanted = {p for s in stats for p in _NEEDS[s]}
    if "m2" in wanted:
        wanted.discard("sumsq")
    return tuple(p for p in PARTIALS if p in wanted)


def tensor_partials(
    tensors: Sequence[torch.Tensor], kinds: Sequence[str], *, defer_counts: bool = False,
    references: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reduce each tensor to the partials `kinds`: a `[len(tensors), len(kinds)]` float64 matrix.

    Runs on the tensors' device and never synchronizes. Tensors must be non-empty and
    floating point; the caller filters. `numel` is not a column: shapes are known on the
    host already.

    `defer_counts=True` skips the pass that counts finite elements: the `finite` column
    holds a placeholder instead (the row's sum of squares, which is finite exactly when
    no element is NaN or Inf, barring overflow), and `resolve_counts` must replace it
    after the readback, while the tensors still hold the same values. That suits `step`
    targets (gradients and weights live until the optimizer step), and only when nothing
    clips or scales them in between; never forward or backward targets.

    `references` is the `ref_sumsq` column, when `kinds` has it: a float64 vector with one
    value per tensor (`sums_of_squares` of the parameters before their update).
    """
    n = len(tensors)
    if not kinds:
        return torch.empty((n, 0), dtype=torch.float64, device=tensors[0].device)
    compute = _partials
    if ("finite" in kinds and not defer_counts and reads_at_once(tensors)
            and sum(t.numel() for t in tensors) >= _HOST_MIN):
        compute = _counted_on_host  # CPU: a read is not a sync (see the module docstring)
    if any(t.requires_grad for t in tensors):  # forward targets: no graph for the statistics
        with torch.no_grad():
            return compute(tensors, kinds, defer_counts, references)
    return compute(tensors, kinds, defer_counts, references)


def sums_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum of squares, a float64 vector on their device (no host sync)."""
    with torch.no_grad():
        col, are_norms = _sums_of_squares(tensors)
        squares = _column(col).to(torch.float64)
        return squares.square_() if are_norms else squares


def _partials(
    tensors: Sequence[torch.Tensor], kinds: Sequence[str], defer_counts: bool, references: Optional[torch.Tensor],
) -> torch.Tensor:
    # One 0-d tensor per cell, row-major, stacked once: a handful of small operators per
    # call however many partials are asked for (each costs 1-3 us of dispatch on CPU).
    columns, norms = _columns(tensors, kinds, defer_counts, references)
    n = len(tensors)
    if n == 1:
        matrix = torch.stack([col[0] for col in columns]).view(1, len(columns)).to(torch.float64)
    else:  # one column after the other: no Python loop over the cells of many small tensors
        matrix = torch.stack([_column(col) for col in columns], dim=1).to(torch.float64)
    if norms >= 0:
        matrix[:, norms].square_()  # squared in float64, which never overflows
    return matrix


def _columns(
    tensors: Sequence[torch.Tensor], kinds: Sequence[str], defer_counts: bool, references: Optional[torch.Tensor],
) -> tuple[list[Column], int]:
    """The partial columns of `kinds`, and the index of the one holding norms to square (-1: none)."""
    columns: list[Column] = []
    norms = -1  # the column holding norms that still need squaring (the `_foreach_norm` path)
    squares: Optional[Column] = None
    minmax = _minmax(tensors) if ("min" in kinds or "max" in kinds) else None
    moments = _moments(tensors) if "m2" in kinds else None
    for kind in kinds:
        if kind == "sumsq":
            col, are_norms = _sums_of_squares(tensors)
            norms = len(columns) if are_norms else -1
            squares = col
        elif kind == "sum":
            col = moments[0] if moments is not None else [_sum(t) for t in tensors]
        elif kind == "m2" and moments is not None:
            col = moments[1]
        elif kind == "min" and minmax is not None:
            col = minmax[0]
        elif kind == "max" and minmax is not None:
            col = minmax[1]
        elif kind == "ref_sumsq":
            if references is None:
                raise ValueError("update_ratio needs the parameters' sums of squares before the update")
            col = list(references.unbind())
        elif kind == "nonzero":
            col = [torch.count_nonzero(t).to(torch.float64) for t in tensors]  # one pass; NaN counts as nonzero
        elif defer_counts:  # finite, as a placeholder: any partial that is finite only when every element is
            col = squares if squares is not None else (moments[1] if moments is not None
                                                        else _sums_of_squares(tensors)[0])
        else:  # finite
            col = [_finite(t) for t in tensors]
        columns.append(col)
    return columns, norms


def _host_matrix(
    tensors: Sequence[torch.Tensor], kinds: Sequence[str], references: Optional[torch.Tensor],
) -> list[list[float]]:
    """`_partials(...).tolist()` for CPU tensors, in two operators after the reductions (a stack and one read).

    In a training step a small operator costs 10-20 us, not the 2 us of a warm loop (the
    model's own kernels evicted the dispatcher's code and data from the caches), so the
    cells are read as they are and made float64 and squared on the host: the values are
    the same bits (every partial converts to float64 exactly, and a float64 square is the
    same IEEE product in Python as in torch).
    """
    if len(tensors) == 1:
        row = _buffered_row(tensors[0], kinds)
        if row is not None:
            return [row]
    columns, norms = _columns(tensors, kinds, False, references)
    n, width = len(tensors), len(columns)
    if n == 1:  # torch.stack promotes mixed dtypes to the widest, exactly
        values = torch.stack([col[0] for col in columns]).tolist()
        rows = [values]
    elif width == 1:  # a step rule's l2_norm: the norms squared at once
        values = _column(columns[0]).tolist()
        return [[v * v] for v in values] if norms == 0 else [[v] for v in values]
    else:
        flat = torch.cat([_column(col) for col in columns]).tolist()  # column after column
        rows = [flat[i::n] for i in range(n)]
    if norms >= 0:
        for row in rows:
            row[norms] = row[norms] * row[norms]
    return rows


#: The partials `_buffered_row` computes, and their places in its row buffer (the count of nonzero
#: elements, an integer, is summed there or, by `count_nonzero`, read apart and put in its place on the host).
_BUFFERED = {"sumsq": 0, "sum": 1, "m2": 2, "min": 3, "max": 4, "nonzero": 5}


class RowPlan(NamedTuple):
    """What `host_row` runs for one `kinds`, and where each partial of the row is in its buffer."""
    minmax: bool
    sumsq: bool
    sum: bool
    m2: bool
    nonzero: bool
    at: tuple[int, ...]
    #: the place of `finite` in the row (-1: not asked for), and the places in the row of the
    #: partials that prove it (`_host_plan`'s)
    finite: int = -1
    a: int = 0
    b: int = 0
    #: a sum of squares was added to the row for the proof only (dropped from it)
    added: bool = False


@functools.lru_cache(maxsize=64)
def _row_plan(kinds: tuple[str, ...]) -> Optional[RowPlan]:
    """`_buffered_row`'s plan for `kinds`, computed once; None when it does not serve them."""
    if not _BUFFERED.keys() >= set(kinds):
        return None
    minmax, sumsq, m2 = "min" in kinds or "max" in kinds, "sumsq" in kinds, "m2" in kinds
    total = m2 or "sum" in kinds
    return RowPlan(minmax, sumsq, total, m2, "nonzero" in kinds, tuple(_BUFFERED[k] for k in kinds))


def row_plan(kinds: Sequence[str]) -> Optional[RowPlan]:
    """`host_row`'s plan for `kinds` (the count of finite elements too), found once (a hook's `Call` keeps it);
    None when the row buffer cannot serve them."""
    kinds = tuple(kinds)
    if "finite" not in kinds:
        return _row_plan(kinds)
    measured, a, b, col, added = _host_plan(kinds)
    plan = _row_plan(measured)
    return None if plan is None else plan._replace(finite=col, a=a, b=b, added=added)


def _buffered_row(t: torch.Tensor, kinds: Sequence[str]) -> Optional[list[float]]:
    """The row of one CPU tensor, each kernel writing its partial into a per-thread buffer (`out=`) read with
    one `tolist`; None where this does not serve (half types, a strided tensor, a partial it has not, an `m2`
    beyond the scratch buffer's one piece).

    No `stack` and no cast: in a training step one small operator costs 10-20 us, more than
    the reduction of a small tensor. The same kernels on the same data as `_columns` (`sum`,
    `x - mean` into the scratch buffer and its `dot`, `aminmax`, `dot`), so the same bits;
    the count of nonzero elements is an integer, exact either way (`count_nonzero`, or for
    a large tensor the sum of `x != 0` in `host_row`).
    """
    plan = _row_plan(tuple(kinds))
    return None if plan is None else host_row(t, plan)


def host_row(t: torch.Tensor, plan: RowPlan) -> Optional[list[float]]:
    """`host_partials([t], kinds)[0]` for one CPU tensor that does not require grad, with `row_plan(kinds)`
    found already; None where the row buffer does not serve `t` (then `host_partials` does).

    `_buffered_row`'s work, and for a plan with `finite` the count as `_host_rows` takes it
    (proved by the other partials, else counted), in one frame: a hook on a small tensor
    spends more on the calls between functions, in a step's cold caches, than on its
    reductions.
    """
    if t.dtype not in _DOT_DTYPES or not t.is_contiguous() or (plan.m2 and t.numel() > _SCRATCH_ELEMENTS):
        return None
    rows: Optional[dict[torch.dtype, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]] = getattr(_local, "rows", None)
    row, cells = (rows and rows.get(t.dtype)) or _row_buffer(t.dtype)
    n = t.numel()
    if plan.minmax:
        torch.aminmax(t, out=(cells[3], cells[4]))
    if plan.sumsq:
        flat = t.view(-1) if t.dim() != 1 else t
        torch.dot(flat, flat, out=cells[0])
    if plan.sum:  # `t` as it is, no `view`: the sum and the comparisons of a contiguous tensor are 1-D loops
        torch.sum(t, dim=None, out=cells[1])
        if plan.m2:  # as `_moments`: the deviations from the mean into the scratch, and their dot product
            torch.sub(t, cells[1], alpha=1.0 / n, out=_scratch_as(t))
            dev = _scratch(n, t.dtype)
            torch.dot(dev, dev, out=cells[2])
    compared = plan.nonzero and _COMPARE_MIN <= n <= min(_SCRATCH_ELEMENTS, _EXACT_FLOAT32)
    if compared:
        # `x != 0` as 1.0 and 0.0 into the scratch (after the deviations' dot, which is done with it), and its
        # sum into the count's cell: the nonzero elements, NaN and +-Inf among them as `count_nonzero` counts
        # them; every partial sum is an integer below 2**24, exact in float32. Two vectorized passes, read
        # with the row: faster than `count_nonzero`'s scalar loop and its own read (`_COMPARE_MIN`)
        torch.sum(torch.ne(t, _ZEROS[t.dtype], out=_scratch_as(t)), dim=None, out=cells[5])
    values = row.tolist()
    if plan.nonzero and not compared:
        values[5] = float(torch.count_nonzero(t))  # NaN counts as nonzero, as in `_columns`
    values = [values[i] for i in plan.at]
    if plan.finite < 0:
        return values
    isfinite = math.isfinite
    finite = float(t.numel()) if isfinite(values[plan.a]) and isfinite(values[plan.b]) else float(_finite(t))
    if plan.added:
        values.pop()  # the added sum of squares
    values.insert(plan.finite, finite)
    return values


#: From this many elements on, `host_row` counts the nonzero elements by comparison into the scratch and a sum:
#: every size. In a warm loop `count_nonzero` and its read cost about 1 us less below 4,096 float32 / 8,192
#: float64 elements (bench/zeros.py), but in a training step's cold caches the comparison wins there too (the
#: CNN's 640-element tensors, where-the-time-goes.md); the tests raise it to check the other way.
_COMPARE_MIN = 1
#: The zero `host_row` compares with, a 0-d tensor of the tensor's dtype: a Python 0 is wrapped and cast to a
#: tensor on every call (four more operators).
_ZEROS: Mapping[torch.dtype, torch.Tensor] = {dtype: torch.zeros((), dtype=dtype) for dtype in _DOT_DTYPES}


def _row_buffer(dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """This thread's row buffer for `dtype` and its cells (the last one the count of nonzero elements, where
    `host_row` sums it there)."""
    buffers: Optional[dict[torch.dtype, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]] = getattr(_local, "rows", None)
    if buffers is None:
        buffers = _local.rows = {}
    entry = buffers.get(dtype)
    if entry is None:
        # not an inference tensor, though the first call may come under inference_mode (Lightning's validation):
        # written in place by a later call outside it, an inference tensor would raise
        with torch.inference_mode(False):
            row = torch.empty(len(_BUFFERED), dtype=dtype)
            entry = buffers[dtype] = (row, tuple(row.unbind()))
    return entry


#: Below this many elements (in all) the count (two small kernels) costs less than reading the
#: partials back and building the matrix anew on the host (measured: about 5 us either way at 16k).
_HOST_MIN = 1 << 14
#: Partials whose finite value proves every element finite, best first (see the module docstring).
_PROOFS: tuple[tuple[str, ...], ...] = (("min", "max"), ("sumsq",), ("m2",), ("sum",))


def _counted_on_host(
    tensors: Sequence[torch.Tensor], kinds: Sequence[str], defer_counts: bool, references: Optional[torch.Tensor],
) -> torch.Tensor:
    return torch.tensor(_host_rows(tensors, kinds, references), dtype=torch.float64)


#: The per-device rule (module docstring): CPU tensors are read inside the hook. False makes CPU
#: tensors take CUDA's path (nothing read before the readback); the tests use it to check that path.
_READ_ON_CPU = True


def reads_at_once(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a hook may read the partials of `tensors` at once: on CPU (no sync there), never on CUDA."""
    if len(tensors) == 1:  # a hook's one tensor
        return _READ_ON_CPU and tensors[0].is_cpu
    return _READ_ON_CPU and all(t.is_cpu for t in tensors)


def host_partials(
    tensors: Sequence[torch.Tensor], kinds: Sequence[str], references: Optional[torch.Tensor] = None,
) -> list[list[float]]:
    """`tensor_partials` of CPU tensors, read at once: the rows as host floats (on CPU a read is no sync).

    The count of finite elements is taken only where the other partials do not prove it
    (see the module docstring); the rows are what `tensor_partials(...).tolist()` gives.
    """
    if not kinds:
        return [[] for _ in tensors]
    if any(t.requires_grad for t in tensors):
        with torch.no_grad():
            return _host_rows(tensors, kinds, references)
    return _host_rows(tensors, kinds, references)


def _host_rows(
    tensors: Sequence[torch.Tensor], kinds: Sequence[str], references: Optional[torch.Tensor],
) -> list[list[float]]:
    """The partial rows of CPU tensors, the finite count taken only where the other partials do not prove it.

    The other partials are computed and read first; a row whose proof (`_PROOFS`: min and
    max, else a sum of squares, m2 or sum; a sum of squares, one `dot`, is added when none
    is asked for) is finite counts `numel` finite elements, any other row is counted. The
    count is exact either way.
    """
    if "finite" not in kinds:
        return _host_matrix(tensors, kinds, references)
    measured, a, b, col, added = _host_plan(tuple(kinds))
    if len(tensors) >= _MANY:  # many tensors: one check for all, on the matrix
        matrix = _partials(tensors, measured, False, references)
        rows = matrix.tolist()
        every = bool(torch.isfinite(matrix[:, sorted({a, b})]).all())
    else:  # a few: the rows read, checked on the host (no operator)
        rows = _host_matrix(tensors, measured, references)
        every = False
    isfinite = math.isfinite
    for row, t in zip(rows, tensors):
        finite = float(t.numel()) if every or (isfinite(row[a]) and isfinite(row[b])) else float(_finite(t))
        if added:
            row.pop()  # the added sum of squares
        row.insert(col, finite)
    return rows


@functools.lru_cache(maxsize=64)
def _host_plan(kinds: tuple[str, ...]) -> tuple[tuple[str, ...], int, int, int, bool]:
    """For `_host_rows`, once per `kinds`: the partials measured, the places of its proof among them (min
    and max, or one partial twice), where `finite` goes in a row, and whether a sum of squares was added."""
    others = tuple(k for k in kinds if k != "finite")
    proof = next((p for p in _PROOFS if all(k in others for k in p)), None)
    measured = others if proof is not None else (*others, "sumsq")
    at = [measured.index(k) for k in (proof or ("sumsq",))]
    return measured, at[0], at[-1], kinds.index("finite"), proof is None


def resolve_counts(rows: list[list[float]], tensors: Sequence[torch.Tensor], kinds: Sequence[str]) -> None:
    """Replace the `finite` placeholders of `tensor_partials(..., defer_counts=True)` in `rows`, in place.

    A finite placeholder means every element is finite: the count is `numel`, no work.
    Only the tensors whose placeholder is NaN or Inf are counted, with one read per device:
    the normal step costs nothing here.
    """
    if "finite" not in kinds:
        return
    col = list(kinds).index("finite")
    pending: dict[torch.device, list[int]] = {}
    for i, (row, t) in enumerate(zip(rows, tensors)):
        if math.isfinite(row[col]):
            row[col] = float(t.numel())
        else:
            pending.setdefault(t.device, []).append(i)
    with torch.no_grad():
        for indices in pending.values():
            counts = torch.stack([_finite(tensors[i]).double() for i in indices]).tolist()
            for i, count in zip(indices, counts):
                rows[i][col] = count


#: A column of partials: one 0-d tensor per tensor, or a vector of them.
Column = Union[Sequence[torch.Tensor], torch.Tensor]


def _column(col: Column) -> torch.Tensor:
    return col if isinstance(col, torch.Tensor) else torch.stack(list(col))


#: Many small CPU tensors of one dtype (a step rule over thousands of small layers): their norms by
#: shape, as rows of one stacked matrix, below this many elements each and from this many tensors on.
_SMALL_ELEMENTS = 1 << 12
_MANY = 64


def _sums_of_squares(tensors: Sequence[torch.Tensor]) -> tuple[Column, bool]:
    """Per tensor its sum of squares (False), or its norm (True) where `_foreach_norm` serves better.

    A single CPU tensor (a forward or backward hook's usual target) takes MKL's `dot`; a
    list (a step rule's parameters) takes one `_foreach_norm` call, whose per-tensor
    dispatch is in C++ (about 2.5 us a tensor against 4 for a Python loop of dots). On CPU
    `_foreach_norm` runs one norm kernel per tensor, about 9 us each for tiny ones: from
    `_MANY` small tensors of one dtype on, those of one shape are stacked (one copy, in C++)
    and normed along their rows, one kernel per shape (`_grouped_norms`).
    """
    if len(tensors) == 1:
        t = tensors[0]
        if t.is_cpu and t.dtype in _DOT_DTYPES and t.is_contiguous():
            flat = t.view(-1) if t.dim() != 1 else t
            return [torch.dot(flat, flat)], False
    if len(tensors) >= _MANY and tensors[0].dtype in _DOT_DTYPES:
        grouped = _grouped_norms(tensors)
        if grouped is not None:
            return grouped, True
    wide = [t.dtype in _DOT_DTYPES for t in tensors]
    if all(wide):
        return torch._foreach_norm(list(tensors), 2), True
    if not any(wide):  # half types: accumulate in float32
        return torch._foreach_norm(list(tensors), 2, dtype=torch.float32), True
    return [torch.linalg.vector_norm(t, dtype=None if w else torch.float32) for t, w in zip(tensors, wide)], True


def _grouped_norms(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The norms of many CPU tensors of one float32/float64 dtype as a vector, small ones grouped by shape;
    None when fewer than `_MANY` are small (then `_foreach_norm` is as fast)."""
    dtype = tensors[0].dtype
    shapes: dict[torch.Size, list[int]] = {}
    rest: list[int] = []
    for i, t in enumerate(tensors):
        if not t.is_cpu or t.dtype != dtype:
            return None
        if t.numel() <= _SMALL_ELEMENTS:
            shapes.setdefault(t.shape, []).append(i)
        else:
            rest.append(i)
    if len(tensors) - len(rest) < _MANY:
        return None
    out = torch.empty(len(tensors), dtype=dtype)
    for indices in shapes.values():
        rows = torch.stack([tensors[i] for i in indices]).view(len(indices), -1)
        out[torch.tensor(indices)] = torch.linalg.vector_norm(rows, dim=1)
    if rest:
        out[torch.tensor(rest)] = torch.stack(torch._foreach_norm([tensors[i] for i in rest], 2))
    return out


def _sum(t: torch.Tensor) -> torch.Tensor:
    """The sum, accumulated like `torch.sum` (float32 for float32 and half types, float64 for float64)."""
    return t.sum() if t.dtype in _DOT_DTYPES else t.sum(dtype=torch.float32)


def _minmax(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    pairs = [torch.aminmax(t) for t in tensors]
    return [p.min for p in pairs], [p.max for p in pairs]


def _moments(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per tensor (sum, m2): never the sum of squares minus n * mean**2, which cancels.

    On CUDA one `var_mean` (Welford, one pass). On CPU, where `var_mean` is a scalar loop
    (about 40x slower than a sum), two vectorized passes: the sum, then the squares of the
    deviations from the mean as a dot product, the deviations going through the scratch.
    """
    sums, m2s = [], []
    for t in tensors:
        x = t if t.dtype in _DOT_DTYPES else t.float()
        n = x.numel()
        if not x.is_cpu:
            var, mean = torch.var_mean(x, correction=0)
            sums.append(mean * n)
            m2s.append(var * n)
            continue
        total = x.sum()
        m2: Optional[torch.Tensor] = None
        for part in _chunks(x):
            dev = torch.sub(part, total, alpha=1.0 / n, out=_scratch(part.numel(), x.dtype))  # x - mean
            sq = torch.dot(dev, dev)
            m2 = sq if m2 is None else m2.add_(sq)
        assert m2 is not None  # tensors are never empty
        sums.append(total)
        m2s.append(m2)
    return sums, m2s


#: A 0-d CPU tensor, which torch treats as a scalar on every device.
_ONE = torch.ones(())


def _finite(t: torch.Tensor) -> torch.Tensor:
    """The number of finite elements of `t`, exactly, in one element-wise kernel and a sum.

    `1 + 0 * x` (one `add` with `alpha=0`) is 1 for finite x and NaN for NaN and +-Inf,
    since `0 * inf` is NaN; the NaN-skipping sum counts the ones.
    """
    n = t.numel()
    acc = torch.float64 if t.dtype == torch.float64 or n > _EXACT_FLOAT32 else torch.float32
    if not t.is_cpu or n < _SCRATCH_MIN:
        return torch.nansum(torch.add(_ONE, t, alpha=0), dtype=acc)
    if n <= _SCRATCH_ELEMENTS and t.is_contiguous():  # the common case, without the chunk loop
        return torch.nansum(torch.add(_ONE, t.view(-1), alpha=0, out=_scratch(n, t.dtype)), dtype=acc)
    total: Optional[torch.Tensor] = None
    for part in _chunks(t):
        count = torch.nansum(torch.add(_ONE, part, alpha=0, out=_scratch(part.numel(), part.dtype)), dtype=acc)
        total = count if total is None else total.add_(count)
    assert total is not None  # tensors are never empty
    return total


# -- scratch memory ------------------------------------------------------------------------
# An element-wise intermediate (`1 + 0 * x`, `x - mean`) as big as a target tensor
# is a fresh multi-megabyte allocation on every call; on CPU that means page faults, which
# measured at twice the cost of the arithmetic (bench/run.py, GPT activations). So on CPU
# the intermediates go to a buffer reused per thread and dtype, and tensors larger than
# `_SCRATCH_ELEMENTS` are processed in chunks of that size (16 MiB of float32), which
# bounds the memory kept. CUDA's caching allocator makes allocation cheap there, and a
# shared buffer would race across streams, so CUDA tensors keep fresh intermediates.

_SCRATCH_ELEMENTS = 1 << 22
#: Below this many elements an allocation is cheap (glibc's heap, no page faults).
_SCRATCH_MIN = 1 << 15
_local = threading.local()


def _chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """`t` as 1-D pieces of at most `_SCRATCH_ELEMENTS` on CPU (views when `t` is contiguous)."""
    if not t.is_cpu:
        yield t
        return
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _SCRATCH_ELEMENTS):
        yield flat[start:start + _SCRATCH_ELEMENTS]


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU buffer of `numel` elements, owned by this thread and reused by the next call.

    The view of each size is kept too (a slice is one more operator per call, 10-20 us in a
    training step), and of each shape `_scratch_as` asked for, at most `_VIEWS` in all, dropped
    with the buffer when it grows.
    """
    views: Optional[dict[tuple[torch.dtype, Union[int, torch.Size]], torch.Tensor]] = getattr(_local, "views", None)
    if views is None:
        views = _local.views = {}
    view = views.get((dtype, numel))
    if view is not None:
        return view
    buffers: Optional[dict[torch.dtype, torch.Tensor]] = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(dtype)
    with torch.inference_mode(False):  # a first call under inference_mode must not make them inference tensors
        if buf is None or buf.numel() < numel:
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
            for key in [k for k in views if k[0] == dtype]:
                del views[key]
        if len(views) >= _VIEWS:
            views.clear()
        view = views[(dtype, numel)] = buf[:numel]
    return view


def _scratch_as(t: torch.Tensor) -> torch.Tensor:
    """`_scratch(t.numel(), t.dtype)` in `t`'s shape, kept per shape beside the sizes' views (an `out=` of
    another shape would be resized, and a `view` per call is one more operator)."""
    views: Optional[dict[tuple[torch.dtype, Union[int, torch.Size]], torch.Tensor]] = getattr(_local, "views", None)
    view = views.get((t.dtype, t.shape)) if views is not None else None
    if view is None:
        flat = _scratch(t.numel(), t.dtype)
        views = _local.views
        if len(views) >= _VIEWS:
            views.clear()
        with torch.inference_mode(False):  # made outside inference_mode, as `_scratch`'s views are
            view = views[(t.dtype, t.shape)] = flat.view(t.shape)
    return view


#: The most scratch views of distinct sizes a thread keeps (a model has a few sizes of target tensors).
_VIEWS = 64


def combine(
    rows: Sequence[Sequence[float]], numels: Sequence[int], kinds: Sequence[str]
) -> dict[str, float]:
    """Merge partial rows (of several tensors, calls or micro-batches) into one set of partials.

    `m2` (the sum of squared deviations from the mean) merges with Chan et al.'s
    parallel formula, which needs each row's element count.
    """
    if len(rows) == 1:  # one tensor, one call: the partials are already merged
        return dict(zip(kinds, rows[0]))
    merged: dict[str, float] = {}
    for i, kind in enumerate(kinds):
        values = [row[i] for row in rows]
        if kind == "m2":
            merged[kind] = _merge_m2(values, [row[kinds.index("sum")] for row in rows], numels)
        elif kind == "min":
            merged[kind] = _nan_aware(min, values)
        elif kind == "max":
            merged[kind] = _nan_aware(max, values)
        else:
            try:
                merged[kind] = math.fsum(values)
            except (ValueError, OverflowError):
                merged[kind] = exact_sum(values)
    return merged


def exact_sum(values: Sequence[float]) -> float:
    """`math.fsum`, and what IEEE addition gives where fsum raises instead of answering.

    +inf and -inf together: NaN (fsum raises ValueError), as torch's float64 sum of the
    elements gives. An intermediate overflow of finite values (fsum raises OverflowError):
    the exact sum of the values scaled by 2**-64, scaled back, which is +-inf only where
    the exact sum overflows (and exact unless a term is subnormal once scaled). Before, a
    mean of a module whose weight's gradient summed to +inf and its bias's to -inf raised
    out of the step's read-back and out of every scrape until the next step.
    """
    try:
        return math.fsum(values)
    except ValueError:
        return math.nan
    except OverflowError:
        try:
            return math.fsum([v * _DOWN for v in values]) * _UP
        except ValueError:  # an overflow, then +inf and -inf
            return math.nan


_DOWN, _UP = 2.0 ** -64, 2.0 ** 64


#: the partials that merge by an exact sum (`exact_sum`, as `combine` merges them): all but m2, min and max
_SUMMED = frozenset(PARTIALS) - {"m2", "min", "max"}


def summed(kinds: Sequence[str]) -> bool:
    """Whether `combine` merges every partial of `kinds` by a sum (`combine_sums` serves them)."""
    return bool(kinds) and _SUMMED.issuperset(kinds)


def combine_sums(
    rows: Sequence[Sequence[float]], picks: Sequence[tuple[Callable[[Sequence[float]], Any], bool]]
) -> list[tuple[float, ...]]:
    """`combine` of many groups of rows whose partials are all sums (`summed`), column by column.

    `picks` gives each group's rows: `operator.itemgetter` of their indices, and whether
    there is one. Each group's merged row (in `kinds`' order) is what `combine` gives
    it: a lone row's values as they are, several rows' `exact_sum` in row order; only
    the per-group frames and dicts of `combine` are gone (a scrape finishing 5,000
    groups).
    """
    columns = list(zip(*rows))
    fsum = math.fsum
    try:
        merged = [[pick(column) if one else fsum(pick(column)) for pick, one in picks] for column in columns]
    except (ValueError, OverflowError):  # a sum fsum cannot take (+inf and -inf, an overflow): as combine takes it
        merged = [[pick(column) if one else exact_sum(pick(column)) for pick, one in picks] for column in columns]
    return list(zip(*merged))


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
    return {stat: _FINISH[stat](partials, numel) for stat in stats}


def _sumsq(p: Mapping[str, float], n: int) -> float:
    if "sumsq" in p:
        return p["sumsq"]
    return p["m2"] + p["sum"] * p["sum"] / n if n else 0.0  # see partials_for


def _abs_max(p: Mapping[str, float], n: int) -> float:
    return max(abs(p["min"]), abs(p["max"])) if not math.isnan(p["min"] + p["max"]) else math.nan


def _std(p: Mapping[str, float], n: int) -> float:
    """Unbiased, like torch.std."""
    if n < 2:
        return math.nan
    return math.sqrt(max(p["m2"], 0.0) / (n - 1)) if not math.isnan(p["m2"]) else math.nan


#: Each statistic from its merged partials and element count: looked up once per statistic, not
#: found along a chain of tests (the read-back finishes every group of every pass at every step).
_FINISH: Mapping[str, Callable[[Mapping[str, float], int], float]] = {
    "numel": lambda p, n: float(n),
    "nonfinite": lambda p, n: float(n) - p["finite"],
    "update_ratio": lambda p, n: _ratio(math.sqrt(_sumsq(p, n)), math.sqrt(p["ref_sumsq"])),
    "l2_norm": lambda p, n: math.sqrt(_sumsq(p, n)),
    "min": lambda p, n: p["min"],
    "max": lambda p, n: p["max"],
    "abs_max": _abs_max,
    "mean": lambda p, n: p["sum"] / n if n else math.nan,
    "rms": lambda p, n: math.sqrt(_sumsq(p, n) / n) if n else math.nan,
    "zero_fraction": lambda p, n: (n - p["nonzero"]) / n if n else math.nan,
    "std": _std,
}


def _ratio(update: float, weight: float) -> float:
    """`update / weight` as IEEE division has it: a zero weight gives inf (nan for a zero update too)."""
    if weight == 0.0:
        return math.nan if update == 0.0 or math.isnan(update) else math.inf
    return update / weight
