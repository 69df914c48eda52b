"""One decision on every rank: a step's skip or halt, agreed on in one collective.

**One decision on every rank.** A `skip_step` or `halt` decided on one rank (its own
activations, its own gradient before DDP's all-reduce, a NaN injected into its shard)
must be taken by every rank in the same step, or the ranks' parameters part ways (and
FSDP's next collective waits forever for a rank that halted). `Agreement.agree` does one
`all_reduce(MAX)` of two integers over the default process group at each step decision,
only when the attached policies hold an enforced `skip_step` or `halt` and a process group
is initialised (and, once it did, for the rest of the process: see `_AGREED`). Every rank
of the group must then step its optimizer together (which
DDP and FSDP require anyway). Decisions taken during evaluation forwards (a halt at a
per-batch readback) are not agreed on: a rank may evaluate alone.

The process-wide side of this: these collectives are issued from the optimizer step
pre-hook, where every rank of a DDP or FSDP job is at the same point of the same step.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..errors import Halt
from ..export.metrics import SKIPPED_STEPS, ModelMetrics
from ..policy.model import Alert
from .readback import StepReport
from .rulestate import RuleState

__all__ = ["Agreement"]

log = logging.getLogger("hookpolicy")


class Agreement:
    """The agreement of one attachment: its rules, and whether any of them can skip or halt."""

    def __init__(self, rules: dict[tuple[str, str], RuleState], store: ModelMetrics) -> None:
        self._rules = rules
        self._store = store
        # Whether a step's decision must be every rank's (one collective a step).
        self._decides = any(
            isinstance(a, Alert) and a.then in ("skip_step", "halt")
            for rs in rules.values() if rs.enforce for a in rs.rule.actions
        )

    def agree(self, report: StepReport, step: int) -> None:
        """Make a skip or halt decided on any rank this rank's too (in `report`); no collective without a group."""
        if not agreeing(self._decides):
            return
        keys = list(self._rules)
        halt = report.halt
        codes = agree(encode(None if report.skip_rule is None else keys.index(report.skip_rule)),
                      encode(None if halt is None else keys.index((halt.policy, halt.rule))))
        other_skip, other_halt = decode(codes[0]), decode(codes[1])
        if not report.skip and other_skip is not None:
            report.skip, report.skip_rule = True, keys[other_skip[0]]
            self._store.inc(SKIPPED_STEPS, report.skip_rule)
            log.warning("%s/%s: step %d skipped, as rank %d decided", *report.skip_rule, step, other_skip[1])
        if halt is None and other_halt is not None:
            policy, rule = keys[other_halt[0]]
            report.halt = Halt(policy, rule, step, f"rank {other_halt[1]} halted; every rank stops at the same step")


#: Set at the first agreement: from then on this process agrees at every step decision,
#: whatever its policies, because a reload that takes the last skip/halt rule out is swapped
#: in at a different step on each rank, and a rank that stopped agreeing first would leave
#: the others' collective unanswered.
_AGREED = False


def agreeing(decides: bool) -> bool:
    """Whether to agree on this step's decision: a process group is up (it may start late) and
    the policies can skip or halt (`decides`), or this process agreed before."""
    import torch.distributed as dist
    return (decides or _AGREED) and dist.is_available() and dist.is_initialized()


def agree(skip: int, halt: int) -> tuple[int, int]:
    """The largest `skip` and `halt` codes over the default process group (0: no rank decided that).

    A code is `1 + what * world_size + rank` (see `encode`), so the reduced code names one
    rank that decided and what it decided.
    """
    import torch.distributed as dist
    global _AGREED
    _AGREED = True
    flags = torch.tensor([skip, halt], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    got = flags.tolist()
    return int(got[0]), int(got[1])


def encode(what: Optional[int]) -> int:
    """A decision's code for `agree`: `what` (an index the same on every rank) and this rank; 0 for none."""
    if what is None:
        return 0
    import torch.distributed as dist
    return 1 + what * dist.get_world_size() + dist.get_rank()


def decode(code: int) -> Optional[tuple[int, int]]:
    """(what, rank) of a code; None for 0."""
    if code == 0:
        return None
    import torch.distributed as dist
    return divmod(code - 1, dist.get_world_size())


def _collective_device() -> torch.device:
    """CPU when the default group has a CPU backend (gloo), else this rank's current accelerator."""
    import torch.distributed as dist
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
