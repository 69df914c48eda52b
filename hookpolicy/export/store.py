"""The values of hookpolicy's metrics, and the series budgets (`maxSeries`, `maxJobSeries`) they are kept within.

The runtime writes into a `MetricsStore` once per step (never from inside a hook); the
collector (`collector.StoreCollector`) reads a snapshot of it when Prometheus scrapes. A
step whose statistics only export (no alert, no sink reads them) and whose series are all
held already only swaps in their unfinished values (`swap_in`, whatever their number): they
are finished at the next scrape (`snapshot`, outside the lock a step takes) or before the
store changes otherwise. One
store serves one `CollectorRegistry` (`collector.store_for`), so several attached models (or
a hot-reloaded policy) in one process share it and counters stay monotonic across a reload.
`ModelMetrics` is one governed model's view of the store, which adds its `model` label.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import defaultdict
from typing import Callable, Collection, Hashable, Iterable, Mapping, Optional, Protocol, Sequence, cast

from ..environment import run_id
from ..policy.model import Policy
from ..process import Once
from .metrics import (
    LAST_STEP_TIMESTAMP, MODEL_FAMILIES, RELOAD_SUCCESSFUL, RUN_INFO, SERIES_DROPPED, STAT_FAMILIES, STEPS, Family, Labels,
    checked_name,
)

__all__ = ["Deferred", "MetricsStore", "ModelMetrics"]

log = logging.getLogger("hookpolicy")

Key = tuple[str, Labels]

#: the families whose series carry the `model` label, by name (a name is found without hashing a `Family`)
_MODEL_NAMES = frozenset(family.name for family in MODEL_FAMILIES)
#: the two families a step's end writes (`step_ended`), each labelled by the model alone
_STEPS, _STAMP = STEPS.name, LAST_STEP_TIMESTAMP.name


class Deferred(Protocol):
    """Values handed over unfinished (`engine.decide.passes.Finished`)."""

    def values(self) -> Sequence[float]:
        """The values, finished once, whichever thread asks first."""


class MetricsStore:
    """Thread-safe values: written by the training thread per step, read by scrapes."""

    def __init__(self, rank: int) -> None:
        self.rank = str(rank)
        self._lock = threading.Lock()
        #: held while a reload swaps one attachment for another: a scrape waits for the swap
        #: to end rather than see neither policy (`hookpolicy_policy_info` missing)
        self._swapping = threading.RLock()
        self._engine: dict[str, dict[Labels, float]] = defaultdict(dict)
        # family -> labels -> value; family -> owner policy, for maxSeries accounting
        self._stats: dict[str, dict[Labels, float]] = defaultdict(dict)
        self._series: dict[str, int] = defaultdict(int)
        #: maxJobSeries accounting: policy -> the job's series as every rank counts them (1 for
        #: a series the job exports once, the world size for one each rank exports), and the
        #: cost of each series counted, stored here or not
        self._job: dict[str, int] = defaultdict(int)
        self._job_costs: dict[tuple[str, Labels], int] = {}
        self._refused: set[tuple[str, Labels]] = set()  # series dropped (and counted) once, until forgotten
        self._said_full = Once()  # policies told that they reached a limit, until forgotten
        self._models: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()
        self._classes: dict[str, int] = {}
        self._off: dict[Labels, str] = {}  # (policy, rule, model) -> why, for the run summary; not exported
        #: for the run summary, not exported: (policy, rule, model) -> log path -> records written there,
        #: and -> every statistic series it stored (also those forgotten since)
        self._written: dict[Labels, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._stored: dict[Labels, set[tuple[str, Labels]]] = defaultdict(set)
        #: values swapped in unfinished (`swap_in`): token -> (their series, the values), written at the next
        #: scrape or before anything else changes the statistic series
        self._pending: dict[Hashable, tuple[Sequence[Key], Deferred]] = {}
        #: raised whenever a statistic series is forgotten: a `swap_in` checked at an older one is refused
        self._generation = 0
        self._engine[RUN_INFO.name][(run_id(os.environ),)] = 1.0

    # -- engine families ---------------------------------------------------------------
    def inc(self, family: Family, labels: Labels = (), by: float = 1.0) -> None:
        self.inc_all(family, ((labels, by),))

    def inc_all(self, family: Family, counts: Iterable[tuple[Labels, float]]) -> None:
        """`inc` of several series of one family, under one lock: a step's counts (`labels`, by)."""
        checked = [(checked_name(family, labels), labels, by) for labels, by in counts]
        with self._lock:
            for name, labels, by in checked:
                series = self._engine[name]
                series[labels] = series.get(labels, 0.0) + by

    def raise_to(self, family: Family, labels: Labels, value: float) -> None:
        """Set a counter to `value` unless it is already higher (several models, one process)."""
        name = checked_name(family, labels)
        with self._lock:
            series = self._engine[name]
            series[labels] = max(series.get(labels, 0.0), value)

    def set(self, family: Family, labels: Labels, value: float) -> None:
        name = checked_name(family, labels)
        with self._lock:
            self._engine[name][labels] = value

    def step_ended(self, labels: Labels, step: int, at: float) -> None:
        """A model's step counted: `STEPS` raised to `step` (as `raise_to`) and `LAST_STEP_TIMESTAMP` set to `at`,
        under one lock (every step's end writes these two)."""
        with self._lock:
            steps, stamps = self._engine[_STEPS], self._engine[_STAMP]
            steps[labels] = max(steps.get(labels, 0.0), step)
            stamps[labels] = at

    def config_loaded(self, ok: Optional[bool] = None) -> None:
        """Write RELOAD_SUCCESSFUL, and nothing else does: `ok` is a (re)load's outcome.

        An attach calls it with None: the gauge then reads 1 (its policies did load)
        unless a reload has already reported an outcome, which an attach never hides.
        """
        with self._lock:
            series = self._engine[RELOAD_SUCCESSFUL.name]
            if ok is not None or () not in series:
                series[()] = 0.0 if ok is False else 1.0

    def switch_off(self, labels: Labels, why: str) -> None:
        """Note that a rule (policy, rule, model) was switched off, and why, for the run summary."""
        with self._lock:
            self._off[labels] = why

    def switched_off(self) -> dict[Labels, str]:
        """(policy, rule, model) -> why, of every rule switched off so far."""
        with self._lock:
            return dict(self._off)

    def wrote(self, labels: Labels, path: str, records: int) -> None:
        """Note that a rule (policy, rule, model) wrote `records` log records to `path`, for the run summary."""
        with self._lock:
            self._written[labels][path] += records

    def records_written(self) -> dict[Labels, dict[str, int]]:
        """(policy, rule, model) -> log path -> records written there so far."""
        with self._lock:
            return {labels: dict(paths) for labels, paths in self._written.items()}

    def series_stored(self) -> dict[Labels, int]:
        """(policy, rule, model) -> how many statistic series of the rule this process has exported (stored)."""
        with self._lock:
            return {labels: len(series) for labels, series in self._stored.items()}

    def drop(self, family: Family, keep: Callable[[Labels], bool]) -> None:
        name = checked_name(family, family.labels)
        with self._lock:
            series = self._engine[name]
            for labels in [lab for lab in series if not keep(lab)]:
                del series[labels]

    # -- statistic families ------------------------------------------------------------
    def set_stats(
        self, values: Mapping[tuple[str, Labels], float], policies: Mapping[str, Policy], world: int = 1,
        job: Collection[tuple[str, Labels]] = (), withheld: Collection[tuple[str, Labels]] = (),
    ) -> None:
        """Publish one step's statistics: {(family, (policy, rule, module, tensor, ...)): value}.

        `values` holds every statistic this process computed at the step; those in `job`
        are the job's (exported once per job, by rank 0), the others each rank's own, and
        those in `withheld` are not exported by this process (rank 0 exports them).
        A new series beyond its policy's `maxJobSeries` (a job's series counting 1, a
        rank's `world`) or, in this process, beyond its `maxSeries` is dropped, counted once
        in `hookpolicy_series_dropped_total` by the process that would have exported it, and
        said once per policy.

        Every rank counts every series of the job in the same order, whether it exports it
        or not: of the series new at this call, the job's first, then each rank's, each in
        the order of `values`, so every rank admits the same ones with no collective as long as
        every rank publishes the same keys at the same steps (replicas in step; an evaluation
        one rank runs alone, or a module some ranks skip, breaks that: docs/operations.md §9). A series
        admitted stays; when what it costs changes (the process group came up) it is
        counted anew, without a drop.
        A family `stat_family` cannot make raises `ValueError`.
        """
        unknown = {family for family, _ in values} - STAT_FAMILIES
        if unknown:
            raise ValueError(f"unknown statistic families {sorted(unknown)}")
        dropped: dict[tuple[str, str], int] = defaultdict(int)  # (policy, limit) -> series dropped now
        new: list[tuple[tuple[str, Labels], float, Policy, int]] = []  # not yet counted against a maxJobSeries
        with self._lock:
            costs = self._job_costs
            for key, value in values.items():
                policy = policies.get(key[1][0])
                if policy is not None and policy.max_job_series is not None:
                    cost = 1 if job and key in job else world
                    counted = costs.get(key)
                    if counted is None:  # admitted below, the job's first
                        new.append((key, value, policy, cost))
                        continue
                    if counted != cost:  # its kind changed (the process group came up): counted anew, kept
                        self._job[key[1][0]] += cost - counted
                        costs[key] = cost
                if not (withheld and key in withheld):
                    self._store(key, value, policy, dropped)
            # the job's series first: a budget keeps them before each rank's (they cost 1, not world)
            for key, value, policy, cost in sorted(new, key=lambda item: not (job and item[0] in job)):
                here = not (withheld and key in withheld)
                if self._job[key[1][0]] + cost > cast(int, policy.max_job_series):
                    if here and key not in self._refused:
                        self._refused.add(key)
                        dropped[(key[1][0], "maxJobSeries")] += 1
                    continue
                self._job[key[1][0]] += cost
                costs[key] = cost
                self._refused.discard(key)
                if here:
                    self._store(key, value, policy, dropped)
        for (name, limit_name), count in dropped.items():
            self.inc(SERIES_DROPPED, (name,), count)
            self._say_full(name, limit_name, policies.get(name), world)

    def _store(self, key: tuple[str, Labels], value: float, policy: Optional[Policy],
               dropped: dict[tuple[str, str], int]) -> None:
        """Store one series this process exports, unless it is new beyond its policy's `maxSeries`; under the lock."""
        family, labels = key
        series = self._stats[family]
        if labels not in series:
            if self._series[labels[0]] >= (Policy.max_series if policy is None else policy.max_series):
                if key not in self._refused:
                    self._refused.add(key)
                    dropped[(labels[0], "maxSeries")] += 1
                return
            self._series[labels[0]] += 1
            self._refused.discard(key)
            self._stored[(labels[0], labels[1], labels[-1])].add(key)
        series[labels] = value

    def generation(self) -> int:
        """How many times statistic series were forgotten: `holding` answers for one generation."""
        return self._generation

    def holding(self, keys: Iterable[Key], policies: Mapping[str, Policy], world: int) -> Optional[int]:
        """The generation at which this store holds every series of `keys` as this rank's own, or None.

        Held: stored here, and counted against a `maxJobSeries` at `world` (as `set_stats` counts
        a rank's series). For such series `set_stats` would only write their values, so until
        a series is forgotten (a new generation) `swap_in` may stand for it.
        """
        with self._lock:
            for key in keys:
                family, labels = key
                if labels not in self._stats.get(family, {}):
                    return None
                policy = policies.get(labels[0])
                if policy is not None and policy.max_job_series is not None and self._job_costs.get(key) != world:
                    return None
            return self._generation

    def swap_in(self, token: Hashable, keys: Sequence[Key], values: Deferred, generation: int) -> bool:
        """Hand over the values of `keys` unfinished, in place of those handed over under `token` before.

        What `set_stats` would do for series `holding` answered `generation` for, at the cost
        of one assignment; False (nothing done) when series were forgotten since.
        """
        with self._lock:
            if generation != self._generation:
                return False
            self._pending[token] = (keys, values)
            return True

    def settle(self, token: Hashable) -> None:
        """Write the values handed over under `token`, before its series are published otherwise."""
        with self._lock:
            pending = self._pending.pop(token, None)
            if pending is not None:
                self._write(*pending)

    def _settle_all(self) -> None:
        """Write every value handed over, under the lock."""
        for keys, values in self._pending.values():
            self._write(keys, values)
        self._pending.clear()

    def _write(self, keys: Sequence[Key], values: Deferred) -> None:
        stats = self._stats
        for (family, labels), value in zip(keys, values.values()):
            stats[family][labels] = value

    def _say_full(self, name: str, limit_name: str, policy: Optional[Policy], world: int) -> None:
        """One warning per policy that reached a limit: maxSeries by every process, maxJobSeries by rank 0 for the job."""
        if limit_name == "maxSeries":
            if self._said_full(name):
                log.warning("policy %s reached spec.limits.maxSeries=%d: further series are dropped and counted in "
                            "hookpolicy_series_dropped_total", name,
                            Policy.max_series if policy is None else policy.max_series)
        elif self.rank == "0" and self._said_full(name):
            log.warning("policy %s reached spec.limits.maxJobSeries=%s in a job of %d rank(s) (a series every rank "
                        "exports counts %d, one the job exports once counts 1): further series are dropped on "
                        "every rank and counted in hookpolicy_series_dropped_total", name,
                        None if policy is None else policy.max_job_series, world, world)

    def _forget(self, gone: Callable[[str, Labels], bool]) -> None:
        """Remove the statistic series `gone(family, labels)` names from the store and from both counts, under the lock."""
        self._settle_all()
        self._generation += 1
        for family, series in self._stats.items():
            for labels in [lab for lab in series if gone(family, lab)]:
                del series[labels]
                self._series[labels[0]] -= 1
        for key in [k for k in self._job_costs if gone(*k)]:
            self._job[key[1][0]] -= self._job_costs.pop(key)
        self._refused.difference_update([k for k in self._refused if gone(*k)])

    def forget_policy(self, policy: str, model: Optional[str] = None) -> None:
        """Remove a detached policy's statistic gauges (of one model, or all), since a stale gauge would mislead."""
        with self._lock:
            self._forget(lambda family, lab: lab[0] == policy and model in (None, lab[-1]))
            if self._series.get(policy, 0) <= 0 and self._job.get(policy, 0) <= 0:
                self._series.pop(policy, None)
                self._job.pop(policy, None)
                self._said_full.forget(policy)

    def forget_series(self, keys: Iterable[tuple[str, Labels]]) -> None:
        """Remove statistic series {(family, labels)} this process no longer exports (rank 0 exports the job's).

        They stay in the `maxJobSeries` count: they are still the job's series.
        """
        with self._lock:
            self._settle_all()
            self._generation += 1
            for family, labels in keys:
                series = self._stats.get(family)
                if series is not None and labels in series:
                    del series[labels]
                    self._series[labels[0]] -= 1

    # -- models ------------------------------------------------------------------------
    def for_model(self, model: object, class_name: str) -> "ModelMetrics":
        """The view of this store that labels every per-model series with `model`'s label.

        The label is the class name of the model's root, `#2`, `#3`, ... for the second and
        later models of the same class, in the order they were first seen; the same model
        object (a reloaded policy, say) keeps its label.
        """
        with self._lock:
            label = self._models.get(model)
            if label is None:
                count = self._classes[class_name] = self._classes.get(class_name, 0) + 1
                label = self._models[model] = class_name if count == 1 else f"{class_name}#{count}"
        return ModelMetrics(self, label)

    def forget_modules(self, policy: str, modules: Collection[str]) -> None:
        """Remove a policy's statistic gauges of modules it no longer binds (replaced or removed)."""
        with self._lock:
            self._forget(lambda family, lab: lab[0] == policy and lab[2] in modules)

    # -- scrape ------------------------------------------------------------------------
    def swapping(self) -> "threading.RLock":
        """Hold this (`with store.swapping():`) while one attachment replaces another."""
        return self._swapping

    def snapshot(self) -> tuple[dict[str, dict[Labels, float]], dict[str, dict[Labels, float]]]:
        """(engine family -> labels -> value, statistic family -> labels -> value), as of now.

        Values handed over unfinished are finished here first, outside the lock a step's
        `swap_in` takes, then written under it (those swapped in meanwhile are finished there).
        """
        for _ in range(3):
            with self._lock:
                waiting = [values for _, values in self._pending.values()]
            if not waiting:
                break
            for values in waiting:
                values.values()
            with self._lock:
                if all(values in waiting for _, values in self._pending.values()):
                    break
        with self._swapping, self._lock:
            self._settle_all()
            return (
                {f: dict(s) for f, s in self._engine.items()},
                {f: dict(s) for f, s in self._stats.items() if s},
            )


