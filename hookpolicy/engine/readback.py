"""The once-per-step readback: buffered device partials in, statistics and decisions out.

The hook bodies leave `Entry` objects (small partial matrices, still on the device) in
the step's ledger. At a step boundary `Readback.run` fetches all of them with one transfer per
device, finishes the statistics per group (`per: tensor | module | rule`), publishes
them to the metrics store, writes the JSON-lines and tensor-file sinks, evaluates the
alerts with their `for:` streaks, and returns the step's decision: skip it, halt, or go
on. Nothing here runs inside a hook, and nothing here calls back into the runtime: the
outcome is a `StepReport` (skip? halt? which rules' sinks failed? time spent per rule)
that the step cycle acts on. The read-back owns the log and tensor-file sinks.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from .actions import StatsOp
from ..errors import Halt
from ..export.metrics import ALERT_FIRING, ALERTS, CLIPPED, ModelMetrics, Labels, stat_family
from ..policy.expr import NO_PAST, Past, Template
from ..policy.model import Alert, Board, Capture, Clip, LogSink, Policy
from ..export.sinks import BudgetSpent, JsonLines, TensorWriter
from ..export.tensorboard import Boards, histogram_tag, scalar_tag
from .rulestate import MAX_ERRORS, RuleState
from .distributed import reduce_shards
from .history import History, Observation, Tracked, group_key
from .ledger import ClipEntry, Entry
from .stats import combine, finish, resolve_counts

__all__ = ["Readback", "StepReport"]

log = logging.getLogger("hookpolicy")

@dataclass
class StepReport:
    """What one read-back decided, for the coordinator to act on."""

    skip: bool = False
    #: the first rule whose alert skips the step (named to the other ranks, see agreement.py)
    skip_rule: Optional[tuple[str, str]] = None
    #: the rules whose alerts skip the step (each counts the step once, however many modules fired)
    skip_by: list[tuple[str, str]] = field(default_factory=list)
    #: the first alert with `then: halt` in enforce mode
    halt: Optional[Halt] = None
    #: sinks that could not write, in order: each is a fault of its rule, handled by `onError`
    errors: list[tuple[RuleState, Exception]] = field(default_factory=list)
    #: time spent per rule, for `hookpolicy_hook_seconds_total`
    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    #: what was evaluated against a history, appended to it (`History.commit`) unless the step is skipped
    observed: list[Observation] = field(default_factory=list)

    def off(self, rs: RuleState) -> bool:
        """Whether `rs` is switched off, counting the errors this report still has to hand over."""
        return rs.errors + sum(1 for r, _ in self.errors if r is rs) >= MAX_ERRORS


class _SinkHalts(Exception):
    """A sink of a rule with `onError: halt` failed: the read-back stops there."""


class Readback:
    """Turns a step's buffered entries into metrics, log records, tensor files and a `StepReport`."""

    def __init__(
        self, store: ModelMetrics, policies: Sequence[Policy], root: Path, rank: int, history: History,
    ) -> None:
        self.store = store
        self.rank = rank
        self.history = history
        self._root = root
        self._max_series = {p.name: p.max_series for p in policies}
        self._streaks: dict[tuple[Any, ...], int] = {}
        self._writers: dict[tuple[tuple[str, str], int], TensorWriter] = {}
        self._logs: dict[tuple[tuple[str, str], int], JsonLines] = {}
        self._last: dict[str, dict[Labels, float]] = defaultdict(dict)
        self._step = 0
        self.boards = Boards(root, rank)

    def last_values(self) -> Mapping[str, Mapping[Labels, float]]:
        """A read-only copy of the latest value of every statistic series published so far."""
        return MappingProxyType({family: MappingProxyType(dict(series)) for family, series in self._last.items()})

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

    def run(self, entries: Sequence[Union[Entry, ClipEntry]], step: int, final: bool) -> StepReport:
        """Report one step's entries and decide the step.

        `final` (at `remove()`) publishes what is left but takes no skip or halt decision.
        A sink error of a rule with `onError: halt` ends the read-back at that point.
        """
        report = StepReport()
        try:
            self._run(entries, step, final, report)
        except _SinkHalts:
            pass
        return report

    def _run(self, buffered: Sequence[Union[Entry, ClipEntry]], step: int, final: bool, report: StepReport) -> None:
        start = time.perf_counter()
        self._step = step
        passes: dict[tuple[tuple[str, str], int], _Pass] = {}
        entries = [e for e in buffered if isinstance(e, Entry)]
        clips = [e for e in buffered if isinstance(e, ClipEntry)]
        entries = _drop_shards(entries) if final else entries
        try:
            fetched = _fetch(_full_matrices(entries) + [c.matrix for c in clips])
        except Exception as exc:  # noqa: BLE001 - the step's statistics are lost, the training is not
            for rs in {id(rs): rs for rs in [e.rule for e in entries] + [c.rule for c in clips]}.values():
                self._fault(report, rs, exc)
            return
        for clip, rows in zip(clips, fetched[len(entries):]):
            self._report_clip(clip, rows, report)
        for entry, rows in zip(entries, fetched):
            if entry.deferred is not None:
                resolve_counts(rows, entry.deferred, entry.op.kinds)
                entry.deferred = None
            pkey = (entry.rule.key, entry.op.segment)
            pass_ = passes.get(pkey)
            if pass_ is None:
                pass_ = passes[pkey] = _Pass(entry.rule, entry.op, entry.target)
            pass_.add(entry, rows)
        fetch_share = (time.perf_counter() - start) / max(1, len(passes))  # the transfer serves every pass
        published: dict[tuple[str, tuple[str, ...]], float] = {}
        now = time.time()
        for p in passes.values():
            pass_start = time.perf_counter()
            try:
                self._report_pass(p, now, final, published, report)
            except _SinkHalts:
                raise
            except Exception as exc:  # noqa: BLE001 - a fault of this rule (a bug, a message), never of the training
                self._fault(report, p.rule, exc)
            report.seconds[p.rule.key] += fetch_share + time.perf_counter() - pass_start
        for entry in entries:
            if entry.copies:
                self._write_copies(entry, report)
        self.store.set_stats(published, self._max_series)
        for (family, labels), value in published.items():
            self._last[family][labels] = value
        self.boards.flush()

    def _report_pass(
        self, p: "_Pass", now: float, final: bool, published: dict[tuple[str, tuple[str, ...]], float],
        report: StepReport,
    ) -> None:
        """Publish, log and decide one rule's statistics pass into `report`."""
        rs = p.rule
        firing: dict[str, bool] = {}
        logged: dict[tuple[int, Optional[LogSink]], list[dict[str, Any]]] = defaultdict(list)  # one write per sink
        boarded: dict[int, list[tuple[str, float]]] = defaultdict(list)
        for index, action in p.op.actions:
            for (module, tensor), stats in p.statistics(action.per):
                base = {"time": now, "step": self._step, "rank": self.rank, "model": self.store.model,
                        "policy": rs.policy.name,
                        "rule": rs.rule.name, "module": module, "target": p.target, "tensor": tensor}
                if isinstance(action, Capture):
                    for stat in action.stats:
                        published[(stat_family(p.target, stat), (*rs.key, module, tensor))] = stats[stat]
                    if action.log is not None:
                        shown = {s: _json_number(stats[s]) for s in action.stats}
                        logged[(index, action.log)].append({**base, "stats": shown})
                    if action.tensorboard is not None:
                        boarded[index] += [(scalar_tag(*rs.key, p.target, s, module, tensor), stats[s])
                                           for s in action.stats]
                    continue
                tracked = self._observe(rs, index, action, module, tensor, stats, report)
                fired = self._evaluate_alert(rs, index, action, module, tensor, stats, tracked)
                past = None if tracked is None else tracked.past(module, tensor)
                firing[action.severity] = firing.get(action.severity, False) or fired
                if not fired:
                    continue
                applied = rs.enforce and not final
                outcome = _outcome(action.then, applied, rs.mode)
                message = _render(action, {**base, "outcome": outcome}, stats, applied, past or NO_PAST)
                self.store.inc(ALERTS, (*rs.key, action.severity))
                logged[(-1, None)].append({
                    **base, "stats": {k: _json_number(v) for k, v in stats.items()}, "event": "alert",
                    "severity": action.severity, "then": action.then, "mode": rs.mode, "outcome": outcome,
                    "message": message,
                })
                if rs.enforce and not final:
                    if action.then == "skip_step" and rs.key not in report.skip_by:
                        report.skip = True
                        report.skip_rule = report.skip_rule or rs.key
                        report.skip_by.append(rs.key)  # counted once per step and rule, once agreed on
                    elif action.then == "halt" and report.halt is None:
                        report.halt = Halt(rs.policy.name, rs.rule.name, self._step, message)
        for (index, sink), records in logged.items():
            self._write_log(rs, index, sink, records, report)
        for index, scalars in boarded.items():
            self._write_board(rs, index, lambda board: self.boards.scalars(board, self._step, scalars), report)
        for severity, on in firing.items():
            self.store.set(ALERT_FIRING, (*rs.key, severity), 1.0 if on else 0.0)

    def _report_clip(self, entry: ClipEntry, rows: list[list[float]], report: StepReport) -> None:
        """Count what a clip clipped (or would have); feed an adaptive clip's norm history."""
        rs = entry.rule
        action = rs.rule.actions[entry.index]
        clipped: dict[str, float] = defaultdict(float)
        for (module, tensor), (norm, count), limit in zip(entry.rows, rows, entry.limits):
            clipped[module] += count
            if isinstance(action, Clip) and action.adaptive is not None:
                tracked = self.history.tracking(rs.key, entry.index, ("norm",), action.calls, action.warmup)
                effective = norm if limit is None else min(norm, limit)
                report.observed.append(tracked.observe(module, tensor, {"norm": effective}))
        for module, count in clipped.items():
            self.store.inc(CLIPPED, (*rs.key, module, rs.mode), count)

    def _observe(
        self, rs: RuleState, index: int, action: Alert, module: str, tensor: str, stats: dict[str, float],
        report: StepReport,
    ) -> Optional[Tracked]:
        """The history of an alert that keeps one (None for one that does not); its values go to `report`."""
        if not action.remembers:
            return None
        tracked = self.history.tracking(rs.key, index, action.stats, action.calls, action.warmup)
        report.observed.append(tracked.observe(module, tensor, stats))
        return tracked

    def _evaluate_alert(
        self, rs: RuleState, index: int, action: Alert, module: str, tensor: str, stats: dict[str, float],
        tracked: Optional[Tracked],
    ) -> bool:
        """Whether the alert fires: its condition held `for:` evaluations in a row, after its warmup."""
        if tracked is None:
            holds = action.condition.evaluate(stats)
        else:
            holds = tracked.ready(module, tensor) and action.condition.evaluate(stats, tracked.past(module, tensor))
        key = (rs.key, index, module, tensor)
        streak = self._streaks.get(key, 0) + 1 if holds else 0
        self._streaks[key] = streak
        return streak >= action.for_

    def _fault(self, report: StepReport, rs: RuleState, exc: Exception) -> None:
        report.errors.append((rs, exc))
        if rs.policy.on_error == "halt":
            raise _SinkHalts()

    def _write_copies(self, entry: Entry, report: StepReport) -> None:
        rs = entry.rule
        if report.off(rs):
            return
        for index, module, name, tensor in entry.copies:
            action = rs.rule.actions[index]
            assert isinstance(action, Capture)
            board = action.tensorboard
            if board is not None and board.histograms:
                tag = histogram_tag(*rs.key, entry.target, module, name)
                if not self._write_board(
                    rs, index, lambda b: self.boards.histogram(b, self._step, tag, tensor), report,
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
                stem = f"step{self._step:08d}-{module or 'root'}-{entry.target}" + (f"-{name}" if name else "")
                writer.write(stem.replace("/", "_") + ".pt", tensor.cpu())
            except BudgetSpent as exc:
                log.warning("%s/%s: %s; no more tensor files are written", *rs.key, str(exc))
            except Exception as exc:  # noqa: BLE001 - a full disk, a read-only folder, an unsafe path
                self._fault(report, rs, exc)
                return

    def _write_board(
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
            self._fault(report, rs, exc)
            return False
        return True

    def _write_log(
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
            self._fault(report, rs, exc)


def _full_matrices(entries: Sequence[Entry]) -> list[torch.Tensor]:
    """Every entry's matrix, sharded rows reduced to the full tensors' partials (collectives on their meshes)."""
    matrices = [e.matrix for e in entries]
    sharded = [i for i, e in enumerate(entries) if e.shards is not None]
    if sharded:
        reduced = reduce_shards([(e.matrix, e.op.kinds, e.shards, e.numels) for e in entries if e.shards is not None])
        for i, matrix in zip(sharded, reduced):
            matrices[i] = matrix
    return matrices


def _drop_shards(entries: list[Entry]) -> list[Entry]:
    """At `remove()`, the entries that need no collective: the other ranks may be gone, or elsewhere."""
    kept = [e for e in entries if e.shards is None]
    if len(kept) < len(entries):
        log.info("statistics of sharded tensors from an unfinished step are not published at detach")
    return kept


def _fetch(matrices: Sequence[torch.Tensor]) -> list[list[list[float]]]:
    """Every matrix as nested lists, with one device-to-host transfer per device."""
    out: list[list[list[float]]] = [[] for _ in matrices]
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, m in enumerate(matrices):
        by_device[m.device].append(i)
    for indices in by_device.values():
        flat = torch.cat([matrices[i].reshape(-1) for i in indices]).tolist()
        pos = 0
        for i in indices:
            rows, cols = matrices[i].shape
            out[i] = [flat[pos + r * cols: pos + (r + 1) * cols] for r in range(rows)]
            pos += rows * cols
    return out


class _StatFormat(dict[str, Any]):
    def __missing__(self, key: str) -> float:
        return math.nan


#: A rendered alert message is cut to this many characters: the template and its widths are
#: bounded at check time, a module name (the one field of unbounded length) is not.
MAX_RENDERED_CHARS = 4096


def _outcome(then: str, applied: bool, mode: str) -> str:
    """What an alert's `then` did this time, in words: a message must not claim a skip that did not happen."""
    if then == "log":
        return "logged"
    done = "step skipped" if then == "skip_step" else "halting"
    if applied:
        return done
    undone = "step not skipped" if then == "skip_step" else "not halted"
    return f"{undone} ({'audit mode' if mode == 'audit' else 'the policy was being removed'})"


def _render(
    action: Alert, base: dict[str, Any], stats: dict[str, float], applied: bool = True, past: Past = NO_PAST,
) -> str:
    """The alert's message; when its `then` did not take effect and the template does not
    say so through `{outcome}`, the outcome is appended, so no message claims an effect that
    did not happen (a shipped "...; step skipped" under `--audit`). Expression fields
    (`{zscore(loss, 100):.1f}`) are evaluated against the same past as the condition."""
    fields = _StatFormat(base, severity=action.severity, condition=action.source, **stats)
    fields["module"] = base["module"] or "<root>"
    message = Template(dict(action.fields), stats, past).vformat(action.message, (), fields)
    if action.then != "log" and not applied and "outcome" not in action.message:
        message += f" [{base['outcome']}]"
    return message if len(message) <= MAX_RENDERED_CHARS else message[: MAX_RENDERED_CHARS - 1] + "…"


def _json_number(value: float) -> Union[float, int]:
    """Counts print as ints; NaN and Inf stay floats (JSON `NaN`/`Infinity`), never hidden."""
    if value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


class _Pass:
    """One statistics pass of one rule over a step: rows grouped by `per`, ready to finish."""

    def __init__(self, rule: RuleState, op: StatsOp, target: str) -> None:
        self.rule, self.op, self.target = rule, op, target
        self._groups: dict[str, dict[tuple[str, str], tuple[list[list[float]], list[int]]]] = {
            a.per: {} for _, a in op.actions
        }

    def add(self, entry: Entry, rows: list[list[float]]) -> None:
        for (module, tensor), row, n in zip(entry.rows, rows, entry.numels):
            for per, groups in self._groups.items():
                bucket = groups.setdefault(group_key(module, tensor, per), ([], []))
                bucket[0].append(row)
                bucket[1].append(n)

    def statistics(self, per: str) -> Iterable[tuple[tuple[str, str], dict[str, float]]]:
        for key, (rows, numels) in self._groups[per].items():
            yield key, finish(combine(rows, numels, self.op.kinds), sum(numels), self.op.stats)
