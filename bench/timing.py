"""Interleaved step timing and the statistics reported from it.

Variants are stepped in turn (A B C, then B C A, then C A B, ...: the starting variant
rotates so no variant always follows the same one), one training step each per round,
so slow drifts of the machine (other tenants, thermal, frequency) hit every variant
alike. Warm-up rounds are run the same way and thrown away.

Each step also records whether other processes used the CPU while it ran (from
/proc/stat and /proc/self/stat): on a shared machine the statistics are taken over the
undisturbed steps when there are enough of them (see `run.py`). Each variant's per-step
times give a median and p10/p90; a ratio is the variant's quantile over the floor's same
quantile. The 95% interval of the median ratio is a
bootstrap over the steps, as is the interval of one variant's overhead as a share of another's. A gated variant (`every: 10`) is split into its active and
inactive steps, and its cost per step is the amortized
`(median(active) + 9 * median(inactive)) / 10`.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import random
import shutil
import sys
import tempfile
import time
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from variants import Variant

__all__ = [
    "other_tree", "Samples", "interleave", "quantile", "Summary", "summarize", "amortized", "count_syncs", "step_table",
]


@dataclass
class Samples:
    times: list[float]  # wall clock per step
    active: list[bool]
    cpu: list[float] = field(default_factory=list)  # process CPU time per step (all threads)
    #: other processes used the CPU during the step (Linux: /proc/stat against /proc/self/stat)
    disturbed: list[bool] = field(default_factory=list)

    def clean(self) -> "Samples":
        """The undisturbed steps only."""
        keep = [not d for d in self.disturbed] if self.disturbed else [True] * len(self.times)
        times = [x for x, k in zip(self.times, keep) if k]
        active = [x for x, k in zip(self.active, keep) if k]
        cpu = [x for x, k in zip(self.cpu, keep) if k]
        return Samples(times, active, cpu, [False] * len(times))


#: the fewest rounds a time budget may cut a measurement to
MIN_ROUNDS = 8
#: CPU time (in clock ticks) that other processes may use during a step before it counts as disturbed
FOREIGN_TICKS = 3


def _ticks() -> tuple[int, int]:
    """(busy ticks of the whole machine, ticks of this process); (0, 0) where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait (guest is in user)
        return busy, int(own[11]) + int(own[12])  # utime + stime of all threads
    except (OSError, IndexError, ValueError):
        return 0, 0


def interleave(variants: Sequence[Variant], rounds: int, warmup: int, cuda: bool,
               budget_s: Optional[float] = None) -> dict[str, Samples]:
    """Step every variant once per round, rotating the order; return the timed steps.

    Without `budget_s`, exactly `rounds` rounds. With it, rounds go on until every variant
    has `rounds` undisturbed steps or `budget_s` seconds have passed (and at least
    `MIN_ROUNDS`), so a busy shared machine costs time, not precision, within a bound.
    """
    out = {v.key: Samples([], []) for v in variants}
    n = len(variants)
    began = time.perf_counter()
    r = 0
    while True:
        spent = time.perf_counter() - began
        if budget_s is None:
            if r >= warmup + rounds:
                break
        elif r >= warmup + MIN_ROUNDS:
            clean = min(sum(not d for d in s.disturbed) for s in out.values())
            if (clean >= rounds and r >= warmup + rounds) or spent > budget_s:
                break
        k = r % n
        for v in [*variants[k:], *variants[:k]]:
            active = v.active() if v.active is not None else True
            if cuda:
                torch.cuda.synchronize()
            busy0, own0 = _ticks()
            start, cpu_start = time.perf_counter(), time.process_time()
            v.step()
            if cuda:
                torch.cuda.synchronize()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            busy1, own1 = _ticks()
            if r >= warmup:
                out[v.key].times.append(elapsed)
                out[v.key].cpu.append(cpu)
                out[v.key].active.append(active)
                out[v.key].disturbed.append((busy1 - busy0) - (own1 - own0) >= FOREIGN_TICKS)
        r += 1
    return out


def step_table(steps: dict[str, Callable[[], None]], rounds: int, seconds_inside: Callable[[str], Optional[float]],
               warmup: int = 5, base: str = "none") -> None:
    """Time `steps` interleaved (as `interleave` does) and print a line each: the median step,
    its ratio to `base`, and hookpolicy's own account of its time per step
    (`seconds_inside(key)`: the variant's hookpolicy_hook_seconds_total, None without a policy)."""
    samples = interleave([Variant(key, key, step, lambda: None) for key, step in steps.items()], rounds, warmup, cuda=False)
    medians = {key: quantile(s.times, 0.5) for key, s in samples.items()}
    for key, median in medians.items():
        seconds = seconds_inside(key)
        inside = "" if seconds is None else f"  inside hookpolicy's hooks and read-back: {seconds / (rounds + warmup) * 1e6:7.1f} us/step"
        print(f"per step, {key:20s} {median * 1e3:7.2f} ms  x{median / medians[base]:.3f}{inside}")


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), without numpy."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Summary:
    median: float
    p10: float
    p90: float
    n: int


def summarize(xs: Sequence[float]) -> Summary:
    return Summary(quantile(xs, 0.5), quantile(xs, 0.1), quantile(xs, 0.9), len(xs))


