"""`hookpolicy report` on hostile input: a line is a record or is counted and skipped, never a crash.

Issue 24.9: one line of 1,000 nested `[` aborted the report with a RecursionError
traceback (json's parser recurses), and a file without line breaks was read whole as one
line (about twice its size in memory). The reference is Python's own json parser.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from hookpolicy.export import report

RECORD = {"time": 0.0, "step": 0, "rank": 0, "model": "M", "policy": "p", "rule": "r", "module": "0",
          "target": "grad", "tensor": "", "stats": {"l2_norm": 1.5}}


def test_a_line_nested_too_deep_for_json_is_skipped_and_counted(tmp_path: Path) -> None:
    deep = "[" * 100_000
    with pytest.raises(RecursionError):
        json.loads(deep)  # the reference: Python's parser cannot read it
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(RECORD) + "\n" + deep + "\n" + json.dumps({**RECORD, "step": 1}) + "\n")
    records = report.read_logs([str(log)])
    assert records.ignored == 1
    assert len(records.rules) == 1


def test_a_file_without_line_breaks_is_read_a_bounded_line_at_a_time(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    with open(log, "w") as f:
        f.write(json.dumps(RECORD) + "\n")
        f.write("x" * (16 * report.MAX_LINE_CHARS))  # 16 MiB, no line break
        f.write("\n" + json.dumps({**RECORD, "step": 1}) + "\n")
    tracemalloc.start()
    try:
        records = report.read_logs([str(log)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert records.ignored == 1 and len(records.rules) == 1
    assert peak < 8 * report.MAX_LINE_CHARS  # read whole, the line alone took 16 MiB (twice that decoded)
