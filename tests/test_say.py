"""hookpolicy's own lines reach stderr whole: one write per line, so processes sharing a pipe never split one."""

from __future__ import annotations

import io
import sys

import pytest

from hookpolicy.say import say


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_a_line_is_one_write_with_its_line_break(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    say("reloaded policies at step 14 of Sequential (rank 0): p@5bc4fce37a41")
    assert stream.writes == ["hookpolicy: reloaded policies at step 14 of Sequential (rank 0): p@5bc4fce37a41\n"]
