"""A process's final series written for node_exporter's textfile collector (`apply --textfile-dir DIR`).

The alternative to a Pushgateway (`push.py`) where every node runs node_exporter with
`--collector.textfile.directory=DIR`: at exit `apply`'s child writes its whole registry to
`DIR/hookpolicy-<run>-rank<r>.prom`, which node_exporter serves at its next scrape and
every scrape after, until the file is removed. The file is written beside its final name
and renamed over it (prometheus_client's `write_to_textfile`), so the collector never reads
half of one; the temporary name does not end in `.prom`, so it is never read either.

Every sample carries `run` (`HOOKPOLICY_RUN_ID`) besides its `rank`: node_exporter refuses
a whole scrape when two files hold the same series, and two runs (or jobs) on one node
share ranks. So, as with a push, the series of a finished run are not the live ones
(`run=""`), which the state rules read. What goes wrong is one line, never an exception.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["textfile_name", "write_final"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def textfile_name(run: str, rank: int) -> str:
    """`hookpolicy-<run>-rank<r>.prom`, with characters a file name should not hold replaced by `_`."""
    return f"hookpolicy-{_UNSAFE.sub('_', run)[:100] or 'run'}-rank{rank}.prom"


class _WithRun(Collector):
    """`registry`'s families with `run` on every sample (`hookpolicy_run_info`'s own is the same in `apply`)."""

    def __init__(self, registry: CollectorRegistry, run: str) -> None:
        self._registry, self._run = registry, run

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [s._replace(labels={**s.labels, "run": self._run})
                            for s in family.samples]
            yield copy


def write_final(registry: CollectorRegistry, folder: str, *, rank: int, run: str) -> str:
    """Write the registry's series, labelled with `run`, to `folder`'s file for this rank; return the line to say."""
    path = os.path.join(folder, textfile_name(run, rank))
    try:
        write_to_textfile(path, _WithRun(registry, run))
    except Exception as exc:  # noqa: BLE001 - a missing folder, a full disk: said, and the exit goes on
        return f"error: could not write the final series to {path}: {type(exc).__name__}: {exc}"
    return f"wrote the final series to {path} (node_exporter's textfile collector)"
