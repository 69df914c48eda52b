"""One decision on every rank: a step's skip or halt agreed on, and the job's loss reduced, in one collective.

A `skip_step` or `halt` decided on one rank (its own activations, its own gradient before
DDP's all-reduce, a NaN injected into its shard) must be taken by every rank in the same
step, or the ranks' parameters part ways (and FSDP's next collective waits forever for a
rank that halted). `Agreement.agree` issues one collective over the default process group
at each step decision: an `all_gather` of one row of `len(ROW)` int64 per rank (`ROW`
names them), from which every rank computes the same maxima, minima and sums. It runs only
when a process group is initialised and the attached policies hold an enforced `skip_step`
or `halt`, a policy with `onError: halt` (a fault's halt, `Faults.pending`), a loss rule
that sees the job's loss, a `ranks: job` activation rule, or a reload vote (and, once it did, for the rest of the process: see `_AGREED`). Every rank of the group must then step its
optimizer together (which DDP and FSDP require anyway). Decisions taken during evaluation
forwards (a halt at a per-batch readback) are not agreed on: a rank may evaluate alone.

**Why a gather.** One collective must give the largest code (which rule decided), the
smallest and largest digest (do all ranks hold the same rules) and a sum (the loss); no
reduction operator gives all three, and an `all_gather` of a fixed row does, exactly: the
loss's float64 partials travel as their bits, and every rank merges the same rows in rank
order, so its sums are bit for bit every other rank's. The price is `8 * len(ROW) * world`
bytes to each rank instead of a constant (152 KiB at 1,024 ranks), plus the tail's.

**Rules are named by identity, never by position.** A rule's identity is (policy name, rule
name) within a policy *generation* (`Attached.generation`: 0 for an attachment, raised
by each hot reload). The row carries the skip code, the halt code and a digest of this
rank's identities and generation: every rank sees, in the same step, whether all ranks
hold the same rules (smallest digest == largest). When they do, a code names a rule by its
place in the *sorted* identities, which is the same on every rank, and the rank that
decided (`1 + place * world_size + rank`). A new decision every rank must take at the same
step is one more code in `ROW`, before "digest", encoded and decoded alike.
The "heal" code (`then: cool_down` / `then: rewind`, `healing.py`) is the place (+1) of the
healing alert this rank's step takes in `healing.heal_order` (0 for none): after the maximum
every rank takes the same alert.

**Ranks that hold different rules** (between two ranks' swaps at a hot reload, or policies
that differ by rank) cannot tell from one collective which rules every rank holds, and a
second collective is not an option (every rank must issue the same collectives, and this
one runs at every step). So at such a step no rank takes a skip or halt decision, its own
included: the ranks stay consistent (no rank skips or halts alone, none waits on another),
and each says so in one `hookpolicy:` line when the mismatch begins (and one when it ends),
naming what it decided itself. Alerts that fired still count and log as such.

**The job's loss.** The row also carries this rank's loss roots of the step (`loss.LossTap`):
their count and partials (`LOSS_PARTIALS`), count 0 where it saw none. `Agreed.loss` is
every rank's together; the step cycle evaluates the loss rules with `ranks: job` (the
default) on it after this collective, so their statistics, history and decisions are the
same on every rank by construction and need no agreement of their own.

**Activations of every rank (`ranks: job`, `Layout`).** The row ends with a tail of slots:
the partials of those rules' captures per module. Its width is the one every rank announced
(`layout`, `width`) at the previous agreement, 0 when they differed, so that it is the same
on every rank; a rank whose layout is not that one sends padding and `ok` 0, and nobody
publishes that step's slots (`Agreed.tail` is None).

**The alerts that fired (`Agreed.fired`).** A rule woken by an alert (`trigger.after`) must
wake on every rank at the same step, and the recorder dumps every rank's ring at the same
step, though an alert may fire on one rank only (its own gradients, its own shard). So the
row carries the alerts this rank saw fire at the step's decision, one bit per alert in
`FIRED_WORDS` words, at its place in `fired_places` (the same list on every rank holding the
same rules: the alerts something listens to first, `model.listened`, then those whose skip is
bounded, then the others, sorted);
every rank ORs the same rows, and `Agreed.fired` is the alerts that fired on any rank. A
bounded skip counts its steps in a row from them (`Alerts.skipped`), so that every rank where
it fires holds its skip back alike (a count kept from this rank's firings alone would differ
by rank, and another rank's skip would carry it past N). An
attachment that listens to an alert agrees at every step. At a step where the ranks hold
different rules, no alert is agreed on (`fired` is empty on every rank). An attachment with more
alerts than the words hold (252) agrees on the first 252 places only, said once.

**A hot reload goes in on every rank at once.** Under `hookpolicy apply` a data-parallel
model's agreement also carries a `Vote`: a digest of the newest policy version this rank
has (0 without a vote), so that every rank knows, at the same step, whether all ranks want
the same version. `Vote.agreed` is told the version (or None); the reload swaps it in at
the next step boundary on every rank (`apply/reload.py`), as generation + 1. Such a model
agrees at every step, whatever its rules: one small collective a step is what a reloadable
data-parallel job costs. The row is the same length on every rank, vote or not, loss or
not, so ranks never issue different collectives.

The process-wide side of this: these collectives are issued from the optimizer step
pre-hook, where every rank of a DDP or FSDP job is at the same point of the same step.

**The `ranks: job` slots** (`Layout`): activation statistics of every rank together (`ranks: job`),
reduced in the step's one agreement collective.

Under DDP each rank runs its own micro-batches through the same model, so a module's
activations differ by rank and a capture of them is one series per rank. A capture in a
rule with `ranks: job` (targets input, output, grad_output, grad_input; `per: module` or
`per: rule`) is the statistic of every rank's tensors together instead, the same on every
rank (exported once per job where the exporter does so).

How: at the step's read-back the rule's partials are not published; they are combined per
(rule, pass, module) into one *slot* each (the partials and the element count, float64)
and travel in the step's agreement row (`ROW`'s tail), in the order of this
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
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Iterable, Optional, Protocol, Sequence

import torch

from ...errors import Halt
from ...policy.model import ACTIVATIONS, DECIDES, LOSS, Alert, AlertKey, Policy, alert_keys, listened, rule_name, stats_of
from .alerts import StepReport
from ..execute.ledger import Entry
from ..measure.actions import StatsOp
from ..measure.rulestate import RuleState
from ..measure.stats import combine, partials_for, tensor_partials

__all__ = ["Agreed", "Agreement", "FIRED_WORDS", "JOB_TARGETS", "Layout", "ROW", "Slot", "Vote", "digest", "fired_places",
           "identities", "job_loss_rule", "reduced"]

log = logging.getLogger("hookpolicy")

#: A rule's identity in the agreement: (policy name, rule name).
Identity = tuple[str, str]


def identities(policies: Sequence[Policy]) -> list[Identity]:
    """The identities of every rule of `policies`, sorted: the same list on every rank holding the same rules."""
    return sorted((policy.name, rule.name) for policy in policies for rule in policy.rules)


def fired_places(policies: Sequence[Policy]) -> list[AlertKey]:
    """The alerts in the order of their bits in the row: those something listens to first, then those whose
    skip is bounded (`skip_step: {max_in_a_row: N}`: their count in a row is kept from them), then the others."""
    heard = listened(policies)
    bounded = {((policy.name, rule.name), index) for policy in policies for rule in policy.rules
               for index, action in enumerate(rule.actions) if isinstance(action, Alert) and action.max_in_a_row}
    keys = alert_keys(policies)
    return ([key for key in keys if key in heard] + [key for key in keys if key in bounded and key not in heard]
            + [key for key in keys if key not in heard and key not in bounded])


def digest(names: Sequence[Identity], generation: int) -> int:
    """A 62-bit digest of sorted identities and a generation (it travels negated too, in an int64)."""
    text = "\n".join(f"{policy}\0{rule}" for policy, rule in names) + f"\n#{generation}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


class Vote(Protocol):
    """A hot reload's part in a step's agreement (see the module docstring)."""

    def wanted(self) -> int:
        """A digest (62 bits, not 0) of the policy version this rank would run next."""

    def agreed(self, wanted: Optional[int], step: int) -> None:
        """At `step`, every rank wants `wanted`; None when not every rank wants the same. Only take note here."""


#: Every partial the statistics a loss rule may capture need.
LOSS_PARTIALS: tuple[str, ...] = partials_for(stats_of(LOSS))

#: int64 words of the row that carry the alerts a rank saw fire, 63 bits each (the sign bit unused):
#: at most `FIRED_WORDS * 63` alerts of an attachment are agreed on (`fired_places`).
FIRED_WORDS = 4
_BITS = 63

#: The row each rank contributes to the step's one collective, int64 each (the loss's partials
#: travel as the bits of their float64): the decision codes (a rule's code, 0 for none; a new
#: decision that every rank must take at the same step is one more name here, before "digest"),
#: this rank's heal code (`healing`), its rules digest, its reload vote (0 for none), its
#: `Layout` (digest, width) and whether its tail follows the agreed one (1) or is
#: padding (0), how many loss roots it saw, and their partials (`LOSS_PARTIALS`, anything where
#: it saw none). Then the tail: the slots of `ranks: job` activation statistics, float64 bits,
#: as wide as the layout every rank announced at the previous step (0 when they differed).
#: The same length on every rank, every step.
#: The `fired_*` words are the alerts this rank saw fire (`FIRED_WORDS`, below), one bit each.
ROW: tuple[str, ...] = ("skip", "halt", "heal", "digest", "vote", "layout", "width", "ok",
                        *(f"fired_{w}" for w in range(FIRED_WORDS)), "roots", *(f"loss_{p}" for p in LOSS_PARTIALS))
_AT = {name: place for place, name in enumerate(ROW)}
_LOSS_AT = _AT["loss_" + LOSS_PARTIALS[0]]


def job_loss_rule(rs: RuleState) -> bool:
    """Whether `rs` is a loss rule that sees the job's loss (`ranks: job`, the default) in a process group."""
    return rs.rule.target == LOSS and rs.rule.ranks == "job"


