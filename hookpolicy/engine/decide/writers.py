"""The output writers of a read-back: JSON lines, tensor files and TensorBoard runs.

Every write of every sink goes through one containment, `Writers.sink`: a sink that cannot
write (a full disk, a folder deleted or turned into a file, a symlink out of the output
folder, no tensorboard package, a TensorBoard writer whose thread died) is a fault of its
rule (`Writers.fault`), handed to the step cycle in the `StepReport` and handled by
`onError` like a raising hook, never an exception out of the step. The end-of-step flush
of the TensorBoard runs is such a write too (`flush_boards`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ... import environment
from ...export.sinks import AlertFiles, BudgetSpent, JsonLines, TensorWriter
from ...export.tensorboard import Boards, histogram_tag
from ...policy.model import Board, Capture, LogSink, Policy
from .alerts import SinkHalts, StepReport, alert_line
from ..execute.ledger import Entry
from ..measure.rulestate import RuleState

__all__ = ["AlertStream", "MAX_ALERT_LINES", "Writers"]

log = logging.getLogger("hookpolicy")


class Writers:
    """The sinks of one attachment's captures, opened at their first write, closed at `close()`."""

    def __init__(self, root: Path, rank: int, policies: Sequence[Policy] = ()) -> None:
        self.alerts = AlertStream(environment.log_format(os.environ), environment.alert_log(os.environ),
                                  AlertFiles.of(root, policies, rank))
        self._root = root
        self._writers: dict[tuple[tuple[str, str], int], TensorWriter] = {}
        self._logs: dict[tuple[tuple[str, str], int], JsonLines] = {}
        self.boards = Boards(root, rank)
        self._boarded: dict[str, tuple[Board, list[RuleState]]] = {}  # run folder -> rules that wrote it this step

    def close(self) -> None:
        """Close the sinks (at `remove()`); never raises, so `remove()` never does."""
        for (key, _), sink in self._logs.items():
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - JsonLines.close does not raise; a sink that does is one line
                log.error("hookpolicy: %s/%s: closing its log failed: %s: %s", *key, type(exc).__name__, exc)
        self.alerts.close()
        for folder, error in self.boards.close():
            log.error("hookpolicy: closing the TensorBoard run %s failed: %s: %s", folder, type(error).__name__, error)

    def sink(self, report: StepReport, rs: RuleState, write: Callable[[], object]) -> bool:
        """Run one write of a sink of `rs`: the one containment of every sink. False when it failed or `rs` is off."""
        if report.off(rs):
            return False
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - containment is the point
            self.fault(report, rs, exc)
            return False
        return True

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
            if not self.sink(report, rs, lambda: self._write_tensor(rs, index, action, entry, step, module, name, tensor)):
                return

    def _write_tensor(
        self, rs: RuleState, index: int, action: Capture, entry: Entry, step: int, module: str, name: str,
        tensor: torch.Tensor,
    ) -> None:
        writer = self._writers.get((rs.key, index))
        if writer is None:
            assert action.tensors is not None
            writer = self._writers[(rs.key, index)] = TensorWriter(self._root, action.tensors)
        if writer.spent:
            return
        stem = f"step{step:08d}-{module or 'root'}-{entry.target}" + (f"-{name}" if name else "")
        try:
            writer.write(stem.replace("/", "_") + ".pt", tensor.cpu())
        except BudgetSpent as exc:
            log.warning("%s/%s: %s; no more tensor files are written", *rs.key, str(exc))

    def write_board(
        self, rs: RuleState, index: int, write: Callable[[Board], None], report: StepReport,
    ) -> bool:
        """Write to a capture's TensorBoard run (flushed by `flush_boards` at the end of the step). False when it failed."""
        action = rs.rule.actions[index]
        assert isinstance(action, Capture) and action.tensorboard is not None
        board = action.tensorboard
        if not self.sink(report, rs, lambda: write(board)):
            return False
        self._boarded.setdefault(board.dir, (board, []))[1].append(rs)
        return True

    def flush_boards(self, report: StepReport) -> None:
        """Flush each TensorBoard run written this step; a run that cannot is a fault of every rule that wrote it."""
        boarded, self._boarded = self._boarded, {}
        for board, rules in boarded.values():
            for rs in {id(rs): rs for rs in rules}.values():
                if self.sink(report, rs, lambda: self.boards.flush(board)):
                    break  # flushed: the run holds every rule's writes

    def write_log(
        self, rs: RuleState, index: int, sink: Optional[LogSink], records: list[dict[str, Any]], report: StepReport,
    ) -> bool:
        """Append one step's records to a capture's JSON lines (by action index; -1: the alert stream, `AlertStream`).
        False when the write failed."""
        def write() -> None:
            if index < 0:
                self.alerts.write(records)
                return
            writer = self._logs.get((rs.key, index))
            if writer is None:
                writer = self._logs[(rs.key, index)] = JsonLines(self._root, sink)
            writer.write(records)
            self.alerts.beside.started(sink)  # after: a log that cannot be written is the fault said

        return self.sink(report, rs, write)


#: Readable alert lines printed per (policy, rule, severity) before the rest are only counted.
MAX_ALERT_LINES = 10


class AlertStream:
    """Where alert records go: stderr, as one readable `hookpolicy:` line each (`text`) or
    as JSON lines (`json`, HOOKPOLICY_LOG_FORMAT), and every record as a JSON line to the
    files kept beside the capture logs (`AlertFiles`) and, with HOOKPOLICY_ALERT_LOG, to that
    file too.

    In `text`, a rule's alerts of one severity are printed up to MAX_ALERT_LINES times,
    then one line says that the rest are counted, not printed (`hookpolicy_alerts_total`,
    the run summary; the JSON outputs keep every record): a guard that fires on every
    module at every step must not bury the script's own output.
    """

    def __init__(self, form: str, copy: Optional[str], beside: Optional[AlertFiles] = None) -> None:
        self.form = form
        self.beside = beside or AlertFiles(Path.cwd(), (), 0)
        self._stderr = JsonLines(Path.cwd(), None)
        self._copy: Optional[JsonLines] = None
        if copy is not None:
            self._copy = JsonLines(Path(copy).parent.resolve(), LogSink(path=Path(copy).name))
        self._printed: dict[tuple[str, str, str], int] = {}

    def write(self, records: list[dict[str, Any]]) -> None:
        if self._copy is not None:
            self._copy.write(records)
        if self.form == "json":
            self._stderr.write(records)
        else:
            for record in records:
                key = (str(record["policy"]), str(record["rule"]), str(record["severity"]))
                printed = self._printed[key] = self._printed.get(key, 0) + 1
                if printed <= MAX_ALERT_LINES:
                    log.log(*alert_line(record))
                if printed == MAX_ALERT_LINES:
                    log.log(alert_line(record)[0], "%s %s/%s: %d alert lines printed; the rest are counted "
                            "(hookpolicy_alerts_total, the run summary), not printed", key[2].upper(), key[0],
                            key[1], MAX_ALERT_LINES)
        self.beside.write(records)  # after stderr: a file that cannot be written does not hide the alert

    def close(self) -> None:
        if self._copy is not None:
            self._copy.close()
        self.beside.close()