class ModelMetrics:
    """One governed model's view of a `MetricsStore`: the same calls, with its `model` label added.

    Labels given to it never include `model`; it appends the label to the series of the
    families in `MODEL_FAMILIES` and of every statistic family, and passes the process-wide
    families (policy info, reload status, dropped series) through unchanged.
    """

    def __init__(self, store: MetricsStore, model: str) -> None:
        self.store = store
        self.model = model
        self.rank = store.rank
        self._model_labels = (model,)  # the labels of `STEPS` and `LAST_STEP_TIMESTAMP`

    def _labels(self, family: Family, labels: Labels) -> Labels:
        return (*labels, self.model) if family.name in _MODEL_NAMES else labels

    def inc(self, family: Family, labels: Labels = (), by: float = 1.0) -> None:
        self.store.inc(family, self._labels(family, labels), by)

    def inc_all(self, family: Family, counts: Iterable[tuple[Labels, float]]) -> None:
        """`MetricsStore.inc_all`, each series with this model's label where `family` has it."""
        if family.name in _MODEL_NAMES:
            model = self.model
            counts = [((*labels, model), by) for labels, by in counts]
        self.store.inc_all(family, counts)

    def raise_to(self, family: Family, labels: Labels, value: float) -> None:
        self.store.raise_to(family, self._labels(family, labels), value)

    def set(self, family: Family, labels: Labels, value: float) -> None:
        self.store.set(family, self._labels(family, labels), value)

    def step_ended(self, step: int, at: float) -> None:
        """`MetricsStore.step_ended` for this model: its step counter and the timestamp of its last step."""
        self.store.step_ended(self._model_labels, step, at)

    def config_loaded(self, ok: Optional[bool] = None) -> None:
        self.store.config_loaded(ok)

    def switch_off(self, labels: Labels, why: str) -> None:
        self.store.switch_off((*labels, self.model), why)

    def wrote(self, labels: Labels, path: str, records: int) -> None:
        self.store.wrote((*labels, self.model), path, records)

    def drop(self, family: Family, keep: Callable[[Labels], bool]) -> None:
        """Drop the series `keep` rejects (given the labels without `model`); only this model's."""
        if family not in MODEL_FAMILIES:
            self.store.drop(family, keep)
            return
        self.store.drop(family, lambda labels: labels[-1] != self.model or keep(labels[:-1]))

    def set_stats(
        self, values: Mapping[tuple[str, Labels], float], policies: Mapping[str, Policy], world: int = 1,
        job: Collection[tuple[str, Labels]] = (), withheld: Collection[tuple[str, Labels]] = (),
    ) -> None:
        self.store.set_stats({self.key(k): v for k, v in values.items()}, policies, world,
                             {self.key(k) for k in job}, {self.key(k) for k in withheld})

    def key(self, key: Key) -> Key:
        """A statistic series as the store knows it: with this model's label."""
        return key[0], (*key[1], self.model)

    def generation(self) -> int:
        return self.store.generation()

    def holding(self, keys: Iterable[Key], policies: Mapping[str, Policy], world: int) -> Optional[int]:
        """`MetricsStore.holding` of series given with the store's labels (`key`)."""
        return self.store.holding(keys, policies, world)

    def swap_in(self, token: Hashable, keys: Sequence[Key], values: Deferred, generation: int) -> bool:
        """`MetricsStore.swap_in` of series given with the store's labels (`key`); `token` is this model's."""
        return self.store.swap_in((self.model, token), keys, values, generation)

    def settle(self, token: Hashable) -> None:
        self.store.settle((self.model, token))

    def forget_policy(self, policy: str) -> None:
        self.store.forget_policy(policy, self.model)

    def forget_series(self, keys: Iterable[tuple[str, Labels]]) -> None:
        self.store.forget_series(self.key(k) for k in keys)

    def forget_modules(self, policy: str, modules: Collection[str]) -> None:
        self.store.forget_modules(policy, modules)

    def swapping(self) -> "threading.RLock":
        return self.store.swapping()
