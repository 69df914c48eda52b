"""The count of nonzero elements of one CPU tensor, per size and dtype: the ways `host_row` could take it.

    python bench/zeros.py                 # 1 torch thread (CPU time), then 2 (wall time)
    python bench/zeros.py --threads 2

Each way leaves the count where the hook reads it: `count_nonzero` and the NaN-skipping sum
of `x / x` (session 5's path for large tensors proved finite) read it with their own `item`;
`x != 0` written as 1.0 and 0.0 into the scratch and summed (or `dot`-ted) into the row
buffer's cell is read with the row's one `tolist`, so it has no read of its own. Warm loops,
best of 7. A training step's cold caches add 10-20 us an operator, and there the comparison won at
the smallest sizes too, where this warm loop has `count_nonzero` ahead by about 1 us
(`stats._COMPARE_MIN`). Every way's count is checked against `count_nonzero` before it is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Callable

import torch

SIZES = (640, 1024, 4096, 8192, 16384, 65536, 262144, 393216, 1 << 20)


def best_us(f: Callable[[], object], reps: int, clock: Callable[[], int]) -> float:
    for _ in range(3):
        f()
    best = float("inf")
    for _ in range(7):
        start = clock()
        for _ in range(reps):
            f()
        best = min(best, (clock() - start) / reps / 1e3)
    return best


def ways(x: torch.Tensor) -> dict[str, tuple[Callable[[], object], Callable[[], float]]]:
    """Per way: the call timed, and how its count is read after it (for the check)."""
    n, dtype = x.numel(), x.dtype
    scratch = torch.empty(n, dtype=dtype)
    cell = torch.empty(6, dtype=dtype).unbind()[5]  # the count's cell of the row buffer
    zero = torch.zeros((), dtype=dtype)
    last: list[float] = [math.nan]

    def read_alone(count: Callable[[], float]) -> Callable[[], object]:
        return lambda: last.__setitem__(0, count())

    return {
        "count_nonzero+item": (read_alone(lambda: float(torch.count_nonzero(x))), lambda: last[0]),
        "x/x+nansum+item": (read_alone(lambda: float(torch.nansum(torch.div(x, x, out=scratch)))), lambda: last[0]),
        "ne+sum": (lambda: torch.sum(torch.ne(x, zero, out=scratch), dim=None, out=cell), lambda: float(cell)),
        "ne+dot": (lambda: torch.dot(torch.ne(x, zero, out=scratch), scratch, out=cell), lambda: float(cell)),
        "ne(0)+sum": (lambda: torch.sum(torch.ne(x, 0, out=scratch), dim=None, out=cell), lambda: float(cell)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; microseconds a call, best of 7")
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock = time.thread_time_ns if threads == 1 else time.perf_counter_ns
        print(f"\n{threads} thread(s), {'CPU' if threads == 1 else 'wall'} time")
        for dtype in (torch.float32, torch.float64):
            g = torch.Generator().manual_seed(0)
            for n in SIZES:
                x = torch.randn(n, generator=g, dtype=dtype)
                x[::7] = 0.0
                want = float(torch.count_nonzero(x))
                timed = {}
                for name, (call, read) in ways(x).items():
                    call()
                    assert read() == want, (name, n, dtype)
                    timed[name] = best_us(call, max(50, 2_000_000 // n), clock)
                fastest = min(timed, key=lambda k: timed[k])
                print(f"{str(dtype)[6:]:8} {n:>9,}  " + "  ".join(f"{k} {v:6.1f}" for k, v in timed.items())
                      + f"  -> {fastest}", flush=True)


if __name__ == "__main__":
    main()
