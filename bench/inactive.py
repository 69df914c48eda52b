"""What an inactive step of `monitor-every10.yaml` costs, resolved below the quick bench's noise (issue 36.5).

    python bench/inactive.py [--workload nanogpt] [--rounds 300] [--threads 1] [--against DIR]

`bench/run.py --quick` times 40 steps per variant at 2 torch threads: its 95% interval on
a small model's inactive-step ratio is about +-10%, too wide to tell 1.00x from 1.05x.
Here three copies of one model train in turns, in one process: the floor, a second floor
(the A/A pair: how far two identical loops differ, the resolution), and the same loop under
`monitor-every10.yaml`. A step is timed in CPU time of the training thread at one torch
thread (`time.thread_time`: preemption does not count), or in wall time with `--threads 2`
(`thread_time` would miss the second thread's work there). Printed: the medians over the
floor's, split into the policy's active and inactive steps, and the inactive ones by their
place after the active step (what an active step leaves behind would show in the first
places), the Python calls per inactive step inside hookpolicy's own code (`cProfile`
counts, which do not depend on the load) and the load average. With `--against DIR` the
hookpolicy package of another tree (a copy of main, say) trains a fourth copy under the same
policy, in the same turns: the two trees' steps side by side, whole steps timed, so a hook
that runs no Python (which `inside_cpu.py --entries` cannot time) counts too.

glibc's allocator gives the activations' memory back to the kernel and faults it in again
at the next step (hundreds of minor page faults a step, a different number in each copy of
the loop); for sub-percent comparisons fix its thresholds (bench/where-the-time-goes.md):

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824 \
        python bench/inactive.py
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import WORKLOADS  # noqa: E402
from timing import other_tree  # noqa: E402
from variants import POLICIES, Variant, build_variants  # noqa: E402


def against(package: types.ModuleType, like: Variant, workload: str) -> Variant:
    """`like`'s loop (a floor's) on a copy of its model under `monitor-every10.yaml` attached by `package`."""
    assert like.model is not None
    model = copy.deepcopy(like.model)
    wl = WORKLOADS[workload]
    x, y = wl.batch(torch.Generator().manual_seed(0), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    attached = package.load(POLICIES / "monitor-every10.yaml").attach(model, registry=CollectorRegistry())

    def step() -> None:
        wl.loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Variant("against", "the other tree", step, attached.remove, lambda: attached.step % 10 == 0,
                   attached, model)


def hookpolicy_calls(v: Variant, steps: int) -> tuple[float, float]:
    """Python calls per inactive step: into hookpolicy's own functions, and in all (the loop's included)."""
    profile = cProfile.Profile()
    done = 0
    while done < steps:
        if v.active is not None and v.active():
            v.step()
            continue
        profile.enable()
        v.step()
        profile.disable()
        done += 1
    ours = sum(nc for (path, _, _), (_, nc, _, _, _) in pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
               if f"{os.sep}hookpolicy{os.sep}" in path)
    return ours / steps, pstats.Stats(profile).total_calls / steps  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="nanogpt", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", metavar="DIR", help="also the hookpolicy of the tree DIR, in the same turns")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    before = os.getloadavg()
    floor, twin, hp = build_variants(WORKLOADS[args.workload], torch.device("cpu"), ["floor", "floor", "hp10"])
    assert hp.active is not None
    order = [floor, twin, hp]
    times: dict[str, list[float]] = {"floor": [], "floor, again": [], "inactive": [], "active": []}
    other = None
    if args.against is not None:
        other = against(other_tree(args.against), floor, args.workload)
        order.append(other)
        times.update({"against inactive": [], "against active": []})
    for _ in range(5):
        for v in order:
            v.step()
    places: dict[int, list[float]] = {}
    for r in range(args.rounds):
        for v in order[r % len(order):] + order[:r % len(order)]:
            place = v.attached.step % 10 if v.attached is not None else -1
            start = clock()
            v.step()
            spent = clock() - start
            if v is hp:
                times["active" if place == 0 else "inactive"].append(spent)
                places.setdefault(place, []).append(spent)
            elif v is other:
                times["against active" if place == 0 else "against inactive"].append(spent)
            else:
                times["floor" if v is floor else "floor, again"].append(spent)
    base = statistics.median(times["floor"])
    kind = "CPU time, 1 thread" if args.threads == 1 else f"wall time, {args.threads} threads"
    print(f"{args.workload}, {args.rounds} rounds, {kind}; floor median {base * 1e3:.2f} ms")
    for name, spent in times.items():
        m = statistics.median(spent)
        print(f"  {name:14s} {len(spent):4d} steps  x{m / base:.4f}  ({(m - base) * 1e3:+.2f} ms)")
    print("  inactive by place after the active step (1 = the step after it): " + ", ".join(
        f"{p}: x{statistics.median(places[p]) / base:.3f}" for p in sorted(places) if p))
    ours, total = hookpolicy_calls(hp, 20)
    floor_calls = hookpolicy_calls(floor, 5)[1]
    print(f"  Python calls per inactive step: {ours:.0f} in hookpolicy, {total:.0f} in all "
          f"(the floor's step: {floor_calls:.0f})")
    print(f"load average before {before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    for v in reversed(order):  # last in, first out: the two trees' patches of torch nest
        v.close()


if __name__ == "__main__":
    main()
