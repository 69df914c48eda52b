"""The decision a read-back returns: skip the step, halt, or go on; and what the cycle still has to act on."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ...errors import Halt
from ..measure.history import Observation
from ..execute.ledger import Entry
from ..measure.rulestate import MAX_ERRORS, RuleState

if TYPE_CHECKING:
    from .alerts import Pending

__all__ = ["SinkHalts", "StepReport"]


@dataclass
class StepReport:
    """What one read-back decided, for the step cycle to act on."""

    skip: bool = False
    #: the first rule whose alert skips the step (named to the other ranks, see agreement.py)
    skip_rule: Optional[tuple[str, str]] = None
    #: the rules whose alerts skip the step (each counts the step once, however many modules fired)
    skip_by: list[tuple[str, str]] = field(default_factory=list)
    #: the alerts with `then: cool_down` or `then: rewind` that fired in enforce mode: (rule key, action index)
    heals: list[tuple[tuple[str, str], int]] = field(default_factory=list)
    #: the one the step takes, agreed on by every rank: its place + 1 in `healing.heal_order`; 0 for none
    heal: int = 0
    #: the records of the alerts that fired, written once the step is decided (`Readback.settle`)
    pending: list["Pending"] = field(default_factory=list)
    #: the first alert with `then: halt` in enforce mode
    halt: Optional[Halt] = None
    #: sinks that could not write, in order: each is a fault of its rule, handled by `onError`
    errors: list[tuple[RuleState, Exception]] = field(default_factory=list)
    #: time spent per rule, for `hookpolicy_hook_seconds_total`
    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    #: what was evaluated against a history, appended to it (`History.commit`) unless the step is skipped
    observed: list[Observation] = field(default_factory=list)
    #: entries the read-back was told to hold (`ranks: job` statistics), with their fetched rows, unpublished
    held: list[tuple[Entry, list[list[float]]]] = field(default_factory=list)

    def join(self, later: "StepReport", decisions: bool) -> None:
        """Take in a later read-back of the same step (the job's loss): its skip, halt and heals when
        `decisions`, what it observed always. Its errors and seconds are acted on apart."""
        if decisions:
            if later.skip and not self.skip:
                self.skip, self.skip_rule = True, later.skip_rule
            self.skip_by.extend(key for key in later.skip_by if key not in self.skip_by)
            if self.halt is None:
                self.halt = later.halt
            self.heals.extend(heal for heal in later.heals if heal not in self.heals)
        self.pending.extend(later.pending)
        self.observed.extend(later.observed)

    def off(self, rs: RuleState) -> bool:
        """Whether `rs` is switched off, counting the errors this report still has to hand over."""
        return rs.errors + sum(1 for r, _ in self.errors if r is rs) >= MAX_ERRORS


class SinkHalts(Exception):
    """A sink of a rule with `onError: halt` failed: the read-back stops there."""
