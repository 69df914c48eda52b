"""What hookpolicy writes, read back: a registry's sample (of rank 0, the hook errors), the
exporter's text parsed strictly, the exporter served for a
`with`, a JSON-lines log."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families


class Said(logging.Handler):
    """The messages of hookpolicy's log records (INFO and up), in order, from `Said()` until `stop()`.

    For ranks spawned in process (`helpers.distributed.spawn`), whose stderr the test does not read.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger("hookpolicy").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def stop(self) -> None:
        logging.getLogger("hookpolicy").removeHandler(self)


def metric(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> Optional[float]:
    """The one sample of `name` whose labels include `labels` (None if there is none).

    Like `registry.get_sample_value`, but a label the test does not care about (`model`,
    say) need not be spelled out.
    """
    found = [s.value for family in registry.collect() for s in family.samples
             if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, f"{name}{labels} is ambiguous: {found}"
    return found[0] if found else None


@contextlib.contextmanager
def served(registry: CollectorRegistry, port: int, **options: Any) -> Iterator[Any]:
    """`hookpolicy.export.exporter.serve` for the length of a `with`, shut down after."""
    from hookpolicy.export.exporter import serve

    server = serve(registry, port, **options)
    assert server is not None
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log, every line complete."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), f"{path} ends in a partial line"
    return [json.loads(line) for line in text.splitlines()]


#: A readable alert line on stderr (`engine/alerts.alert_line`).
ALERT_LINE = re.compile(r"^hookpolicy: (INFO|WARNING|CRITICAL) ([^/ ]+)/(\S+) step (\d+)(?: rank (\d+))?: (.*)$")


def alert_lines(text: str) -> list[dict[str, Any]]:
    """The readable alert lines of a stderr, as {severity, policy, rule, step, rank, message}."""
    found = [ALERT_LINE.match(line) for line in text.splitlines()]
    return [{"severity": m[1].lower(), "policy": m[2], "rule": m[3], "step": int(m[4]), "rank": int(m[5] or 0),
             "message": m[6]} for m in found if m]


def sample(reg: CollectorRegistry, name: str, **labels: str) -> Optional[float]:
    """`metric` of rank 0."""
    return metric(reg, name, {**labels, "rank": "0"})


def errors_of(reg: CollectorRegistry, rule: str, policy: str = "p") -> float:
    """The hook errors counted for `policy`/`rule` (0 when none)."""
    return sample(reg, "hookpolicy_hook_errors_total", policy=policy, rule=rule) or 0.0


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, float]]:
    """Every sample as (name, labels) -> (family type, value); fails on a torn or untyped family."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.type in ("counter", "gauge"), f"{family.name} has no TYPE line"
        assert family.documentation, f"{family.name} has no HELP line"
        name = re.escape(family.name) + ("(_total)?" if family.type == "counter" else "")
        assert re.search(rf"^# HELP {name} \S", text, re.M), f"{family.name} has no HELP line"
        assert re.search(rf"^# TYPE {name} {family.type}$", text, re.M), f"{family.name} has no TYPE line"
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = (family.type, s.value)
    return samples
