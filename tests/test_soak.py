"""The full long run: 10,000 steps under a capturing policy (not in CI; ~30-60 s on one core).

    python -m pytest -m soak tests/test_soak.py -s

`soak` is deselected by default (pyproject's `addopts`). CI runs the same checks over
1,000 steps in tests/test_reliability.py; the numbers of both are in docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from test_reliability import long_run, one_thread, out  # noqa: F401 - the fixtures are used by name

pytestmark = pytest.mark.soak


def test_ten_thousand_steps_keep_memory_tensors_and_files_bounded(
    tmp_path: Path, out: Path, one_thread: None, record_property: Callable[[str, object], None],  # noqa: F811
) -> None:
    numbers = long_run(tmp_path, out, steps=10_000)
    for key, value in numbers.items():
        record_property(key, value)
    print(f"\nsoak: {numbers}")
