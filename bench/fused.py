"""Lever 2 of issue 36 on a CPU: one compiled pass per tensor against hookpolicy's eager row.

    python bench/fused.py                  # 2 torch threads, shapes specialized
    python bench/fused.py --dynamic        # one kernel for every size (dynamic shapes)
    python bench/fused.py --threads 1

For each size, a float32 tensor's partials are taken two ways and read to the host, as a
hook on a CPU tensor reads them:

- hookpolicy's row (`stats.host_row`, what a hook runs): `aminmax` and `dot` for
  `monitor.yaml`'s `l2_norm, abs_max`; `aminmax`, `dot`, `sum`, the deviations' `sub` and
  `dot` and the nonzero count for the seed's six statistics; then the row's one `tolist`;
- the same partials as one `torch.compile`d function (inductor's C++ kernel on a CPU), its
  results stacked into one tensor in the compiled graph and read with one `tolist`.

Each is timed warm (the same tensor again and again) and cold (a 32 MiB buffer written
between two calls, as a training step's other kernels evict the caches between two hooks),
median microseconds a call. Before timing, the compiled sum of squares is compared with
`dot`'s: a different reduction order gives other low bits, so the compiled pass could only
replace the row if it were faster, and the issue's "no statistic may change" would still
rule it out for the statistics the tests pin. Without a C++ compiler `torch.compile` fails
on a CPU; this says so and stops.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hookpolicy.engine.measure import stats  # noqa: E402

SIZES = (640, 16384, 49920, 98304, 294912, 393216, 1 << 20)
MONITOR = ("l2_norm", "abs_max")
SEED_SIX = ("l2_norm", "mean", "std", "max", "min", "zero_fraction")


def monitor_pass(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.dot(x, x), x.amin(), x.amax()])


def seed_pass(x: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    dev = x - total / x.numel()
    return torch.stack([torch.dot(x, x), total, torch.dot(dev, dev), x.amin(), x.amax(), (x != 0).sum().to(x.dtype)])


def median_us(f: Callable[[], object], cold: bool, calls: int, evict: torch.Tensor) -> float:
    for _ in range(10):
        f()
    times = []
    for _ in range(calls):
        if cold:
            evict.fill_(1.0)
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dynamic", action="store_true", help="compile once for every size (dynamic shapes)")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per cell")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    evict = torch.empty(8 << 20)
    passes = []
    for name, fn, kinds in (("monitor.yaml's l2_norm, abs_max", monitor_pass, MONITOR),
                            ("the seed's six", seed_pass, SEED_SIX)):
        compiled = torch.compile(fn, dynamic=args.dynamic, fullgraph=True)
        start = time.perf_counter()
        try:
            compiled(torch.randn(SIZES[0])).tolist()
        except Exception as exc:  # noqa: BLE001 - no C++ compiler, say so
            print(f"torch.compile failed on this machine ({type(exc).__name__}: {exc}); lever 2 needs inductor's "
                  "C++ compiler on a CPU")
            return
        print(f"{name}: first compile {time.perf_counter() - start:.1f} s", flush=True)
        plan = stats.row_plan(stats.partials_for(kinds))
        assert plan is not None
        passes.append((name, compiled, plan))
    print(f"torch {torch.__version__}, {args.threads} threads, dynamic={args.dynamic}, load "
          f"{os.getloadavg()[0]:.2f}; median us a call (with its read)", flush=True)
    print(f"{'pass':34} {'elements':>9} {'warm: row':>10} {'compiled':>9} {'cold: row':>10} {'compiled':>9} "
          f"{'sumsq rel. diff':>16}")
    for name, compiled, plan in passes:
        for n in SIZES:
            x = torch.randn(n, generator=torch.Generator().manual_seed(n))
            row = stats.host_row(x, plan)
            assert row is not None
            diff = abs(compiled(x).tolist()[0] - float(torch.dot(x, x))) / float(torch.dot(x, x))
            cells = [median_us(f, cold, args.calls, evict) for cold in (False, True)
                     for f in (lambda: stats.host_row(x, plan), lambda: compiled(x).tolist())]
            print(f"{name:34} {n:>9,} {cells[0]:>10.1f} {cells[1]:>9.1f} {cells[2]:>10.1f} {cells[3]:>9.1f} "
                  f"{diff:>16.1e}", flush=True)


if __name__ == "__main__":
    main()
