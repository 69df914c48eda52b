"""The past values of the series that history functions read: host floats, bounded, fed once a step.

A *series* is what one action sees of one statistic in one group of its `per`:
`(policy, rule), action index, module, tensor, statistic` (a clip's own norm is the
statistic `norm`). An action that reads a history, an alert with history functions or a
clip with a `max_norm` expression, reaches it through one `Tracked` (`History.tracking`):
its group key (`group_key`), its series and how much of each to keep, its warm-up
(`ready`), its threshold (`threshold`) and what it saw (`observe`), so alerts and adaptive
clips share each of these rules. They are evaluated against the past, which holds only
values from before the current evaluation; what they saw goes to the step cycle as
`Observation`s, which it `commit`s once it knows the step's decision, so a skipped step (which did not happen) never enters the history and
a spike cannot become the baseline. A non-finite value is never appended either.

Memory is bounded per series: a ring of at most `max(largest window, warmup when an
ema is used, 1 for prev)` float64 values, never more than `expr.MAX_WINDOW` (10000, 80 KB),
plus two floats per `ema` alpha. The ema state follows ZClip: seeded with the mean and the
population variance of the first `max(warmup, 1)` values, then
`m <- a*m + (1-a)*x; v <- a*v + (1-a)*(x - m)**2` with the updated `m`.

Memory is bounded per policy too: the series of all its groups together keep at most
`spec.limits.maxHistoryValues` values (`Policy.max_history_values`), a series costing
`cost(spec)`. A group whose series would pass the budget gets none, for the rest of the
attachment, decided before its first evaluation (`Tracked.ready`, `History.admit`): its
action is not evaluated there (the alert does not fire, the clip does not clip), and the
policy says so once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ...plan.planner import Binding
from ...policy.expr import Call, Value
from ...policy.model import OPTIMIZER_STATE, PARAM_TARGETS, Alert, Clip, Policy
from ...process import Once

__all__ = ["GroupKey", "History", "Observation", "Past", "Series", "SeriesSpec", "Tracked", "bounds", "cost", "groups_on",
           "group_key", "group_specs", "spec_for"]

log = logging.getLogger("hookpolicy")

#: (policy, rule), action index, module, tensor: one group of one action.
GroupKey = tuple[tuple[str, str], int, str, str]


def group_key(module: str, tensor: str, per: str) -> tuple[str, str]:
    """The (module, tensor) a group of `per` holding this tensor is known by: both, the module and "", or ("", "")."""
    return (module, tensor) if per == "tensor" else ((module, "") if per == "module" else ("", ""))


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
    size = max((1 if c.func == "prev" else int(c.param) for c in mine if c.func not in ("ema", "ema_std", "count")),
               default=0)
    if alphas:
        size = max(size, warmup, 1)  # the first values seed the emas
    return SeriesSpec(size, alphas, warmup)


def cost(spec: SeriesSpec) -> int:
    """The values a series of `spec` counts against its policy's `maxHistoryValues`: its ring, 2 per ema alpha, at least 1."""
    return max(1, spec.size + 2 * len(spec.alphas))


def group_specs(stats: Iterable[str], calls: Iterable[Call], warmup: int) -> dict[str, SeriesSpec]:
    """Per statistic an action keeps (`stats`), the spec of its series, for the action's `calls` and `warmup`."""
    calls = tuple(calls)
    return {stat: spec_for(calls, stat, warmup) for stat in sorted(stats)}


def groups_on(per: str, target: str, bound: Sequence[Binding]) -> tuple[int, bool]:
    """How many groups (`per: rule | module | tensor`) an action of a rule on `target` bound as `bound` has on the
    model, and whether that is a lower bound: its tensors show only at run time (a module's outputs, a
    parameter's optimizer state keys)."""
    at_least = (per == "tensor" and target not in PARAM_TARGETS) or target == OPTIMIZER_STATE
    if per == "rule":
        return 1, at_least
    if per == "module":
        return len({b.module for b in bound}), at_least
    return sum(max(1, len(b.params)) for b in bound), at_least


def bounds(policies: Sequence[Policy], bindings: Sequence[Binding]) -> tuple[list[str], list[str]]:
    """What `explain` says of the histories: per action that keeps one, a note with its bound (the
    values a group keeps x its groups on the model) against its policy's `maxHistoryValues`, and
    a warning per policy whose actions need more."""
    notes: list[str] = []
    warnings: list[str] = []
    for policy in policies:
        total, approximate = 0, False
        for rule in policy.rules:
            bound = [b for b in bindings if b.key == (policy.name, rule.name)]
            for index, action in enumerate(rule.actions):
                if not isinstance(action, (Alert, Clip)) or not action.remembers or not bound:
                    continue
                stats = action.stats if isinstance(action, Alert) else ("norm",)
                each = sum(cost(spec) for spec in group_specs(stats, action.calls, action.warmup).values())
                groups, at_least = groups_on(action.per, rule.target, bound)
                total += groups * each
                approximate = approximate or at_least
                notes.append(f"{policy.name}/{rule.name}: action {index} keeps {each} history values per group "
                             f"x {'at least ' if at_least else ''}{groups} group{'s' if groups != 1 else ''} (per: {action.per}) = "
                             f"{groups * each} of spec.limits.maxHistoryValues={policy.max_history_values}")
        if total > policy.max_history_values:
            warnings.append(f"{policy.name}: its history needs {'at least ' if approximate else ''}{total} values, "
                            f"more than spec.limits.maxHistoryValues={policy.max_history_values}: the groups past it "
                            "get no history and their alerts and clips are not evaluated there")
    return notes, warnings