@dataclass(frozen=True)
class Agreed:
    """What a step's collective gave every rank alike."""

    #: every rank holds the same rules (else no rank took a skip or halt decision at this step)
    same: bool
    #: the job's loss: the partials (`LOSS_PARTIALS`) of every rank's roots together and how many
    #: roots there were; None when no rank saw one
    loss: Optional[tuple[dict[str, float], int]]
    #: the `ranks: job` activation slots of every rank merged (`Layout.merge`); None when
    #: this step's row carried none, or not every rank's followed the agreed layout
    tail: Optional[list[tuple[list[float], int]]] = None
    #: the highest heal code any rank took (`healing.heal_order` place + 1; 0 for none), when `same`
    heal: int = 0
    #: seconds this rank waited in the collective, from entering it to its result on the host
    #: (`hookpolicy_agreement_wait_seconds_total`): the wait for the last rank to arrive
    waited: float = 0.0
    #: the alerts that fired on any rank at this step's decision (empty unless `same`); see the module docstring
    fired: frozenset[AlertKey] = frozenset()


class Agreement:
    """The agreement of one attachment; see the module docstring."""

    def __init__(
        self, policies: Sequence[Policy], rules: dict[tuple[str, str], RuleState], generation: int,
        model: Optional[torch.nn.Module] = None,
    ) -> None:
        self._names = identities(policies)
        self.generation = generation
        self._digest = digest(self._names, generation)
        # Whether a step's decision must be every rank's (one collective a step).
        self._decides = any(
            isinstance(a, Alert) and a.then in DECIDES
            for rs in rules.values() if rs.enforce for a in rs.rule.actions
        ) or any(rs.policy.on_error == "halt" for rs in rules.values())  # a fault's halt (`Faults.pending`)
        #: loss rules that see the job's loss: the loss travels in the collective, which then runs at every step
        self.reduces_loss = any(job_loss_rule(rs) for rs in rules.values())
        #: the `ranks: job` activation statistics (`Layout`): they travel in the collective too
        self._rules = rules
        self.layout = Layout(rules.values())
        #: the governed model, weakly: the key of its `_CARRIED` layout
        self._model = None if model is None else weakref.ref(model)
        self._apart = False  # the ranks held different rules at the last agreement
        #: the alerts of the row's bits, by place (`fired_places`); past the words' room they are not agreed on
        places = fired_places(policies)
        self._unplaced = places[FIRED_WORDS * _BITS:]
        self._places = places[:FIRED_WORDS * _BITS]
        self._place = {key: place for place, key in enumerate(self._places)}
        self._said_unplaced = False
        #: an alert's firing wakes a rule (or dumps a recorder) at later steps: agreed at every step
        self.listens = bool(listened(policies))
        #: set by a reload protocol before the first step (`Attached.vote_on_reloads`)
        self.vote: Optional[Vote] = None

    def rules_changed(self) -> None:
        """The rules were bound anew (`executor.Rebinding`): their `ranks: job` slots may be others."""
        self.layout = Layout(self._rules.values(), said=self.layout.said_apart)

    def active(self) -> bool:
        """Whether this attachment agrees at its steps (a process group is up and something needs it)."""
        return agreeing(self._decides or self.listens or self.vote is not None or self.reduces_loss
                        or bool(self.layout.slots))

    def agree(
        self, report: StepReport, step: int, loss: Optional[torch.Tensor] = None, tail: Sequence[float] = (),
        heal: int = 0, fired: Collection[AlertKey] = (),
    ) -> Optional[Agreed]:
        """Make a skip or halt decided on any rank every rank's (in `report`), and reduce the loss; None without a group.

        `loss` is this rank's roots of the step (`loss.LossTap.take`), None where it saw none;
        `tail` its `ranks: job` slots (`Layout.values`), empty where it has none;
        `heal` the heal this rank took (`healing.Healing.choose`), which goes back as `Agreed.heal`:
        the step cycle sets the step's heal (`report.heal` is not written here);
        `fired` the alerts this rank saw fire, which go back as `Agreed.fired`, every rank's together.
        `report.skip_by` gets the rule another rank skipped by; at a step where the ranks hold
        different rules, `report` ends with no skip and no halt on every rank.
        """
        if not self.active():
            return None
        import torch.distributed as dist
        halt = report.halt
        codes = [self._encode(report.skip_rule), self._encode(None if halt is None else (halt.policy, halt.rule))]
        wanted = 0 if self.vote is None else self.vote.wanted()
        layout = self.layout
        model = None if self._model is None else self._model()
        carry = (0, 0) if model is None else _CARRIED.get(model, (0, 0))
        follows = carry[1] > 0 and layout.digest == carry[0] and len(tail) == carry[1]
        padded = list(tail) if follows else [0.0] * carry[1]
        rows, waited = _all_gather([*codes, heal, self._digest, wanted, layout.digest, layout.width, int(follows),
                                    *self._words(fired, step)], loss, padded)
        head = rows[:, :len(ROW)]
        highest, lowest = head.max(dim=0).values.tolist(), head.min(dim=0).values.tolist()
        if self.vote is not None:
            vote = _AT["vote"]
            self.vote.agreed(highest[vote] if highest[vote] == lowest[vote] else None, step)
        merged = None
        if carry[1] > 0 and lowest[_AT["ok"]] == 1:
            merged = layout.merge(rows[:, len(ROW):].contiguous().view(torch.float64))
        announced = [(highest[_AT[k]], lowest[_AT[k]]) for k in ("layout", "width")]
        carry = (highest[_AT["layout"]], highest[_AT["width"]]) if all(a == b for a, b in announced) else (0, 0)
        if model is not None:
            _CARRIED[model] = carry
        if carry[0] != layout.digest:
            layout.apart(step, dist.get_rank())
        job = _job_loss(rows)
        same = highest[_AT["digest"]] == lowest[_AT["digest"]]
        if not same:
            self._differ(report, step, dist.get_rank(), highest[_AT["digest"]], lowest[_AT["digest"]])
            return Agreed(False, job, merged, waited=waited)
        if self._apart:
            self._apart = False
            log.info("the ranks hold the same rules again at step %d (generation %d): skip and halt decisions "
                     "are agreed on again", step, self.generation)
        other_skip, other_halt = self._decode(highest[_AT["skip"]]), self._decode(highest[_AT["halt"]])
        if not report.skip and other_skip is not None:
            report.skip, report.skip_rule = True, other_skip[0]
            report.skip_by.append(other_skip[0])
            log.warning("%s/%s: step %d skipped, as rank %d decided", *other_skip[0], step, other_skip[1])
        if halt is None and other_halt is not None:
            (policy, rule), rank = other_halt
            report.halt = Halt(policy, rule, step, f"rank {rank} halted; every rank stops at the same step")
        # the healing alert of the highest place any rank took (`healing.heal_order`, the same list on every rank)
        return Agreed(True, job, merged, heal=highest[_AT["heal"]], waited=waited, fired=self._fired(rows))

    def _words(self, fired: Collection[AlertKey], step: int) -> list[int]:
        """This rank's `fired` alerts as the row's `FIRED_WORDS` words: bit `place % 63` of word `place // 63`."""
        words = [0] * FIRED_WORDS
        for key in fired:
            place = self._place.get(key)
            if place is not None:
                words[place // _BITS] |= 1 << (place % _BITS)
            elif self._unplaced:
                self._say_unplaced(key, step)
        return words

    def _fired(self, rows: torch.Tensor) -> frozenset[AlertKey]:
        """The alerts whose bit any rank's row set (an OR over the same rows on every rank)."""
        first = _AT["fired_0"]
        fired: set[AlertKey] = set()
        for w, column in enumerate(rows[:, first:first + FIRED_WORDS].T.tolist()):
            word = 0
            for bits in column:
                word |= bits
            fired.update(self._places[w * _BITS + b] for b in range(_BITS)
                         if word >> b & 1 and w * _BITS + b < len(self._places))
        return frozenset(fired)

    def _say_unplaced(self, key: AlertKey, step: int) -> None:
        if not self._said_unplaced:
            self._said_unplaced = True
            log.warning(
                "an alert of %s fired at step %d: the step's agreement carries %d of this attachment's %d alerts "
                "(those that wake a rule first), and the other %d are agreed on by no rank: the alerts that fired at "
                "a step leave them out on every rank (said once)", rule_name(key[0]), step,
                len(self._places), len(self._places) + len(self._unplaced), len(self._unplaced))

    def _encode(self, name: Optional[Identity]) -> int:
        """A decision's code: 1 + the rule's place in the sorted identities * world size + this rank; 0 for none."""
        if name is None:
            return 0
        import torch.distributed as dist
        return 1 + self._names.index(name) * dist.get_world_size() + dist.get_rank()

    def _decode(self, code: int) -> Optional[tuple[Identity, int]]:
        """(rule identity, rank) of a code; None for 0 (no rank decided)."""
        if code == 0:
            return None
        import torch.distributed as dist
        place, rank = divmod(code - 1, dist.get_world_size())
        return self._names[place], rank  # the digests agree: the identities are the same list on every rank

    def _differ(self, report: StepReport, step: int, rank: int, highest: int, lowest: int) -> None:
        """The ranks hold different rules: drop this step's skip and halt on every rank, said when it begins."""
        own = [f"skip by {rule_name(report.skip_rule)}"] if report.skip_rule is not None else []
        if report.halt is not None:
            own.append(f"halt by {report.halt.policy}/{report.halt.rule}")
        report.skip, report.skip_rule, report.halt = False, None, None
        report.skip_by.clear()
        if self._apart and not own:
            return
        self._apart = True
        log.warning(
            "rank %d holds other rules than another rank at step %d (%d rules of generation %d, digest %016x; the "
            "group's digests run from %016x to %016x): no rank takes a skip or halt decision until every rank "
            "holds the same rules%s", rank, step, len(self._names), self.generation, self._digest, lowest, highest,
            f"; not taken here: {', '.join(own)}" if own else "")


#: Set at the first agreement: from then on this process agrees at every step decision,
#: whatever its policies, because a reload that takes the last skip/halt rule out is swapped
#: in at a different step on each rank, and a rank that stopped agreeing first would leave
#: the others' collective unanswered.
_AGREED = False


#: Per governed model (weakly: it goes with the model), the `ranks: job` layout every rank announced at its last
#: agreement (digest, width), which the next agreement's tail is as wide as. Process-wide, not
#: per attachment: a policy swapped in on this rank alone (a reload of a model that is not
#: data-parallel) starts a new attachment, which must still send the width the other ranks'
#: attachments expect. Every rank computes it from the same gathered rows.
_CARRIED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, int]]" = weakref.WeakKeyDictionary()