def amortized(s: Samples, every: int = 10) -> tuple[float, list[float], list[float]]:
    """The amortized per-step median of a gated variant, with its active and inactive times."""
    on = [t for t, a in zip(s.times, s.active) if a]
    off = [t for t, a in zip(s.times, s.active) if not a]
    if not on or not off:
        return quantile(s.times, 0.5), on, off
    return (quantile(on, 0.5) + (every - 1) * quantile(off, 0.5)) / every, on, off


def bootstrap_ratio(
    num: Callable[[random.Random], float], den: Callable[[random.Random], float], reps: int = 400, seed: int = 0,
) -> tuple[float, float]:
    """A 95% bootstrap interval of num/den, where each callable computes a statistic of a resample."""
    rng = random.Random(seed)
    ratios = sorted(num(rng) / den(rng) for _ in range(reps))
    return quantile(ratios, 0.025), quantile(ratios, 0.975)


def bootstrap_share(
    num: Sequence[float], den: Sequence[float], floor: Sequence[float], reps: int = 400, seed: int = 0,
) -> tuple[float, float]:
    """A 95% bootstrap interval of one overhead as a share of another: (median(num) - median(floor)) /
    (median(den) - median(floor)), each median taken over a resample of its own steps; a resample whose `den` is
    not above the floor's counts as an infinite share (nothing to be a share of). Nearest-rank ends, so an
    infinite share can be an end."""
    rng = random.Random(seed)
    a, b, f = resampled_median(num), resampled_median(den), resampled_median(floor)
    shares = []
    for _ in range(reps):
        base = f(rng)
        over = b(rng) - base
        shares.append((a(rng) - base) / over if over > 0 else math.inf)
    shares.sort()
    return shares[round(0.025 * (reps - 1))], shares[round(0.975 * (reps - 1))]


def resampled_median(xs: Sequence[float]) -> Callable[[random.Random], float]:
    def stat(rng: random.Random) -> float:
        return quantile([xs[rng.randrange(len(xs))] for _ in xs], 0.5)
    return stat


def resampled_amortized(s: Samples, every: int = 10) -> Callable[[random.Random], float]:
    _, on, off = amortized(s, every)

    def stat(rng: random.Random) -> float:
        if not on or not off:
            return resampled_median(s.times)(rng)
        m_on = quantile([on[rng.randrange(len(on))] for _ in on], 0.5)
        m_off = quantile([off[rng.randrange(len(off))] for _ in off], 0.5)
        return (m_on + (every - 1) * m_off) / every
    return stat


def other_tree(tree: str) -> types.ModuleType:
    """The hookpolicy package of the tree `tree` (a copy of main, say), imported beside this one as
    `hookpolicy_against`: an A/B of two trees in one process (`--against DIR`)."""
    copied = Path(tempfile.mkdtemp(prefix="against_"))
    shutil.copytree(Path(tree) / "hookpolicy", copied / "hookpolicy_against")
    sys.path.insert(0, str(copied))
    return importlib.import_module("hookpolicy_against")


def count_syncs(v: Variant, steps: int = 3) -> tuple[float, float]:
    """CUDA only: host-device syncs per step, total and inside hookpolicy's once-a-step read-back.

    Uses `torch.cuda.set_sync_debug_mode("warn")`, which warns at every synchronizing
    call; the read-back's share is the warnings raised inside the attached policy's
    `Readback.read` (the step's one device-to-host transfer), wrapped on that instance for
    the duration of the count.
    """
    in_readback = [0]
    readback = v.attached._cycle.readback if v.attached is not None else None
    if readback is not None:
        original = readback.read

        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                with warnings.catch_warnings(record=True) as inner:
                    warnings.simplefilter("always")
                    return original(*args, **kwargs)
            finally:  # outside the inner recorder: a warning handed on there would be recorded again, forever
                in_readback[0] += sum("synchroniz" in str(w.message) for w in inner)
                for w in inner:  # hand them on to the outer recorder
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

        readback.read = counted  # type: ignore[method-assign]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                v.step()
        total = sum("synchroniz" in str(w.message) for w in caught)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        if readback is not None:
            del readback.read  # back to the class's method
    return total / steps, in_readback[0] / steps


@contextlib.contextmanager
def readback_cpu() -> Iterator[list[float]]:
    """CPU time (`time.thread_time`) the step's read-back spends, added up in `spent[0]` (reset it per step).

    The read-back is `Readback.read`, `Readback.add` (what the agreement reduced) and the
    cycle's `_publish` (the metrics store, the counters): fetching, finishing or handing over,
    and publishing a step's statistics.
    """
    from hookpolicy.engine import cycle
    from hookpolicy.engine.decide import readback

    spent = [0.0]
    targets = [(readback.Readback, "read"), (readback.Readback, "add"), (cycle.StepCycle, "_publish")]
    originals = [getattr(owner, name) for owner, name in targets]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start
        return wrapper

    for (owner, name), fn in zip(targets, originals):
        setattr(owner, name, timed(fn))
    try:
        yield spent
    finally:
        for (owner, name), fn in zip(targets, originals):
            setattr(owner, name, fn)
