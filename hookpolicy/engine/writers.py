"""The output writers of a read-back: JSON lines, tensor files and TensorBoard runs.

A sink that cannot write (a full disk, a folder that is a file, a symlink out of the
output folder, no tensorboard package) is a fault of its rule (`Writers.fault`), handed to
the step cycle in the `StepReport` and handled by `onError` like a raising hook.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

from ..export.sinks import BudgetSpent, JsonLines, TensorWriter
from ..export.tensorboard import Boards, histogram_tag
from ..policy.model import Board, Capture, LogSink
from .decision import SinkHalts, StepReport
from .ledger import Entry
from .rulestate import RuleState

__all__ = ["Writers"]

log = logging.getLogger("hookpolicy")


class Writers:
    """The sinks of one attachment's captures, opened at their first write, closed at `close()`."""

    def __init__(self, root: Path, rank: int) -> None:
        self._root = root
        self._writers: dict[tuple[tuple[str, str], int], TensorWriter] = {}
        self._logs: dict[tuple[tuple[str, str], int], JsonLines] = {}
        self.boards = Boards(root, rank)

    def close(self) -> None:
        """Close the log sinks (at `remove()`); never raises, so `remove()` never does."""
        for (key, _), sink in self._logs.items():
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - JsonLines.close does not raise; a sink that does is one line
                log.error("hookpolicy: %s/%s: closing its log failed: %s: %s", *key, type(exc).__name__, exc)
        try:
            self.boards.close()
        except Exception as exc:  # noqa: BLE001 - as for the logs: remove() never raises
            log.error("hookpolicy: closing the TensorBoard writers failed: %s: %s", type(exc).__name__, exc)

    def fault(self, report: StepReport, rs: RuleState, exc: Exception) -> None:
        """A sink of `rs` failed: a fault of the rule, for the cycle; with `onError: halt` the read-back stops."""
        report.errors.append((rs, exc))
        if rs.policy.on_error == "halt":
            raise SinkHalts()

    def write_copies(self, entry: Entry, step: int, report: StepReport) -> None:
        rs = entry.rule
        if report.off(rs):
            return
        for index, module, name, tensor in entry.copies:
            action = rs.rule.actions[index]
            assert isinstance(action, Capture)
            board = action.tensorboard
            if board is not None and board.histograms:
                tag = histogram_tag(*rs.key, entry.target, module, name)
                if not self.write_board(
                    rs, index, lambda b: self.boards.histogram(b, step, tag, tensor), report,
                ):
                    return
            if action.tensors is None:
                continue
            writer = self._writers.get((rs.key, index))
            try:
                if writer is None:
                    writer = self._writers[(rs.key, index)] = TensorWriter(self._root, action.tensors)
                if writer.spent:
                    continue
                stem = f"step{step:08d}-{module or 'root'}-{entry.target}" + (f"-{name}" if name else "")
                writer.write(stem.replace("/", "_") + ".pt", tensor.cpu())
            except BudgetSpent as exc:
                log.warning("%s/%s: %s; no more tensor files are written", *rs.key, str(exc))
            except Exception as exc:  # noqa: BLE001 - a full disk, a read-only folder, an unsafe path
                self.fault(report, rs, exc)
                return

    def write_board(
        self, rs: RuleState, index: int, write: Callable[[Board], None], report: StepReport,
    ) -> bool:
        """Write to a capture's TensorBoard run; a sink that cannot (no tensorboard package, a
        full disk) is a fault of the rule, as for the logs. False when it failed."""
        action = rs.rule.actions[index]
        assert isinstance(action, Capture) and action.tensorboard is not None
        if report.off(rs):
            return False
        try:
            write(action.tensorboard)
        except OSError as exc:
            self.fault(report, rs, exc)
            return False
        return True

    def write_log(
        self, rs: RuleState, index: int, sink: Optional[LogSink], records: list[dict[str, Any]], report: StepReport,
    ) -> None:
        """Append one step's records to a capture's JSON lines (by action index; -1: the alert stream, stderr).

        A sink that cannot write (a full disk, a folder that is a file, a symlink out of the
        output folder) is a fault of the rule, handled by `onError` like a raising hook.
        """
        if report.off(rs):
            return
        try:
            writer = self._logs.get((rs.key, index))
            if writer is None:
                writer = self._logs[(rs.key, index)] = JsonLines(self._root, sink)
            writer.write(records)
        except Exception as exc:  # noqa: BLE001
            self.fault(report, rs, exc)
