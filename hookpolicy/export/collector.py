"""The Prometheus collector of a store, and the one store of each registry.

`StoreCollector` builds the metric families of a `store.MetricsStore` at scrape time,
prometheus_client's custom-collector pattern; `store_for` gives the one store of a
`CollectorRegistry` (the default registry when none is given), registering its collector
once (`_STORES`, weakly per registry: a test's fresh registry gets a fresh store).
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterator, Optional, Union

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .exposition import StatFamily
from .metrics import FAMILIES, Family, split_family
from .store import MetricsStore

__all__ = ["StoreCollector", "store_for"]


class StoreCollector(Collector):
    """Builds the metric families of a store at scrape time."""

    def __init__(self, store: MetricsStore) -> None:
        self.store = store

    def describe(self) -> list[Metric]:
        """The engine families, empty: registration checks their names against the registry's.

        The statistic families depend on the policies attached later, so they are not
        described (a registry restricted to them finds nothing).
        """
        return [_metric_family(f) for f in FAMILIES]

    def collect(self) -> Iterator[Metric]:
        engine, stats = self.store.snapshot()
        rank = self.store.rank
        for f in FAMILIES:
            family = _metric_family(f)
            for labels, value in engine.get(f.name, {}).items():
                family.add_metric([*labels, rank], value)
            yield family
        for name, series in sorted(stats.items()):
            target, stat = split_family(name)
            yield StatFamily(name, f"{stat} of the {target} tensors a rule selected, read once per step.", series, rank)


def _metric_family(family: Family) -> Union[CounterMetricFamily, GaugeMetricFamily]:
    if family.kind == "counter":
        return CounterMetricFamily(family.name, family.help, labels=[*family.labels, "rank"])
    return GaugeMetricFamily(family.name, family.help, labels=[*family.labels, "rank"])


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
