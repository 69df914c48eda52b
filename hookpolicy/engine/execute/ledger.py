"""What one step did so far: the record the step cycle owns and the hook bodies append to.

Between two read-backs the executor appends here and nowhere else: the device-side
statistics of each statistics pass (`Entry`), what each clip did (`ClipEntry`), which
action ran on which module (`ran`, for `hookpolicy_actions_total`: once per step and
binding, however many calls or micro-batches the step had) and the seconds spent per rule
(`hookpolicy_hook_seconds_total`). At the step boundary the cycle `close()`s it, hands the
entries to the read-back (which only reads them and returns a decision) and counts the
rest. Faults are not recorded here: a hook's fault is acted on where it happens
(`programs.Faults`), since a rule switched off or an `onError: halt` cannot wait for the step's end.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ..measure.actions import StatsOp
from ..measure.distributed import Shards
from ..measure.rulestate import RuleState

__all__ = ["ClipEntry", "Entry", "Ledger"]


@dataclass(slots=True)
class Entry:
    """The device-side statistics of one execution of a statistics pass."""

    rule: RuleState
    op: StatsOp
    target: str
    rows: list[tuple[str, str]]  # (module, tensor) per matrix row
    numels: list[int]
    #: `[rows, kinds]` partials: on the device (float64), or read already (CPU tensors, `stats.host_partials`)
    matrix: Union[torch.Tensor, list[list[float]]]
    copies: list[tuple[int, str, str, torch.Tensor]]  # (action index, module, tensor, copy)
    #: step targets whose `finite` counts wait for the readback (stats.resolve_counts)
    deferred: Optional[list[torch.Tensor]] = None
    #: rows of DTensor shards, reduced over their mesh before the readback (distributed.reduce_shards)
    shards: Optional[Shards] = None
    #: the step whose update it measured (`update`, `optimizer_state`: read back at a later step's
    #: read-back); None for an entry of the step being read back
    step: Optional[int] = None


@dataclass(slots=True)
class ClipEntry:
    """What one execution of a clip did (enforce) or would have done (audit), still on the device.

    One row per group the clip measured (`rows`: its (module, tensor) key, see
    `history.group_key`) or per unit row of a unit-wise clip; `matrix` is `[len(rows), 3]`
    float64 on the device: the norm as it left the clip, `min(norm, limit)` (NaN where there
    is none), how many groups or units were clipped, and 1.0 where a limit computed on the
    device was NaN or not positive (nothing clipped). The read-back adds the counts to
    `hookpolicy_clipped_total`, says once per action that a limit was not usable and, for a
    clip that keeps a history (a `max_norm` expression or a `when`), appends the norm to it.
    """

    rule: RuleState
    index: int
    rows: list[tuple[str, str]]
    matrix: torch.Tensor


#: `hookpolicy_actions_total` labels and the module of one action that ran
Ran = tuple[tuple[str, ...], str]


@dataclass
class Ledger:
    """One step's record so far; see the module docstring."""

    entries: list[Union[Entry, ClipEntry]] = field(default_factory=list)
    #: (hookpolicy_actions_total labels, module) of every action that ran this step
    ran: set[Ran] = field(default_factory=set)
    #: seconds spent per rule (policy, rule) this step
    seconds: defaultdict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))

    def empty(self) -> bool:
        """Nothing recorded since the last close: no entry, no action that ran, no time spent."""
        return not (self.entries or self.ran or self.seconds)

    def close(self) -> "Ledger":
        """What was recorded since the last close, as a ledger of its own; this one starts empty."""
        done = Ledger(self.entries, self.ran, self.seconds)
        self.entries, self.ran, self.seconds = [], set(), defaultdict(float)
        return done

    def join(self, later: "Ledger") -> None:
        """Take in what a later close of the same step gave (what the step's agreement reduced)."""
        self.entries.extend(later.entries)
        self.ran.update(later.ran)
        for key, spent in later.seconds.items():
            self.seconds[key] += spent

    def discard(self) -> None:
        """Forget the statistics of a step no optimizer took (what ran and its time still count).

        What an earlier update did (entries with a `step`) happened, and stays.
        """
        self.entries = [e for e in self.entries if isinstance(e, Entry) and e.step is not None]