class Series:
    """The past of one series: a ring of its last `spec.size` values, its count, an ema state per alpha.

    The ring is a float64 NumPy array, so a window function is a few vectorised calls (a
    `zscore(x, 10000)` costs tens of microseconds, not the milliseconds of a Python loop);
    results are cached until the next value arrives (a message and a condition, or the
    micro-batches of a step, ask for the same ones).
    """

    def __init__(self, spec: SeriesSpec) -> None:
        self.spec = spec
        self._ring = np.empty(spec.size, dtype=np.float64)
        self._head = 0  # where the next value goes
        self._filled = 0
        self.count = 0
        self.emas: dict[float, tuple[float, float]] = {}  # alpha -> (mean, variance), once seeded
        self._cache: dict[tuple[str, float], float] = {}

    @property
    def values(self) -> list[float]:
        """The kept values, oldest first."""
        return [float(x) for x in self._last(self._filled)]

    def _last(self, n: int) -> np.ndarray:
        """The last `n` kept values (n <= what is kept), oldest first: a view unless the ring wraps."""
        size = self.spec.size
        start = (self._head - n) % size if size else 0
        if start + n <= size:
            return self._ring[start:start + n]
        return np.concatenate((self._ring[start:], self._ring[:self._head]))

    def append(self, x: float) -> None:
        if self.spec.size:
            self._ring[self._head] = x
            self._head = (self._head + 1) % self.spec.size
            self._filled = min(self._filled + 1, self.spec.size)
        self.count += 1
        self._cache.clear()
        seed = max(self.spec.warmup, 1)
        for alpha in self.spec.alphas:
            state = self.emas.get(alpha)
            if state is not None:
                m = alpha * state[0] + (1.0 - alpha) * x
                self.emas[alpha] = (m, alpha * state[1] + (1.0 - alpha) * (x - m) ** 2)
            elif self.count == seed:  # the ring holds at least `seed` values (spec_for)
                first = self._window(seed)
                self.emas[alpha] = (float(first.mean()), float(first.var()))

    def aggregate(self, func: str, param: float) -> float:
        if func == "count":
            return float(self.count)
        if func in ("ema", "ema_std"):
            state = self.emas.get(param)
            if state is None:
                return math.nan
            return state[0] if func == "ema" else math.sqrt(state[1])
        if not self._filled:
            return math.nan
        if func == "prev":
            return float(self._ring[(self._head - 1) % self.spec.size])
        cached = self._cache.get((func, param))
        if cached is None:
            window = self._window(int(param))
            if func == "min":
                cached = float(window.min())
            elif func == "max":
                cached = float(window.max())
            elif func in ("median", "mad"):  # together: the MAD is about the median
                median = float(np.median(window))
                self._cache[("median", param)] = median
                self._cache[("mad", param)] = float(np.median(np.abs(window - median)))
                return self._cache[(func, param)]
            else:  # mean and std (population, ddof 0) together: two passes, the deviations' dot product
                mean = float(window.sum()) / window.size
                deviations = window - mean
                self._cache[("mean", param)] = mean
                self._cache[("std", param)] = math.sqrt(float(np.dot(deviations, deviations)) / window.size)
                return self._cache[(func, param)]
            self._cache[(func, param)] = cached
        return cached

    def _window(self, n: int) -> np.ndarray:
        """The last `n` values in any order (all of them without a copy when `n` covers what is kept)."""
        return self._ring[:self._filled] if n >= self._filled else self._last(n)


class Past:
    """One group's view of the history: what `expr` evaluates functions against."""

    def __init__(self, history: "History", key: GroupKey) -> None:
        self.history, self.key = history, key

    def aggregate(self, func: str, series: str, param: float) -> float:
        found = self.history.series.get((*self.key, series))
        if found is None:
            return 0.0 if func == "count" else math.nan
        return found.aggregate(func, param)


@dataclass
class Observation:
    """The values one evaluation saw, to append once the step's decision is known."""

    key: GroupKey
    values: Mapping[str, float]
    #: per statistic, its spec (how much of it to keep)
    specs: Mapping[str, SeriesSpec]


