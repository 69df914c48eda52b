"""Check `hookpolicy.engine.stats` and `clip_norm` against float64 PyTorch references (a few seconds).

    python bench/check_stats.py

The speed-ups in stats.py (dot products, the `1 + 0 * x` count of finite elements, the
scratch buffer and its chunks, deferred counts) change how statistics are computed, not
what they are: this runs every statistic over float32/float64/bfloat16/float16 tensors,
strided ones, ones with NaN and +-Inf, lists of tensors combined per rule, and the chunked
paths (with the chunk size made tiny), and exits non-zero on any mismatch. It is a script,
not a test, only because bench/ is where it was written: it belongs in tests/test_stats.py.
"""

from __future__ import annotations

import math
import sys

import torch

from hookpolicy.engine import stats
from hookpolicy.engine.actions import clip_norm
from hookpolicy.engine.stats import combine, finish, partials_for, resolve_counts, tensor_partials

ALL = ("l2_norm", "mean", "std", "min", "max", "abs_max", "rms", "zero_fraction", "nonfinite", "numel")
SETS = (ALL, ("l2_norm", "abs_max", "nonfinite"), ("nonfinite",), ("std",), ("mean",), ("l2_norm", "nonfinite"),
        ("abs_max",), ("zero_fraction", "numel"))


def reference(tensors: list[torch.Tensor]) -> dict[str, float]:
    x = torch.cat([t.double().flatten() for t in tensors])
    finite = torch.isfinite(x)
    return {
        "l2_norm": torch.linalg.vector_norm(x).item(), "mean": x.mean().item(),
        "std": x.std().item() if x.numel() > 1 else math.nan, "min": x.min().item(), "max": x.max().item(),
        "abs_max": x.abs().max().item(), "rms": x.pow(2).mean().sqrt().item(),
        "zero_fraction": (x == 0).double().mean().item(), "nonfinite": float((~finite).sum().item()),
        "numel": float(x.numel()),
    }


def computed(tensors: list[torch.Tensor], wanted: tuple[str, ...], defer: bool = False) -> dict[str, float]:
    kinds = partials_for(wanted)
    matrix = tensor_partials(tensors, kinds, defer_counts=defer)
    assert matrix.dtype == torch.float64 and tuple(matrix.shape) == (len(tensors), len(kinds))
    rows = matrix.tolist()
    if defer:
        resolve_counts(rows, tensors, kinds)
    n = sum(t.numel() for t in tensors)
    return finish(combine(rows, [t.numel() for t in tensors], kinds), n, wanted)


def agrees(got: float, want: float, stat: str, rel: float, any_nonfinite: bool) -> bool:
    if stat in ("nonfinite", "numel", "zero_fraction"):
        return got == want if stat != "zero_fraction" else abs(got - want) < 1e-12
    if any_nonfinite and stat not in ("min", "max", "abs_max"):
        return math.isnan(got) or math.isinf(got)  # NaN and Inf propagate
    if math.isnan(want) or math.isinf(want):
        return (math.isnan(got) and math.isnan(want)) or got == want
    return abs(got - want) <= rel * max(abs(want), 1e-6)


def cases() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out: list[list[torch.Tensor]] = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for shape in ((7,), (33, 65), (2, 3, 4), (1,), (300, 257)):
            t = (torch.randn(*shape, generator=g) * 3 + 1).to(dtype)
            out += [[t], [t, (torch.randn(5, generator=g) * 2).to(dtype)]]
    base = torch.randn(40, 30, generator=g)
    out += [[base.t()], [base[:, ::2]], [base.t(), torch.randn(9, generator=g, dtype=torch.float64)]]
    zeros = torch.randn(100, generator=g)
    zeros[::3] = 0
    out.append([zeros])
    bad = torch.randn(50, generator=g)
    bad[3], bad[7], bad[9] = float("nan"), float("inf"), -float("inf")
    only_inf = torch.randn(50, generator=g)
    only_inf[2] = float("inf")
    out += [[bad], [bad, torch.randn(4, generator=g)], [only_inf], [bad.half()], [bad.t() if bad.dim() > 1 else bad]]
    return out


def main() -> int:
    failures = 0
    for chunked in (False, True):
        if chunked:  # the scratch-buffer chunks, with chunks of 1,000 elements
            stats._SCRATCH_ELEMENTS, stats._SCRATCH_MIN = 1000, 10
        for tensors in cases():
            want = reference(tensors)
            wide = tensors[0].dtype in (torch.float32, torch.float64)
            any_nonfinite = any(not bool(torch.isfinite(t).all()) for t in tensors)
            for wanted in SETS:
                for defer in (False, True):
                    got = computed(tensors, wanted, defer)
                    for stat in wanted:
                        if not agrees(got[stat], want[stat], stat, 1e-5 if wide else 1e-2, any_nonfinite):
                            failures += 1
                            print(f"MISMATCH chunked={chunked} defer={defer} {tensors[0].dtype} "
                                  f"{[tuple(t.shape) for t in tensors]} {stat}: {got[stat]} != {want[stat]}")
    # exact counts beyond float32's 2**24
    big = torch.zeros((1 << 24) + 5)
    big[-1], big[0] = float("nan"), float("inf")
    for defer in (False, True):
        got = computed([big], ("nonfinite", "numel"), defer)
        if got["nonfinite"] != 2.0:
            failures += 1
            print(f"MISMATCH big tensor nonfinite {got['nonfinite']} != 2 (defer={defer})")
    # clip_norm: the same as clip_grad_norm_ (in place) and differentiable out of place
    g = torch.Generator().manual_seed(1)
    for norm_type in (2.0, float("inf")):
        grads = [torch.randn(5, 3, generator=g) for _ in range(3)]
        params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
        for p, t in zip(params, grads):
            p.grad = t.clone()
        torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type)
        ours = [t.clone() for t in grads]
        clip_norm(ours, 0.5, norm_type, [[0, 1, 2]], inplace=True)
        if not all(p.grad is not None and torch.equal(a, p.grad) for a, p in zip(ours, params)):
            failures += 1
            print(f"MISMATCH clip_norm != clip_grad_norm_ (norm_type={norm_type})")
        leaves = [t.clone().requires_grad_() for t in grads]
        clipped = clip_norm([t * 1 for t in leaves], 0.5, norm_type, [[0], [1, 2]], inplace=False)
        torch.stack([c.sum() for c in clipped]).sum().backward()  # type: ignore[no-untyped-call]
        if any(t.grad is None for t in leaves):
            failures += 1
            print("MISMATCH out-of-place clip_norm lost the autograd graph")
    print("stats and clip_norm agree with the references" if not failures else f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
