"""What hookpolicy writes, read back: a registry's sample, the exporter served for a
`with`, a JSON-lines log."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry


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