class Tracked:
    """One action that reads a history: its statistics' series per group, their specs, its warm-up.

    `stats` are the statistics it keeps (an alert's, or `("norm",)` for a clip), `calls`
    the history functions its expressions call, `warmup` how many values every series of
    a group must hold before the action acts on that group.
    """

    def __init__(
        self, history: "History", rule: tuple[str, str], index: int, stats: Iterable[str], calls: Iterable[Call],
        warmup: int,
    ) -> None:
        self.history, self.rule, self.index, self.warmup = history, rule, index, warmup
        #: per statistic, how much of its series to keep
        self.specs = group_specs(stats, calls, warmup)

    def key(self, module: str, tensor: str) -> GroupKey:
        """The group of this action that the series of (module, tensor) belong to (see `group_key`)."""
        return (self.rule, self.index, module, tensor)

    def ready(self, module: str, tensor: str) -> bool:
        """Whether the group may act: it has its series (the budget let it) and its warm-up is over.

        With `warmup: N` the group acts from its (N+1)-th evaluation on, the first one with N
        values of past; with no warm-up, from the first. Asked first, before the action is
        evaluated on the group, it gives the group room in its policy's `maxHistoryValues`
        (`History.admit`); a group refused never acts.
        """
        key = self.key(module, tensor)
        if not self.history.admit(key, self.specs):
            return False
        return self.warmup == 0 or self.history.count(key, self.specs) >= self.warmup

    def past(self, module: str, tensor: str) -> Past:
        return Past(self.history, self.key(module, tensor))

    def threshold(self, expression: Value, module: str, tensor: str) -> float:
        """`expression` (a `max_norm`) evaluated on the group's past: NaN while a function has no past yet."""
        return expression.evaluate({}, self.past(module, tensor))

    def observe(self, module: str, tensor: str, values: Mapping[str, float]) -> Observation:
        """What the group saw now (of `values`, the statistics it keeps), to commit once the step is decided."""
        return Observation(self.key(module, tensor), {stat: values[stat] for stat in self.specs}, self.specs)


@dataclass
class History:
    """Every series of one attachment; carried over to the next one at a hot reload (`carry`, `adopt`).

    `budgets` holds each policy's `maxHistoryValues` (a policy not in it gets the default);
    `used` what its series keep now, `refused` the groups it had no room for.
    """

    series: dict[tuple[tuple[str, str], int, str, str, str], Series] = field(default_factory=dict)
    budgets: Mapping[str, int] = field(default_factory=dict)
    #: each group given room, and the values its series cost (`cost` of each of its specs)
    groups: dict[GroupKey, int] = field(default_factory=dict)
    #: per policy, the values its groups were given
    used: dict[str, int] = field(default_factory=dict)
    refused: set[GroupKey] = field(default_factory=set)
    _tracked: dict[tuple[tuple[str, str], int], Tracked] = field(default_factory=dict, repr=False, compare=False)
    _said_full: Once = field(default_factory=Once, repr=False, compare=False)

    def tracking(
        self, rule: tuple[str, str], index: int, stats: Iterable[str], calls: Iterable[Call], warmup: int,
    ) -> Tracked:
        """The `Tracked` of action `index` of `rule` (made at its first evaluation, then kept)."""
        tracked = self._tracked.get((rule, index))
        if tracked is None:
            tracked = self._tracked[(rule, index)] = Tracked(self, rule, index, stats, calls, warmup)
        return tracked

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
        specs: dict[GroupKey, Mapping[str, SeriesSpec]] = {}
        for obs in observations:
            specs[obs.key] = obs.specs
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
                group = key[:4]
                if not self.admit(group, specs[group]):
                    continue
                series = self.series[key] = Series(spec)
            series.append(value)

    def admit(self, group: GroupKey, specs: Mapping[str, SeriesSpec]) -> bool:
        """Whether `group` may keep its series: it has room already, or its policy's budget holds all of them now.

        A group that does not fit is refused for good (`refused`), said once per policy.
        """
        if group in self.groups:
            return True
        if group in self.refused:
            return False
        policy = group[0][0]
        need = sum(cost(spec) for spec in specs.values())
        budget = self.budgets.get(policy, Policy.max_history_values)
        used = self.used.get(policy, 0)
        if used + need > budget:
            self.refused.add(group)
            if self._said_full(policy):
                (_, rule), index, module, tensor = group
                log.warning(
                    "policy %s reached spec.limits.maxHistoryValues=%d (%d in use): rule %s action %d gets no history "
                    "for %s%s (it needs %d values), so it is not evaluated there, nor for any other group past the "
                    "budget (said once); raise maxHistoryValues or shorten the windows",
                    policy, budget, used, rule, index, module or "<root>", f" {tensor}" if tensor else "", need,
                )
            return False
        self.groups[group] = need
        self.used[policy] = used + need
        return True

    def carry(self, keep: Iterable[tuple[str, str]]) -> "History":
        """A new history holding the series of the rules `keep` (unchanged at a reload), shared, not copied."""
        kept = set(keep)
        return History({key: s for key, s in self.series.items() if key[0] in kept},
                       groups={group: need for group, need in self.groups.items() if group[0] in kept})

    def adopt(self, carried: "History") -> None:
        """Take over the series of `carried` (a `carry`), counted against this history's budgets.

        They are kept even past a budget lowered by the reload: they hold memory already.
        """
        self.series.update(carried.series)
        for group, need in carried.groups.items():
            if group not in self.groups:
                self.groups[group] = need
                self.used[group[0][0]] = self.used.get(group[0][0], 0) + need

