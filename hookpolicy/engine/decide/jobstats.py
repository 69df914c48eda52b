"""Activation statistics of every rank together (`ranks: job`), reduced in the step's one agreement collective.

Under DDP each rank runs its own micro-batches through the same model, so a module's
activations differ by rank and a capture of them is one series per rank. A capture in a
rule with `ranks: job` (targets input, output, grad_output, grad_input; `per: module` or
`per: rule`) is the statistic of every rank's tensors together instead, the same on every
rank (exported once per job where the exporter does so).

How: at the step's read-back the rule's partials are not published; they are combined per
(rule, pass, module) into one *slot* each (the partials and the element count, float64)
and travel in the step's agreement row (`agreement.ROW`'s tail), in the order of this
rank's `Layout`. Every rank merges the gathered slots in rank order (`stats.combine`: exact
sums and extrema, Chan's formula for m2) and publishes them through the read-back as if
they had been measured here (`Layout.entries`).

The tail must have the same length on every rank at every step, and a rank cannot know
the others' layouts before the collective: so each step's row announces this rank's
layout (a digest and a width), and the *next* step's tail has the agreed width when every
rank announced the same layout, else none. A layout's first step (at attach, after a
re-bind or a reload that changes it) is therefore not reduced: those statistics are not
published. A rank whose layout differs from the others' (different rules or modules) never
gets them, and says so once.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ...policy.model import ACTIVATIONS, rule_name
from ..measure.actions import StatsOp
from ..execute.ledger import Entry
from ..measure.rulestate import RuleState
from ..measure.stats import combine

__all__ = ["JOB_TARGETS", "Layout", "Slot", "reduced"]

log = logging.getLogger("hookpolicy")

#: The targets whose statistics `ranks: job` reduces here (the loss has its own slots in the row).
JOB_TARGETS = frozenset(ACTIVATIONS)


def reduced(rs: RuleState) -> bool:
    """Whether `rs` captures activation statistics of every rank together (`ranks: job`)."""
    return rs.rule.ranks == "job" and rs.rule.target in JOB_TARGETS


@dataclass(frozen=True)
class Slot:
    """One module's partials of one statistics pass of one rule: `len(op.kinds)` values and a count."""

    rule: RuleState
    op: StatsOp
    module: str

    @property
    def width(self) -> int:
        return len(self.op.kinds) + 1


class Layout:
    """The slots of an attachment's `ranks: job` rules, in an order every rank holding them computes alike."""

    def __init__(self, rules: Iterable[RuleState], said: bool = False) -> None:
        slots = [Slot(rs, op, module) for rs in rules if reduced(rs) for op in rs.program if isinstance(op, StatsOp)
                 for module in sorted({b.module for b in rs.bindings})]
        self.slots = sorted(slots, key=lambda s: (s.rule.key, s.op.segment, s.module))
        self.width = sum(s.width for s in self.slots)
        text = "\n".join(f"{rule_name(s.rule.key)}\0{s.op.segment}\0{s.module}\0{','.join(s.op.kinds)}"
                         for s in self.slots)
        #: 62 bits (it travels in an int64), 0 for no slot
        self.digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2 if self.slots else 0
        self.said_apart = said  # "not those of another rank" was said (once per attachment)

    def values(self, held: Sequence[tuple[Entry, list[list[float]]]]) -> list[float]:
        """This rank's slots from the read-back's held entries and their rows: `width` floats (count 0: not seen)."""
        rows: dict[tuple[tuple[str, str], int, str], tuple[list[list[float]], list[int]]] = defaultdict(
            lambda: ([], []))
        for entry, fetched in held:
            for (module, _), row, numel in zip(entry.rows, fetched, entry.numels):
                bucket = rows[(entry.rule.key, entry.op.segment, module)]
                bucket[0].append(row)
                bucket[1].append(numel)
        out: list[float] = []
        for slot in self.slots:
            found = rows.get((slot.rule.key, slot.op.segment, slot.module))
            if found is None:
                out.extend([0.0] * slot.width)
                continue
            merged = combine(found[0], found[1], slot.op.kinds)
            out.extend([*(merged[kind] for kind in slot.op.kinds), float(sum(found[1]))])
        return out

    def merge(self, gathered: torch.Tensor) -> list[tuple[list[float], int]]:
        """Every rank's slots (`[world, width]` float64 on the host) merged per slot, in rank order."""
        ranks = gathered.tolist()
        merged: list[tuple[list[float], int]] = []
        start = 0
        for slot in self.slots:
            end = start + slot.width
            seen = [row[start:end] for row in ranks if row[end - 1] > 0]
            counts = [int(row[-1]) for row in seen]
            partials = combine([row[:-1] for row in seen], counts, slot.op.kinds) if seen else {}
            merged.append(([partials[kind] for kind in slot.op.kinds] if seen else [], sum(counts)))
            start = end
        return merged

    def entries(self, merged: Sequence[tuple[list[float], int]]) -> list[Entry]:
        """The merged slots as read-back entries, one per (rule, pass); slots no rank saw are left out."""
        grouped: dict[tuple[tuple[str, str], int], list[tuple[Slot, list[float], int]]] = defaultdict(list)
        for slot, (partials, count) in zip(self.slots, merged):
            if count > 0:
                grouped[(slot.rule.key, slot.op.segment)].append((slot, partials, count))
        out = []
        for items in grouped.values():
            first = items[0][0]
            matrix = torch.tensor([partials for _, partials, _ in items], dtype=torch.float64)
            out.append(Entry(first.rule, first.op, first.rule.rule.target,
                             [(slot.module, "") for slot, _, _ in items], [count for _, _, count in items],
                             matrix, []))
        return out

    def apart(self, step: int, rank: int) -> None:
        """Say once that the other ranks announced another layout: these statistics are not published."""
        if self.said_apart or not self.slots:
            return
        self.said_apart = True
        rules = sorted({rule_name(s.rule.key) for s in self.slots})
        log.warning("%s: rank %d's ranks: job statistics are not those of another rank at step %d (other rules or "
                    "modules): they are not reduced across ranks nor published until every rank holds the same",
                    ", ".join(rules), rank, step)
