"""One statistics pass of a step: its rows grouped once per layout, its statistics finished when first read.

The read-back groups a pass's rows by each action's `per` (`history.group_key`) and finishes
every group (`stats.combine`, `stats.finish`). `Layout` does the grouping once and is kept
while the pass's rows (module, tensor, element count, in order) stay the same, which they do
at every step of a rule whose bindings do not change. `Finished` is one step's rows under a
layout, finished when first read: at once by the read-back for the groups an alert or a
sink reads, but later, at scrape time (`store.MetricsStore.snapshot`) or at `last_values()`,
for captures that only export (`Layout.hands_over`; the alerts of the same pass are judged
at the step on their own grouping): the step then only swaps them in, whatever the number of
series. The same functions finish them either way, on the same rows in the same order, so
the values are the same.
"""

from __future__ import annotations

import weakref
from operator import itemgetter
from typing import Any, Callable, Optional, Sequence

from ...export.metrics import Labels, stat_family
from ...policy.model import OPTIMIZER_STATE, Capture
from ..execute.ledger import Entry
from ..execute.updates import state_group_key
from ..measure.actions import StatsOp
from ..measure.history import group_key
from ..measure.rulestate import RuleState
from ..measure.stats import combine, combine_sums, finish, summed

__all__ = ["Finished", "Layout"]

#: one group: its (module, tensor) key, the indices of its rows in the pass, their element counts, their sum
Group = tuple[tuple[str, str], list[int], list[int], int]


class Layout:
    """How the rows of one pass group, and the series its captures export; see the module docstring."""

    def __init__(self, entries: Sequence[Entry]) -> None:
        first = entries[0]
        #: the rule, held weakly: a pass handed over to the store (`MetricsStore.swap_in`) outlives the step in
        #: the store's pending values, and must not keep the rule's attachment, and with it the model, alive
        self._rule = weakref.ref(first.rule)
        self.op: StatsOp = first.op
        self.target = first.target
        self.shape = [(e.rows, e.numels) for e in entries]
        self._rows = [e.rows for e in entries]  # `shape`, apart: `fits` compares each as one list
        self._numels = [e.numels for e in entries]
        key = state_group_key if self.target == OPTIMIZER_STATE else group_key
        buckets: dict[str, dict[tuple[str, str], tuple[list[int], list[int]]]] = {a.per: {} for _, a in self.op.actions}
        index = 0
        for rows, numels in self.shape:
            for (module, tensor), n in zip(rows, numels):
                for per, groups in buckets.items():
                    bucket = groups.setdefault(key(module, tensor, per), ([], []))
                    bucket[0].append(index)
                    bucket[1].append(n)
                index += 1
        self.groups: dict[str, list[Group]] = {
            per: [(k, at, numels, sum(numels)) for k, (at, numels) in groups.items()] for per, groups in buckets.items()
        }
        #: per `per`, each group's rows as `stats.combine_sums` picks them, where every partial merges by a sum
        self.picks: dict[str, list[tuple[Callable[[Sequence[float]], Any], bool]]] = {
            per: [(itemgetter(*at), len(at) == 1) for _, at, _, _ in groups] for per, groups in self.groups.items()
        } if summed(self.op.kinds) else {}
        captures = [a for _, a in self.op.actions if isinstance(a, Capture)]
        #: every capture writes no log, no TensorBoard and keeps no ring: its values are only exported, so they may
        #: be handed over unfinished (the pass's alerts, if any, are still judged at the step)
        self.hands_over = bool(captures) and all(a.log is None and a.tensorboard is None and a.keep is None
                                                 for a in captures)
        #: every action such a capture: nothing at the step reads the pass's values
        self.exports_only = self.hands_over and len(captures) == len(self.op.actions)
        #: the series `Finished.values` gives, in its order (the order the read-back publishes them in)
        self.keys: list[tuple[str, Labels]] = [
            (stat_family(self.target, stat), (*self.rule.key, module, tensor))
            for action in captures for (module, tensor), _, _, _ in self.groups[action.per] for stat in action.stats
        ] if self.hands_over else []
        #: `keys` with the store's labels (`ModelMetrics.key`), set by the read-back
        self.store_keys: list[tuple[str, Labels]] = []
        self._series: dict[int, list[list[tuple[str, tuple[str, Labels]]]]] = {}
        #: (store generation, world) at which the store last said whether it holds every series of
        #: `keys`, and its answer: while both stand, a step swaps the values in (`MetricsStore.swap_in`)
        self.checked: Optional[tuple[int, int]] = None
        self.held = False

    @property
    def rule(self) -> RuleState:
        """The rule of the pass (alive while its attachment is: the read-back asks only then)."""
        rule = self._rule()
        assert rule is not None, "a pass's rule is read after its attachment was dropped"
        return rule

    def series(self, index: int, action: Capture) -> list[list[tuple[str, tuple[str, Labels]]]]:
        """Per group of `action` (the capture at `index`), each statistic and its series (family, labels),
        in `Finished.statistics`' order: built once per layout, not at every step's read-back."""
        series = self._series.get(index)
        if series is None:
            families = [(stat, stat_family(self.target, stat)) for stat in action.stats]
            series = self._series[index] = [
                [(stat, (family, (*self.rule.key, module, tensor))) for stat, family in families]
                for (module, tensor), _, _, _ in self.groups[action.per]]
        return series

    def fits(self, entries: Sequence[Entry]) -> bool:
        """Whether `entries` (one pass of a step) have this layout: the same rule, pass and rows."""
        first = entries[0]
        if first.op is not self.op or first.rule is not self._rule() or first.target != self.target:
            return False
        if len(entries) == 1:
            return len(self._rows) == 1 and first.rows == self._rows[0] and first.numels == self._numels[0]
        return [e.rows for e in entries] == self._rows and [e.numels for e in entries] == self._numels


