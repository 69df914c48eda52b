"""The once-per-step readback: buffered device partials in, statistics and decisions out.

The hook bodies leave `Entry` objects (small partial matrices, still on the device) in
the step's ledger. At a step boundary `Readback.read` fetches all of them with one transfer per
device, finishes the statistics per group (`per: tensor | module | rule`, `passes`), has the alerts
evaluated (`alerts`) and the sinks written (`writers`), and returns the step's decision so
far (skip it, halt, heal, or go on) in a `Reading`, whose statistics are not published yet.
The step cycle agrees on that decision with the other ranks, then hands the read-back what
the agreement reduced (the job's loss, the `ranks: job` statistics: host-side entries, no
transfer) with `Readback.add`, and `Readback.publish` puts every statistic of the step into
the metrics store at once: one read-back a step, one admission order under `maxSeries` and
`maxJobSeries` (`store.MetricsStore.set_stats`: the job's series first, then each rank's, in
the order they were read); the captures of a pass that only export, once the store holds all
their series, are handed over unfinished instead (`store.MetricsStore.swap_in`; the pass's
alerts are judged at the step all the same). Nothing here runs inside a hook, and nothing here calls back
into the step cycle: the outcome is a `StepReport` (skip? halt? which rules' sinks failed?
time spent per rule) that the step cycle acts on.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from itertools import chain
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence, Union, cast

import torch

from ...environment import run_id
from ...export.metrics import ALERT_FIRING, ALERTS, CLIPPED, Labels
from ...export.store import ModelMetrics
from ...export.tensorboard import scalar_tag
from ...policy.model import Capture, Clip, LogSink, Policy, rule_name
from .alerts import Alerts, SinkHalts, StepReport, bounded_skips, fire, json_number, settled
from ..measure.distributed import reduce_shards
from ..measure.history import History
from ..execute.ledger import ClipEntry, Entry
from ...process import Once
from .replicas import Export, job_world
from ..measure.rulestate import RuleState
from ..measure.stats import resolve_counts
from .passes import Finished, Layout
from .recorder import Recorder
from .writers import Writers

__all__ = ["Reading", "Readback", "StepReport"]

#: one statistics pass of a read-back: (rule key, the pass's segment in the rule's program)
PassKey = tuple[tuple[str, str], int]

log = logging.getLogger("hookpolicy")


class Readback:
    """Turns a step's buffered entries into metrics, log records, tensor files and a `StepReport`."""

    def __init__(
        self, store: ModelMetrics, policies: Sequence[Policy], root: Path, rank: int, history: History,
        exported: Callable[[RuleState, Capture], Export] = lambda rs, capture: Export.RANK,
    ) -> None:
        self.store = store
        #: whose a capture's series are at this step, and whether this rank exports them (`replicas.Replicas.exported`)
        self.exported = exported
        self._withheld: set[tuple[str, Labels]] = set()  # series this rank leaves to rank 0 and dropped
        self.rank = rank
        self.history = history
        self._policies = {p.name: p for p in policies}  # their series limits
        self._said_limits = Once()  # (rule key, action index): clips whose device limit was not usable
        self._alerts = Alerts(history)
        self._last: dict[str, dict[Labels, float]] = defaultdict(dict)
        self._layouts: dict[PassKey, Layout] = {}  # per pass (rule, segment): its last layout
        #: passes handed over unfinished: swapped into the store, and not yet written to `_last`
        self._in_store: set[PassKey] = set()
        self._unread: dict[PassKey, Finished] = {}
        self.writers = Writers(root, rank, policies)
        #: the run every record carries (`environment.run_id`): `hookpolicy report` tells appended runs apart
        self.run_id = run_id(os.environ)
        #: the rings of the captures with `keep`, and their dumps (`recorder`)
        self.recorder = Recorder(root, rank, store.model, self.run_id, policies, store.wrote)

    def last_values(self) -> Mapping[str, Mapping[Labels, float]]:
        """A read-only copy of the latest value of every statistic series published so far."""
        for finished in self._unread.values():
            self._remember(finished)
        self._unread.clear()
        return MappingProxyType({family: MappingProxyType(dict(series)) for family, series in self._last.items()})

    def bounded(self, report: StepReport, rules: Mapping[tuple[str, str], RuleState]) -> None:
        """Once the alerts that fired at the step are agreed on (`report.fired`): its bounded skips (`Alerts.bounded`)."""
        report.bounded = self._alerts.bounded(report.fired, rules)

    def bounded_skips(self, report: StepReport, healed: Mapping[tuple[tuple[str, str], int], str]) -> None:
        """Once the step's heal is decided: the skips held back past `max_in_a_row` (`alerts.bounded_skips`)."""
        bounded_skips(self._alerts, report, healed)

    def restart_streaks(self) -> None:
        """After a rewind: every alert's `for:` count starts again (`Alerts.restart`)."""
        self._alerts.restart()

    def close(self) -> None:
        """Write the dumps still waiting and close the sinks (at `remove()`); never raises, so `remove()` never does."""
        try:
            self.recorder.close(lambda rs, write: self.writers.sink(StepReport(), rs, write))
        except Exception as exc:  # noqa: BLE001 - a dump at detach that cannot be written is one line, never a raise
            log.error("hookpolicy: writing the flight recorder's dumps at detach failed: %s: %s", type(exc).__name__, exc)
        self.writers.close()

    def read(
        self, entries: Sequence[Union[Entry, ClipEntry]], step: int, final: bool,
        hold: Optional[Callable[[RuleState], bool]] = None,
    ) -> "Reading":
        """Fetch and evaluate one step's entries; nothing is published until `publish`.

        `final` (at `remove()`) reads what is left but takes no skip or halt decision.
        The entries of rules `hold` names are fetched with the others but not evaluated:
        they go to `StepReport.held` (`ranks: job` statistics, reduced across ranks first).
        A sink error of a rule with `onError: halt` ends the read-back at that point.
        """
        reading = Reading(step, final, job_world(), self.store.generation())
        self._evaluate(reading, entries, hold, decides=True)
        return reading

    def add(self, reading: "Reading", entries: Sequence[Union[Entry, ClipEntry]], decides: bool) -> None:
        """Evaluate what the step's agreement reduced (host-side entries) into the same read-back.

        Their alerts fire, log and take their place among the step's records; their skip,
        halt and heals count only when `decides` (every rank holds the same rules).
        """
        self._evaluate(reading, entries, None, decides)

    def publish(self, reading: "Reading") -> StepReport:
        """Publish every statistic `reading` evaluated, in one admission, write its tensor copies; its report."""
        report = reading.report
        if reading.stopped:
            return report
        try:
            for entry in reading.copies:
                self.writers.write_copies(entry, reading.step if entry.step is None else entry.step, report)
            handed = self._hand_over(reading)
            self._export(reading.published, reading.jobs)
            for (family, labels), value in reading.published.items():
                self._last[family][labels] = value
            self._unread.update(handed)
            for layout in reading.ask:
                held = self.store.holding(layout.store_keys, self._policies, reading.world)
                layout.checked = (self.store.generation() if held is None else held, reading.world)
                layout.held = held is not None
            self.writers.flush_boards(report)
        except SinkHalts:
            reading.stopped = True
        return report

    def _evaluate(
        self, reading: "Reading", buffered: Sequence[Union[Entry, ClipEntry]],
        hold: Optional[Callable[[RuleState], bool]], decides: bool,
    ) -> None:
        """Fetch `buffered` (one transfer per device) and evaluate it into `reading`; a sink's halt stops it."""
        if reading.stopped:
            return
        try:
            self._evaluate_entries(reading, buffered, hold, decides)
        except SinkHalts:
            reading.stopped = True

    def _evaluate_entries(
        self, reading: "Reading", buffered: Sequence[Union[Entry, ClipEntry]],
        hold: Optional[Callable[[RuleState], bool]], decides: bool,
    ) -> None:
        start = time.perf_counter()
        step, final, report = reading.step, reading.final, reading.report
        passes: dict[PassKey, tuple[list[Entry], list[list[list[float]]]]] = {}  # each pass's entries and their rows
        entries: list[Entry] = []
        clips: list[ClipEntry] = []
        for e in buffered:
            if isinstance(e, Entry):
                entries.append(e)
            else:
                clips.append(e)
        entries = _drop_shards(entries) if final else entries
        try:
            fetched = _fetch(_full_matrices(entries) + [c.matrix for c in clips])
        except Exception as exc:  # noqa: BLE001 - the step's statistics are lost, the training is not
            for rs in {id(rs): rs for rs in [e.rule for e in entries] + [c.rule for c in clips]}.values():
                self.writers.fault(report, rs, exc)
            return
        for clip, rows in zip(clips, fetched[len(entries):]):
            self._report_clip(clip, rows, step, report)
        for entry, rows in zip(entries, fetched):
            if entry.deferred is not None:
                resolve_counts(rows, entry.deferred, entry.op.kinds)
                entry.deferred = None
            if hold is not None and hold(entry.rule):
                report.held.append((entry, rows))
                continue
            pkey = (entry.rule.key, entry.op.segment)
            group = passes.get(pkey)
            if group is None:
                passes[pkey] = ([entry], [rows])
            else:
                group[0].append(entry)
                group[1].append(rows)
        fetch_share = (time.perf_counter() - start) / max(1, len(passes))  # the transfer serves every pass
        for pkey, (in_pass, rows_of) in passes.items():
            pass_start = time.perf_counter()
            p = self._finished(pkey, in_pass, rows_of, step)
            try:
                if final or not self._handing(pkey, p, reading):
                    self._settle(pkey, reading)
                    self._report_pass(p, reading, decides)
                elif not p.layout.exports_only:  # its captures handed over, its alerts judged now
                    self._report_pass(p, reading, decides, captures=False)
            except SinkHalts:
                raise
            except Exception as exc:  # noqa: BLE001 - a fault of this rule (a bug, a message), never of the training
                self.writers.fault(report, p.layout.rule, exc)
            report.seconds[p.layout.rule.key] += fetch_share + time.perf_counter() - pass_start
        reading.copies.extend(entry for entry in entries if entry.copies)

    def _finished(self, pkey: PassKey, entries: list[Entry], rows_of: list[list[list[float]]], step: int) -> Finished:
        """One pass's rows (`rows_of`: each entry's) under its layout (the last one while it fits)."""
        layout = self._layouts.get(pkey)
        if layout is None or not layout.fits(entries):
            layout = self._layouts[pkey] = Layout(entries)
            layout.store_keys = [self.store.key(k) for k in layout.keys]
        rows = rows_of[0] if len(rows_of) == 1 else list(chain.from_iterable(rows_of))
        return Finished(layout, rows, step if entries[0].step is None else entries[0].step)

    def _handing(self, pkey: PassKey, p: Finished, reading: "Reading") -> bool:
        """Whether the captures of a pass that only export (`Layout.hands_over`) are handed over at `publish`
        (the store holds all their series); True if so: the read-back then judges only the pass's alerts.

        This rank's own series only (the job's are counted and withheld by `set_stats`); a
        layout the store has not answered for at this generation and world is asked about
        once the step's statistics are published (`Reading.ask`), so its next step may be.
        """
        layout = p.layout
        if not layout.hands_over:
            return False
        if reading.world > 1 and any(isinstance(a, Capture) and self.exported(layout.rule, a) is not Export.RANK
                                     for _, a in layout.op.actions):  # alone, every series is this rank's
            return False
        if layout.checked != (reading.generation, reading.world):
            reading.ask.append(layout)
            return False
        if not layout.held:
            return False
        reading.handed[pkey] = p
        return True

    def _hand_over(self, reading: "Reading") -> dict[PassKey, Finished]:
        """Swap the passes `reading` hands over into the store; one the store refuses (a series was forgotten
        meanwhile) is finished now and published with the others."""
        handed: dict[PassKey, Finished] = {}
        for pkey, p in reading.handed.items():
            if self.store.swap_in(pkey, p.layout.store_keys, p, reading.generation):
                self._in_store.add(pkey)
                handed[pkey] = p
            else:
                reading.published.update(zip(p.layout.keys, p.values()))
        return handed

    def _settle(self, pkey: PassKey, reading: "Reading") -> None:
        """Before a pass publishes with the step: write what it handed over before (its series may differ now)."""
        if pkey in self._in_store:
            self._in_store.discard(pkey)
            self.store.settle(pkey)
        finished = self._unread.pop(pkey, None)
        if finished is not None:
            self._remember(finished)
        finished = reading.handed.pop(pkey, None)  # handed over by `read`, evaluated again by `add`
        if finished is not None:
            reading.published.update(zip(finished.layout.keys, finished.values()))

    def _remember(self, finished: Finished) -> None:
        """Write a pass handed over to the latest values (`last_values`)."""
        for (family, labels), value in zip(finished.layout.keys, finished.values()):
            self._last[family][labels] = value

    def _export(self, published: dict[tuple[str, Labels], float], jobs: dict[tuple[str, Labels], Export]) -> None:
        """Publish the step's statistics this rank exports; drop those it leaves to rank 0 (`replicas`).

        Every statistic goes to the store, which counts the job's series against
        `maxJobSeries` on every rank alike, exported here or not.
        """
        if not published and not jobs:  # every pass handed over: nothing to admit, drop or write
            return
        withheld = {k for k, whose in jobs.items() if whose in (Export.BY_RANK_0, Export.NOT_NOW)}
        self.store.set_stats(published, self._policies, job_world(), jobs.keys(), withheld)
        gone = [k for k, whose in jobs.items() if whose is Export.BY_RANK_0 and k not in self._withheld]
        if gone:
            self.store.forget_series(gone)
            self._withheld.update(gone)
        if self._withheld:
            self._withheld.difference_update(k for k in published if k not in withheld)

    def _report_pass(self, p: Finished, reading: "Reading", decides: bool, captures: bool = True) -> None:
        """Log and decide one rule's statistics pass into `reading` (its statistics published with the step's);
        its alerts only when its `captures` were handed over (`_handing`)."""
        rs, final, report = p.layout.rule, reading.final, reading.report
        firing: dict[str, bool] = {}
        logged: dict[tuple[int, Optional[LogSink]], list[dict[str, Any]]] = defaultdict(list)  # one write per sink
        boarded: dict[int, list[tuple[str, float]]] = defaultdict(list)
        for index, action in p.layout.op.actions:
            if not isinstance(action, Capture):
                for group, ((module, tensor), stats) in enumerate(p.judged(action.per, action.stats)):
                    fired, past = self._alerts.judge(rs, index, action, module, tensor, stats, report.observed)
                    if not fired:
                        firing.setdefault(action.severity, False)
                        continue
                    firing[action.severity] = True
                    stats = p.statistics(action.per)[group][1]  # its record carries every statistic of the pass
                    self.store.inc(ALERTS, (*rs.key, action.severity))
                    # its record is written once the step is decided (`settle`): what its `then` did is known only then
                    held = (rs.enforce and not final and decides and action.then == "skip_step"
                            and self._alerts.holds_back(rs, index, action))
                    fire(report, rs, index, action, self._base(reading, p, module, tensor), stats, past, final,
                         decides, held)
            elif captures:
                self._report_capture(p, reading, index, action, logged, boarded)
        for (index, sink), records in logged.items():
            if self.writers.write_log(rs, index, sink, records, report) and sink is not None:
                self.store.wrote(rs.key, sink.path or "", len(records))  # for the run summary
        for index, scalars in boarded.items():
            self.writers.write_board(rs, index, lambda board: self.writers.boards.scalars(board, p.step, scalars), report)
        for severity, on in firing.items():
            self.store.set(ALERT_FIRING, (*rs.key, severity), 1.0 if on else 0.0)

    def _report_capture(
        self, p: Finished, reading: "Reading", index: int, action: Capture,
        logged: dict[tuple[int, Optional[LogSink]], list[dict[str, Any]]], boarded: dict[int, list[tuple[str, float]]],
    ) -> None:
        """One capture of a pass read back at the step: its ring, its series, its log records and scalars."""
        rs, now, published, jobs = p.layout.rule, reading.now, reading.published, reading.jobs
        # alone (a world of one), every series is this rank's own
        whose = self.exported(rs, action) if reading.world > 1 else Export.RANK
        series = p.layout.series(index, action) if action.exports else None
        for group, ((module, tensor), stats) in enumerate(p.statistics(action.per)):
            if action.keep is not None:
                self.recorder.keep(rs, index, action, p.step, now, module, tensor, stats)
            if series is not None:
                for stat, key in series[group]:
                    published[key] = stats[stat]
                    if whose is not Export.RANK:
                        jobs[key] = whose
            if action.log is not None:
                shown = {s: json_number(stats[s]) for s in action.stats}
                logged[(index, action.log)].append({**self._base(reading, p, module, tensor), "stats": shown})
            if action.tensorboard is not None:
                boarded[index] += [(scalar_tag(*rs.key, p.layout.target, s, module, tensor), stats[s])
                                   for s in action.stats]

    def _base(self, reading: "Reading", p: Finished, module: str, tensor: str) -> dict[str, Any]:
        """The fields every record of one group of a pass carries."""
        rs = p.layout.rule
        return {"run": self.run_id, "time": reading.now, "step": p.step, "rank": self.rank, "model": self.store.model,
                "policy": rs.policy.name, "rule": rs.rule.name, "module": module, "target": p.layout.target,
                "tensor": tensor}

    def settle(
        self, report: StepReport, healed: Mapping[tuple[tuple[str, str], int], str], decided: bool,
        step: Optional[int] = None,
    ) -> list[tuple[RuleState, Exception]]:
        """Write the step's alert records (`report.pending`), in the order they fired, now that the step
        is `decided` (False: an evaluation forward's read-back, which decides no step). A record whose
        `then` was to act says what became of it: a skip or halt the ranks did not take, a cool-down or
        rewind the step did not take (`healed`: by rule and action index, from `Healing.decided`).
        At a decided `step`, the rings dump around the alerts that fired and write the dumps now complete
        (`recorder`). Returns the faults of these writes."""
        written = StepReport()
        batch: list[dict[str, Any]] = []
        records: list[dict[str, Any]] = []
        try:
            for i, pending in enumerate(report.pending):
                batch.append(settled(pending, report, healed, decided))
                following = report.pending[i + 1].rule if i + 1 < len(report.pending) else None
                if following is not pending.rule:  # one write per rule, as its pass wrote them
                    records += batch
                    self.writers.write_log(pending.rule, -1, None, batch, written)
                    batch = []
            if step is not None:  # the alerts that fired at this step on any rank (`StepReport.fired`, agreed)
                self.recorder.alerted(step, {rule_name(key[0]) for key in report.fired}, records)
                self.recorder.flush(lambda rs, write: self.writers.sink(written, rs, write), step)
        except SinkHalts:
            pass
        report.pending.clear()
        return written.errors

    def _report_clip(self, entry: ClipEntry, rows: list[list[float]], step: int, report: StepReport) -> None:
        """Count what a clip clipped (or would have); say a limit that was not usable; feed an adaptive clip's history."""
        rs = entry.rule
        action = rs.rule.actions[entry.index]
        clipped: dict[str, float] = defaultdict(float)
        for (module, tensor), (norm, count, unusable) in zip(entry.rows, rows):  # norm: as it left the clip
            clipped[module] += count
            if unusable and isinstance(action, Clip) and self._said_limits((rs.key, entry.index)):
                log.warning("%s/%s: max_norm %s was NaN or not positive at step %d for %s (its norm %g), so nothing "
                            "was clipped there; a threshold that is not a positive number never clips (said once)",
                            *rs.key, action.max_norm, step, module or "<root>", norm)
            if isinstance(action, Clip) and action.remembers:
                tracked = self.history.tracking(rs.key, entry.index, ("norm",), action.calls, action.warmup)
                report.observed.append(tracked.observe(module, tensor, {"norm": norm}))
        for module, count in clipped.items():
            self.store.inc(CLIPPED, (*rs.key, module, rs.mode), count)