def agreeing(decides: bool) -> bool:
    """Whether to agree on this step's decision: a process group is up (it may start late) and
    the policies can skip or halt (`decides`), or this process agreed before."""
    import torch.distributed as dist
    return (decides or _AGREED) and dist.is_available() and dist.is_initialized()


def _all_gather(ints: list[int], loss: Optional[torch.Tensor], tail: Sequence[float]) -> tuple[torch.Tensor, float]:
    """Every rank's `ROW` (`ints`, then the roots' count and partials) and `tail`, `[world, len(ROW) + len(tail)]`
    int64 on the host, and the seconds this rank waited for them.

    The one collective of a step's agreement, and its one read-back: an `all_gather` of the
    same number of int64 on every rank, whether it saw a loss or not. The wait is timed
    from the collective's call to its result on the host: a rank that arrives first waits
    there for the last. On an accelerator the read-back also waits for the work this rank
    queued before it (the step's kernels), which its peers wait for too.
    """
    import torch.distributed as dist
    global _AGREED
    _AGREED = True
    device = _collective_device()
    head = torch.tensor([*ints, 0 if loss is None else loss.numel()], dtype=torch.int64)
    if loss is None:
        partials = torch.zeros(len(LOSS_PARTIALS), dtype=torch.float64, device=device)
    else:
        partials = tensor_partials([loss], LOSS_PARTIALS).reshape(-1).to(device)
    floats = torch.tensor(list(tail), dtype=torch.float64)
    row = torch.cat([head.to(device), partials.view(torch.int64), floats.to(device).view(torch.int64)])
    rows = torch.empty(dist.get_world_size() * row.numel(), dtype=torch.int64, device=device)
    started = time.perf_counter()
    dist.all_gather_single(rows, row)
    gathered = rows.view(-1, row.numel()).cpu()
    return gathered, time.perf_counter() - started


def _job_loss(rows: torch.Tensor) -> Optional[tuple[dict[str, float], int]]:
    """The partials of every rank's roots together, and how many there were; None when no rank saw one.

    Merged on the host in rank order from the same rows on every rank (`stats.combine`: exact
    sums, Chan's formula for the spread), so every rank gets the same numbers, bit for bit.
    """
    counts = rows[:, _AT["roots"]]
    seen = counts > 0
    if not bool(seen.any()):
        return None
    partials = rows[seen][:, _LOSS_AT:len(ROW)].contiguous().view(torch.float64).tolist()
    numels = counts[seen].tolist()
    return combine(partials, numels, LOSS_PARTIALS), sum(numels)


def _collective_device() -> torch.device:
    """CPU when the default group has a CPU backend (gloo), else this rank's current accelerator."""
    import torch.distributed as dist
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())

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
