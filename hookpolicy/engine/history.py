"""The past values of the series that history functions read: host floats, bounded, fed once a step.

A *series* is what one action sees of one statistic in one group of its `per`:
`(policy, rule), action index, module, tensor, statistic` (a clip's own norm is the
statistic `norm`). The read-back evaluates alerts and clips against `History.past(...)`,
which holds only values from before the current evaluation, and hands what it evaluated
to the coordinator as `Observation`s; the coordinator `commit`s them once it knows the
step's decision, so a skipped step (which did not happen) never enters the history and
a spike cannot become the baseline. A non-finite value is never appended either.

Memory is bounded per series: a ring of at most `max(largest window, warmup when an
ema is used, 1 for prev)` floats, never more than `expr.MAX_WINDOW` (10000), plus two
floats per `ema` alpha. The ema state follows ZClip: seeded with the mean and the
population variance of the first `max(warmup, 1)` values, then
`m <- a*m + (1-a)*x; v <- a*v + (1-a)*(x - m)**2` with the updated `m`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from ..policy.expr import Call

__all__ = ["GroupKey", "History", "Observation", "Past", "Series", "SeriesSpec", "spec_for"]

#: (policy, rule), action index, module, tensor: one group of one action.
GroupKey = tuple[tuple[str, str], int, str, str]


@dataclass(frozen=True)
class SeriesSpec:
    """What one series must keep: its ring size and its ema alphas; `warmup` seeds the emas."""

    size: int = 0
    alphas: tuple[float, ...] = ()
    warmup: int = 0


def spec_for(calls: Iterable[Call], series: str, warmup: int) -> SeriesSpec:
    """The spec of `series` for the functions `calls` (of all series) and an action's `warmup`."""
    mine = [c for c in calls if c.series == series]
    alphas = tuple(sorted({c.param for c in mine if c.func in ("ema", "ema_std")}))
    size = max((1 if c.func == "prev" else int(c.param) for c in mine if c.func not in ("ema", "ema_std")), default=0)
    if alphas:
        size = max(size, warmup, 1)  # the first values seed the emas
    return SeriesSpec(size, alphas, warmup)


class Series:
    """The past of one series: the last `spec.size` values, its count, and an ema state per alpha."""

    def __init__(self, spec: SeriesSpec) -> None:
        self.spec = spec
        self.values: deque[float] = deque(maxlen=spec.size)
        self.count = 0
        self.emas: dict[float, tuple[float, float]] = {}  # alpha -> (mean, variance), once seeded

    def append(self, x: float) -> None:
        self.values.append(x)
        self.count += 1
        seed = max(self.spec.warmup, 1)
        for alpha in self.spec.alphas:
            state = self.emas.get(alpha)
            if state is not None:
                m = alpha * state[0] + (1.0 - alpha) * x
                self.emas[alpha] = (m, alpha * state[1] + (1.0 - alpha) * (x - m) ** 2)
            elif self.count == seed:
                first = list(self.values)[-seed:]
                mean = math.fsum(first) / seed
                self.emas[alpha] = (mean, math.fsum((y - mean) ** 2 for y in first) / seed)

    def aggregate(self, func: str, param: float) -> float:
        if func in ("ema", "ema_std"):
            state = self.emas.get(param)
            if state is None:
                return math.nan
            return state[0] if func == "ema" else math.sqrt(state[1])
        if not self.values:
            return math.nan
        if func == "prev":
            return self.values[-1]
        window = int(param)
        xs: Sequence[float] = self.values if window >= len(self.values) else list(self.values)[-window:]
        if func == "min":
            return min(xs)
        if func == "max":
            return max(xs)
        mean = math.fsum(xs) / len(xs)
        if func == "mean":
            return mean
        return math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))  # std: population (ddof 0)


class Past:
    """One group's view of the history: what `expr` evaluates functions against."""

    def __init__(self, history: "History", key: GroupKey) -> None:
        self.history, self.key = history, key

    def aggregate(self, func: str, series: str, param: float) -> float:
        found = self.history.series.get((*self.key, series))
        return math.nan if found is None else found.aggregate(func, param)


@dataclass
class Observation:
    """The values one evaluation saw, to append once the step's decision is known."""

    key: GroupKey
    values: Mapping[str, float]
    #: per statistic, its spec (how much of it to keep)
    specs: Mapping[str, SeriesSpec]


@dataclass
class History:
    """Every series of one attachment; carried over to the next one at a hot reload (`carry`)."""

    series: dict[tuple[tuple[str, str], int, str, str, str], Series] = field(default_factory=dict)

    def past(self, key: GroupKey) -> Past:
        return Past(self, key)

    def count(self, key: GroupKey, series: Iterable[str]) -> int:
        """The fewest values any of the group's `series` has (0 when one has none): what `warmup` waits for."""
        counts = [found.count if (found := self.series.get((*key, s))) is not None else 0 for s in series]
        return min(counts, default=0)

    def commit(self, observations: Sequence[Observation]) -> None:
        """Append what a step evaluated (it was not skipped); non-finite values are left out.

        Several observations of one group in one commit (a clip called once per
        micro-batch) append their largest value, once: a series has one value a step.
        """
        merged: dict[tuple[tuple[str, str], int, str, str, str], tuple[float, SeriesSpec]] = {}
        for obs in observations:
            for stat, value in obs.values.items():
                if not math.isfinite(value):
                    continue
                key = (*obs.key, stat)
                known = merged.get(key)
                if known is None or value > known[0]:
                    merged[key] = (value, obs.specs[stat])
        for key, (value, spec) in merged.items():
            series = self.series.get(key)
            if series is None:
                series = self.series[key] = Series(spec)
            series.append(value)

    def carry(self, keep: Iterable[tuple[str, str]]) -> "History":
        """A new history holding the series of the rules `keep` (unchanged at a reload), shared, not copied."""
        kept = set(keep)
        return History({key: s for key, s in self.series.items() if key[0] in kept})