class Finished:
    """One step's rows of a pass under its layout; its statistics are finished when first read."""

    def __init__(self, layout: Layout, rows: list[list[float]], step: int) -> None:
        self.layout, self.rows = layout, rows
        #: the step its values belong to (an `update` pass: the step of the update it measured)
        self.step = step
        self._values: Optional[list[float]] = None
        self._statistics: dict[str, list[tuple[tuple[str, str], dict[str, float]]]] = {}

    def statistics(self, per: str) -> list[tuple[tuple[str, str], dict[str, float]]]:
        """(module, tensor) and every statistic of the pass, per group of `per`: finished once per `per`
        (a capture and an alert of one pass, grouped alike, read the same values; no reader changes them)."""
        finished = self._statistics.get(per)
        if finished is None:
            rows, kinds, stats, groups = self.rows, self.layout.op.kinds, self.layout.op.stats, self.layout.groups[per]
            picks = self.layout.picks.get(per)
            if picks is not None:  # every partial a sum: merged as `combine` merges them, column by column
                finished = [(key, finish(dict(zip(kinds, merged)), total, stats))
                            for (key, _, _, total), merged in zip(groups, combine_sums(rows, picks))]
            else:
                finished = [(key, finish(combine([rows[i] for i in at], numels, kinds), total, stats))
                            for key, at, numels, total in groups]
            self._statistics[per] = finished
        return finished

    def judged(self, per: str, stats: frozenset[str]) -> list[tuple[tuple[str, str], dict[str, float]]]:
        """(module, tensor) and the statistics `stats` (an alert's: what its condition and message read), per
        group of `per`: the same values `statistics` gives them, without finishing what only a record or a
        series reads (`statistics` finishes every one where the alert fires)."""
        finished = self._statistics.get(per)
        if finished is not None:
            return finished
        rows, kinds = self.rows, self.layout.op.kinds
        return [(key, finish(combine([rows[i] for i in at], numels, kinds), total, stats))
                for key, at, numels, total in self.layout.groups[per]]

    def values(self) -> list[float]:
        """The values of `Layout.keys`, in order, finished once (any thread may ask first)."""
        values = self._values
        if values is None:
            values = []
            for _, action in self.layout.op.actions:
                if isinstance(action, Capture):
                    names = action.stats
                    values += [stats[stat] for _, stats in self.statistics(action.per) for stat in names]
            self._values = values
            self._statistics = {}  # a pass handed over to the store keeps its values only, not a dict per group
        return values
