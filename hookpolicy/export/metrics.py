"""Metric values of hookpolicy, published to Prometheus by a collector at scrape time.

The runtime writes into a `MetricsStore` once per step (never from inside a hook);
`StoreCollector` turns the store into metric families when Prometheus scrapes, like
prometheus_client's own custom-collector pattern. One store serves one
`CollectorRegistry`, so several attached models (or a hot-reloaded policy) in one
process share it and counters stay monotonic across a reload.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import defaultdict
from typing import Callable, Collection, Iterator, Optional

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..policy.model import STATS, TARGETS

__all__ = [
    "ENGINE_FAMILIES", "RELOAD_GAUGE", "STAT_LABELS", "MetricsStore", "StoreCollector", "store_for",
    "stat_family",
]

log = logging.getLogger("hookpolicy")

Labels = tuple[str, ...]

#: name (without `_total` for counters) -> (type, help, label names besides `rank`)
ENGINE_FAMILIES: dict[str, tuple[str, str, Labels]] = {
    "hookpolicy_steps": ("counter", "Optimizer steps evaluated by hookpolicy (of the furthest model in the process).", ()),
    "hookpolicy_last_step_timestamp_seconds": ("gauge", "Unix time of the last step hookpolicy evaluated.", ()),
    "hookpolicy_actions": (
        "counter", "Actions run, by action and mode (audit actions change nothing).",
        ("policy", "rule", "action", "mode"),
    ),
    "hookpolicy_alerts": ("counter", "Evaluations on which an alert fired.", ("policy", "rule", "severity")),
    "hookpolicy_alert_firing": (
        "gauge", "1 while an alert's condition holds (after its for: count), else 0.",
        ("policy", "rule", "severity"),
    ),
    "hookpolicy_skipped_steps": ("counter", "Optimizer steps skipped by an alert.", ("policy", "rule")),
    "hookpolicy_hook_errors": ("counter", "Errors raised inside hookpolicy's hooks.", ("policy", "rule")),
    "hookpolicy_hook_seconds": ("counter", "Time spent inside hookpolicy's hooks.", ("policy", "rule")),
    "hookpolicy_policy_info": ("gauge", "The applied policies: revision is the file's content hash.", ("policy", "revision", "mode")),
    "hookpolicy_config_last_reload_successful": ("gauge", "1 if the last policy (re)load succeeded, else 0.", ()),
    "hookpolicy_series_dropped": ("counter", "Statistic series not exported because spec.limits.maxSeries was reached.", ("policy",)),
}

STAT_LABELS: Labels = ("policy", "rule", "module", "tensor")

#: Written only by `MetricsStore.config_loaded`.
RELOAD_GAUGE = "hookpolicy_config_last_reload_successful"


def stat_family(target: str, stat: str) -> str:
    """`hookpolicy_<target>_<stat>`, e.g. `hookpolicy_grad_l2_norm`."""
    return f"hookpolicy_{target}_{stat}"


class MetricsStore:
    """Thread-safe values: written by the training thread per step, read by scrapes."""

    def __init__(self, rank: int) -> None:
        self.rank = str(rank)
        self._lock = threading.Lock()
        self._engine: dict[str, dict[Labels, float]] = defaultdict(dict)
        # family -> labels -> value; family -> owner policy, for maxSeries accounting
        self._stats: dict[str, dict[Labels, float]] = defaultdict(dict)
        self._series: dict[str, int] = defaultdict(int)
        self._warned: set[str] = set()

    # -- engine families ---------------------------------------------------------------
    def inc(self, family: str, labels: Labels = (), by: float = 1.0) -> None:
        with self._lock:
            series = self._engine[family]
            series[labels] = series.get(labels, 0.0) + by

    def raise_to(self, family: str, labels: Labels, value: float) -> None:
        """Set a counter to `value` unless it is already higher (several models, one process)."""
        with self._lock:
            series = self._engine[family]
            series[labels] = max(series.get(labels, 0.0), value)

    def set(self, family: str, labels: Labels, value: float) -> None:
        with self._lock:
            self._engine[family][labels] = value

    def config_loaded(self, ok: Optional[bool] = None) -> None:
        """Write RELOAD_GAUGE, and nothing else does: `ok` is a (re)load's outcome.

        An attach calls it with None: the gauge then reads 1 (its policies did load)
        unless a reload has already reported an outcome, which an attach never hides.
        """
        with self._lock:
            series = self._engine[RELOAD_GAUGE]
            if ok is not None or () not in series:
                series[()] = 0.0 if ok is False else 1.0

    def drop(self, family: str, keep: Callable[[Labels], bool]) -> None:
        with self._lock:
            series = self._engine[family]
            for labels in [lab for lab in series if not keep(lab)]:
                del series[labels]

    # -- statistic families ------------------------------------------------------------
    def set_stats(self, values: dict[tuple[str, Labels], float], max_series: dict[str, int]) -> None:
        """Publish one step's statistics: {(family, (policy, rule, module, tensor)): value}.

        A new series beyond its policy's `maxSeries` is dropped, counted in
        `hookpolicy_series_dropped_total` and warned about once per policy.
        """
        dropped: dict[str, int] = defaultdict(int)
        with self._lock:
            for (family, labels), value in values.items():
                series = self._stats[family]
                if labels not in series:
                    policy = labels[0]
                    if self._series[policy] >= max_series.get(policy, 10000):
                        dropped[policy] += 1
                        continue
                    self._series[policy] += 1
                series[labels] = value
        for policy, count in dropped.items():
            self.inc("hookpolicy_series_dropped", (policy,), count)
            if policy not in self._warned:
                self._warned.add(policy)
                log.warning(
                    "policy %s reached spec.limits.maxSeries=%d: further series are dropped "
                    "and counted in hookpolicy_series_dropped_total", policy, max_series.get(policy, 10000),
                )

    def forget_policy(self, policy: str) -> None:
        """Remove a detached policy's statistic gauges (a stale gauge would mislead)."""
        with self._lock:
            for series in self._stats.values():
                for labels in [lab for lab in series if lab[0] == policy]:
                    del series[labels]
            self._series.pop(policy, None)
            self._warned.discard(policy)

    def forget_modules(self, policy: str, modules: Collection[str]) -> None:
        """Remove a policy's statistic gauges of modules it no longer binds (replaced or removed)."""
        with self._lock:
            for series in self._stats.values():
                for labels in [lab for lab in series if lab[0] == policy and lab[2] in modules]:
                    del series[labels]
                    self._series[policy] -= 1

    # -- scrape ------------------------------------------------------------------------
    def snapshot(self) -> tuple[dict[str, dict[Labels, float]], dict[str, dict[Labels, float]]]:
        with self._lock:
            return (
                {f: dict(s) for f, s in self._engine.items()},
                {f: dict(s) for f, s in self._stats.items() if s},
            )