def _full_matrices(entries: Sequence[Entry]) -> list[Union[torch.Tensor, list[list[float]]]]:
    """Every entry's matrix, sharded rows reduced to the full tensors' partials (collectives on their meshes)."""
    matrices = [e.matrix for e in entries]
    sharded = [i for i, e in enumerate(entries) if e.shards is not None]
    if sharded:
        reduced = reduce_shards([(cast(torch.Tensor, e.matrix), e.op.kinds, e.shards, e.numels)
                                 for e in entries if e.shards is not None])
        for i, matrix in zip(sharded, reduced):
            matrices[i] = matrix
    return matrices


def _drop_shards(entries: list[Entry]) -> list[Entry]:
    """At `remove()`, the entries that need no collective: the other ranks may be gone, or elsewhere."""
    kept = [e for e in entries if e.shards is None]
    if len(kept) < len(entries):
        log.info("statistics of sharded tensors from an unfinished step are not published at detach")
    return kept


def _fetch(matrices: Sequence[Union[torch.Tensor, list[list[float]]]]) -> list[list[list[float]]]:
    """Every matrix as nested lists, with one device-to-host transfer per device (rows read already are kept)."""
    out: list[list[list[float]]] = [[] for _ in matrices]
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for i, m in enumerate(matrices):
        if isinstance(m, list):
            out[i] = m
        else:
            by_device[m.device].append((i, m))
    for pairs in by_device.values():
        flat = torch.cat([m.reshape(-1) for _, m in pairs]).tolist()
        pos = 0
        for i, m in pairs:
            rows, cols = m.shape
            out[i] = [flat[pos + r * cols: pos + (r + 1) * cols] for r in range(rows)]
            pos += rows * cols
    return out


class Reading:
    """One read-back under way: the entries read so far, evaluated into `report`, their statistics not yet published."""

    def __init__(self, step: int, final: bool, world: int, generation: int) -> None:
        self.step, self.final = step, final
        #: the job's ranks and the store's generation when the read-back began: a pass is handed over for them
        self.world, self.generation = world, generation
        self.handed: dict[PassKey, Finished] = {}  # passes that only export, handed over at `publish`
        self.ask: list[Layout] = []  # layouts the store is asked about once the step's statistics are published
        self.report = StepReport()
        self.now = time.time()  # the time every record of this read-back carries
        #: {(family, labels): value}, in the order read: published at once by `Readback.publish`
        self.published: dict[tuple[str, Labels], float] = {}
        #: those of `published` that are the job's (`replicas.Export`); the others each rank's
        self.jobs: dict[tuple[str, Labels], Export] = {}
        self.copies: list[Entry] = []  # entries with tensor copies to write
        self.stopped = False  # a sink of an `onError: halt` rule failed: the read-back ends there