class StoreCollector(Collector):
    """Builds the metric families of a store at scrape time."""

    def __init__(self, store: MetricsStore) -> None:
        self.store = store

    def describe(self) -> list[Metric]:
        # Describing nothing keeps registration cheap; the names are fixed and unique.
        return []

    def collect(self) -> Iterator[Metric]:
        engine, stats = self.store.snapshot()
        rank = self.store.rank
        for name, (kind, help_text, label_names) in ENGINE_FAMILIES.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, help_text, labels=[*label_names, "rank"])
            for labels, value in engine.get(name, {}).items():
                family.add_metric([*labels, rank], value)
            yield family
        for name, series in sorted(stats.items()):
            target, stat = _split_family(name)
            family = GaugeMetricFamily(
                name, f"{stat} of the {target} tensors a rule selected, read once per step.",
                labels=[*STAT_LABELS, "rank"],
            )
            for labels, value in series.items():
                family.add_metric([*labels, rank], value)
            yield family


def _split_family(name: str) -> tuple[str, str]:
    rest = name[len("hookpolicy_"):]
    for target in sorted(TARGETS, key=len, reverse=True):
        if rest.startswith(target + "_") and rest[len(target) + 1:] in STATS:
            return target, rest[len(target) + 1:]
    return rest, ""


_STORES: "weakref.WeakKeyDictionary[CollectorRegistry, MetricsStore]" = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


def store_for(registry: Optional[CollectorRegistry], rank: int) -> MetricsStore:
    """The one store of `registry` (the default registry when None), registering it once."""
    registry = REGISTRY if registry is None else registry
    with _STORES_LOCK:
        store = _STORES.get(registry)
        if store is None:
            store = MetricsStore(rank)
            registry.register(StoreCollector(store))
            _STORES[registry] = store
        return store
