"""A step's healing: `then: cool_down` (a lower learning rate for a while) and `then: rewind` (back to a snapshot).

Both are step decisions like `skip_step`: an alert fires at the read-back of step `s`, the
decision is agreed on by every rank (`agreement`), and it acts on the update of step `s`.

**Which one, when several fire.** The alerts that can heal are put in one order, the same
on every rank holding the same rules (`heal_order`): the cool-downs by falling factor
(then longer ones, then identity), then the rewinds (by identity). A step takes the last
of the alerts that fired in this order (the rewind wins; else the strongest cool-down), so
that one integer, reduced with MAX over the ranks, is the decision of the whole group. Their
records are written after that choice (`decided` returns each one's outcome): the one taken
says what it did, the others which decision took the step (or that the run halts).

**Cool-down.** From step `s` to `s + steps - 1`, every parameter group's `lr` of each
optimizer that steps the model is multiplied by `factor` in the step pre-hook, after the
step was evaluated, and the value that was there (the LR scheduler's or the script's) is put
back, as the same object, in the step post-hook: the scheduler's state never sees the
factor, and a scheduler or script that sets the lr between two steps keeps working. A cool-down
that fires while one runs extends it (to the later end) with the smaller of the two factors.

**Rewind.** The update of step `s` is not applied (its gradients are hidden, as for a skip),
and at the end of the step the model's parameters and buffers, its optimizers' state and
parameter groups, its LR schedulers and its GradScaler go back to a snapshot (`snapshots`).
The script's code after `optimizer.step()` (the scheduler's step, the scaler's update,
`zero_grad()`) then runs on the restored state exactly as it ran after the snapshot was
taken, so the run goes on as if the batches of the steps in between had never been seen.
Every alert's `for:` count starts again from 0 (the steps that made it were dropped). After
`max_rewinds` rewinds by one alert, its next firing halts the run.

**A rung that cannot act climbs.** A rewind with no snapshot to go back to (none taken yet,
or the model's steps cannot be snapshotted) or no optimizer to restore skips the step instead
and spends one of its `max_rewinds`; a cool-down with no optimizer hands the step to its
rule's rewind. So a spike that persists reaches the halt instead of being skipped forever.
At the step where its rule's bounded `skip_step` alert (`skip_step: {max_in_a_row: N}`) holds
back its skip (N skipped in a row), a rung that cannot act leaves the step to that alert
instead (it neither skips nor spends): the step is applied, the update that undoes a spike
the weights made (a script updating by hand has no lr to lower and no optimizer state to
restore, and the update is what its unguarded run heals by). If the spike stays after it,
the rungs climb as above at the steps the alert skips.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ...errors import Halt
from ...process import Once
from ...export.metrics import REWINDS
from ...export.store import ModelMetrics
from ...policy.model import HEALS, Alert, Policy
from ..decide.alerts import StepReport, not_taken, outcome
from .snapshots import Snapshot, Snapshots, snapshots_of

__all__ = ["Healing", "Healer", "heal_order"]

log = logging.getLogger("hookpolicy")


@dataclass(frozen=True)
class Healer:
    """One alert that heals: its rule's identity, the action's index, the alert."""

    policy: str
    rule: str
    index: int
    alert: Alert

    @property
    def key(self) -> tuple[str, str]:
        return (self.policy, self.rule)


def heal_order(policies: Sequence[Policy]) -> list[Healer]:
    """Every alert with `then: cool_down` or `then: rewind`, in the order a step chooses by (the last wins)."""
    healers = [Healer(policy.name, rule.name, index, action) for policy in policies for rule in policy.rules
               for index, action in enumerate(rule.actions)
               if isinstance(action, Alert) and action.then in HEALS]

    def place(h: Healer) -> tuple[Any, ...]:
        if h.alert.cool_down is not None:
            return (0, -h.alert.cool_down.factor, h.alert.cool_down.steps, h.policy, h.rule, h.index)
        return (1, 0.0, 0, h.policy, h.rule, h.index)
    return sorted(healers, key=place)


#: a decision, as an outcome names what took the step
_A = {"cool_down": "a cool-down", "rewind": "a rewind"}

#: why a heal cannot act in a script that updates its weights by hand
_NO_OPTIMIZER = "no optimizer steps this model"


@dataclass
class Carried:
    """What a hot reload carries of a model's healing to its next attachment (`Healing.adopt`)."""

    #: per alert whose cool-down is in force (policy, rule, index): its factor and end
    cooling: dict[tuple[str, str, int], tuple[float, int]]
    #: rewinds taken per alert (policy, rule, index)
    rewinds: dict[tuple[str, str, int], int]
    #: the snapshots kept, oldest first
    kept: list[Snapshot]


class Healing:
    """The cool-down in force, the rewinds taken, and the snapshots of one attached model."""

    def __init__(self, model: torch.nn.Module, policies: Sequence[Policy], store: ModelMetrics,
                 fail: Optional[Callable[[tuple[str, str], Exception], bool]] = None,
                 snapshots: Callable[[torch.nn.Module, Sequence[Policy], str], Optional[Snapshots]] = snapshots_of,
                 ) -> None:
        self.order = heal_order(policies)
        #: per rule with a `skip_step` alert bounded by `max_in_a_row`: that bound (the smallest)
        self._bounded: dict[tuple[str, str], int] = {}
        for policy in policies:
            for rule in policy.rules:
                for action in rule.actions:
                    if isinstance(action, Alert) and action.max_in_a_row is not None:
                        key = (policy.name, rule.name)
                        self._bounded[key] = min(self._bounded.get(key, action.max_in_a_row), action.max_in_a_row)
        self._store = store
        #: a fault of a rule (a snapshot that cannot be taken or put back): its containment (`Faults.fail`)
        self._fail = fail
        #: `snapshots`: `snapshots_of` for a live model; `hookpolicy replay` passes snapshots that are only a schedule
        self.snapshots: Optional[Snapshots] = snapshots(model, policies, store.model)
        #: what the cycle removes with the model (the snapshots' watch on LR schedulers and GradScalers)
        self.handles: list[Any] = [] if self.snapshots is None else self.snapshots.handles
        self._factor = 1.0
        self._until = 0  # the cool-down lasts while step < _until
        #: per alert whose cool-down is in force (policy, rule, index): its factor and end (for a reload)
        self._cooling: dict[tuple[str, str, int], tuple[float, int]] = {}
        #: id(optimizer) -> (the optimizer, weakly; per group: the group, its lr before the factor, the lr written)
        self._lowered: dict[int, tuple["weakref.ref[torch.optim.Optimizer]", list[tuple[dict[str, Any], Any, Any]]]] = {}
        self._rewinds: dict[tuple[str, str, int], int] = defaultdict(int)
        self._rewinding: Optional[tuple[Healer, int]] = None  # restore at this step's end
        self._said = Once()

    @property
    def heals(self) -> bool:
        return bool(self.order)

    def carried(self) -> Carried:
        """The state a hot reload carries (`adopt`), taken before the attachment is removed."""
        return Carried(dict(self._cooling), dict(self._rewinds), [] if self.snapshots is None else self.snapshots.kept)

    def adopt(self, carried: Carried, same: set[tuple[str, str]], step: int) -> None:
        """After a hot reload: the cool-downs in force and rewind counts of the rules in `same` (unchanged), and the
        snapshots (while the new policies take any); a cool-down of a changed or removed rule ends, said."""
        for name, (factor, until) in carried.cooling.items():
            if until <= step:
                continue
            if name[:2] in same:
                self._cooling[name] = (factor, until)
            else:
                log.warning("%s/%s: its cool-down (learning rate x%g until step %d) ends at the reload at step %d: "
                            "the rule was changed or removed", name[0], name[1], factor, until - 1, step)
        if self._cooling:
            self._factor = min(factor for factor, _ in self._cooling.values())
            self._until = max(until for _, until in self._cooling.values())
        for name, count in carried.rewinds.items():
            if name[:2] in same:
                self._rewinds[name] = count
        if self.snapshots is not None and carried.kept:
            self.snapshots.kept = carried.kept[-self.snapshots.keep:]

    def choose(self, fired: Sequence[tuple[tuple[str, str], int]]) -> int:
        """The place + 1 in `order` of the alert a step takes among those that `fired` ((rule key, index)); 0 for none."""
        places = [i for i, h in enumerate(self.order) if (h.key, h.index) in fired]
        return max(places) + 1 if places else 0

    def decided(
        self, report: StepReport, step: int, optimizer: bool,
    ) -> dict[tuple[tuple[str, str], int], str]:
        """Act on the agreed `report.heal` at `step`: start a cool-down, or make the step a rewind (or a halt).

        Returns what became of each alert in `report.heals`, in words (its record's outcome): the
        one the step took says what it did, the others that another took the step.
        Without an `optimizer` stepping the model (one step per backward pass), there is no
        learning rate to lower and no update to replace: said once, nothing done.
        """
        chosen = self.order[report.heal - 1] if report.heal else None
        # a halt alert decides the step before any heal; a rewind past its max_rewinds halts it
        did = "" if chosen is None or report.halt is not None else self._take(chosen, report, step, optimizer)
        acted = did in (outcome("cool_down", True, "enforce"), outcome("rewind", True, "enforce"))
        outcomes: dict[tuple[tuple[str, str], int], str] = {}
        for key, index in report.heals:
            then = next(h.alert.then for h in self.order if (h.key, h.index) == (key, index))
            if chosen is None:
                outcomes[(key, index)] = not_taken(then, "the ranks hold different rules: no decision at this step")
            elif (chosen.key, chosen.index) == (key, index) and did:
                outcomes[(key, index)] = did
            elif report.halt is not None:
                outcomes[(key, index)] = not_taken(then, "the run halts at this step")
            elif acted:
                outcomes[(key, index)] = not_taken(
                    then, f"{_A[chosen.alert.then]} by {chosen.policy}/{chosen.rule} took the step")
            else:  # the rung chosen could not act: it took the step, and did not do what it names
                outcomes[(key, index)] = not_taken(
                    then, f"the step went to {_A[chosen.alert.then]} by {chosen.policy}/{chosen.rule}, which could "
                    "not act: " + ("step skipped" if report.skip else "step applied"))
        return outcomes

    def _take(self, healer: Healer, report: StepReport, step: int, optimizer: bool) -> str:
        """Take `healer`'s decision at `step`; what it did, in words."""
        if not optimizer:
            return self._cannot_act(healer, report, step, _NO_OPTIMIZER)
        cool = healer.alert.cool_down
        if cool is not None:
            starts = step >= self._until
            if starts:
                self._cooling.clear()
            name = (healer.policy, healer.rule, healer.index)
            factor, until = self._cooling.get(name, (cool.factor, 0))
            self._cooling[name] = (min(factor, cool.factor), max(until, step + cool.steps))
            self._factor = cool.factor if starts else min(self._factor, cool.factor)
            self._until = max(self._until, step + cool.steps)
            if starts:  # an extension is not said again: it fires at every step of a streak
                log.warning("%s/%s: learning rate x%g from step %d to step %d (longer if it fires again)",
                            healer.policy, healer.rule, self._factor, step, self._until - 1)
            return outcome("cool_down", True, "enforce")
        rewind = healer.alert.rewind
        assert rewind is not None  # heal_order holds cool-downs and rewinds only
        name = (healer.policy, healer.rule, healer.index)
        if self._rewinds[name] >= rewind.max_rewinds:
            report.halt = Halt(healer.policy, healer.rule, step,
                               f"{healer.policy}/{healer.rule}: would rewind at step {step} a "
                               f"{self._rewinds[name] + 1}th time (max_rewinds: {rewind.max_rewinds}); halting")
            return not_taken("rewind", f"max_rewinds: {rewind.max_rewinds} reached; halting")
        target = None if self.snapshots is None else self.snapshots.pick(step, rewind.back)
        changed = [] if target is None or self.snapshots is None else self.snapshots.changed(target)
        if target is None or changed:
            why = ("no snapshot is taken of this model" if self.snapshots is None else
                   f"the model changed since the snapshot taken after step {target - 1} "
                   f"({'; '.join(changed[:6])}{'; ...' if len(changed) > 6 else ''})" if target is not None and changed
                   else self.snapshots.missing())
            return self._cannot_act(healer, report, step, why, said=why if changed else "")
        report.skip = True  # the update is not applied; the snapshot comes back at the step's end
        self._rewinds[name] += 1
        self._rewinding = (healer, target)
        return outcome("rewind", True, "enforce")

    def _cannot_act(self, healer: Healer, report: StepReport, step: int, why: str, said: str = "") -> str:
        """`healer` fired and cannot do what it names: the ladder climbs instead of stalling.

        A rung that cannot act does not heal, so it must not hold the ladder where it is:
        a cool-down with no learning rate to lower goes to the rewind of its rule (if it has
        one), and a rewind with nothing to go back to skips the step and spends one of its
        `max_rewinds`, so that a spike that persists reaches the halt past them instead of
        being skipped step after step (a run skipped to death exits 0 with a useless model).
        """
        then = healer.alert.then
        bound = self._bounded.get(healer.key)
        if bound is not None and any(held for (rule, *_), held in report.bounded if rule == healer.key):
            if self._said(("left", then, healer.key)):
                log.warning("%s/%s: cannot %s at step %d (%s): the step is applied, as its skip_step says past "
                            "max_in_a_row: %d (the weights made the spike; said once)", healer.policy, healer.rule,
                            "cool down" if then == "cool_down" else "rewind", step, why, bound)
            return not_taken(then, f"{why}: the step is its rule's skip_step's (max_in_a_row: {bound})")
        if then == "cool_down":
            climb = next((h for h in self.order if h.key == healer.key and h.alert.then == "rewind"), None)
            if self._said(("cannot", then, healer.key)):
                log.warning("%s/%s: cannot cool down at step %d (%s)%s (said once)", healer.policy, healer.rule, step,
                            why, f": its rewind (max_rewinds: {climb.alert.rewind.max_rewinds}) takes the step"
                            if climb is not None and climb.alert.rewind is not None else "; not taken")
            if climb is None:
                return not_taken(then, why)
            taken = self._take(climb, report, step, optimizer=why != _NO_OPTIMIZER)
            return not_taken(then, f"{why}: its rewind took the step, {taken}")
        rewind = healer.alert.rewind
        assert rewind is not None
        name = (healer.policy, healer.rule, healer.index)
        self._rewinds[name] += 1  # a rung that could not act is spent like one that did
        if self._rewinds[name] > rewind.max_rewinds:
            report.halt = Halt(healer.policy, healer.rule, step,
                               f"{healer.policy}/{healer.rule}: could not rewind at step {step} ({why}) "
                               f"{self._rewinds[name]} times, past max_rewinds: {rewind.max_rewinds}; halting")
            return not_taken("rewind", f"{why}; max_rewinds: {rewind.max_rewinds} spent; halting")
        report.skip = True
        if healer.key not in report.skip_by:  # a skip like any other: hookpolicy_skipped_steps_total counts it
            report.skip_by.append(healer.key)
            report.skip_rule = report.skip_rule or healer.key
        if self._said(("cannot rewind", name, said)):  # `said`: each way the model changed is said once
            log.warning("%s/%s: cannot rewind at step %d (%s): step skipped instead, counted as one of its "
                        "max_rewinds (%d) so that a spike that stays reaches the halt (said once; each such step is "
                        "counted in hookpolicy_skipped_steps_total)", healer.policy, healer.rule, step, why,
                        rewind.max_rewinds)
        return not_taken("rewind", f"{why}: step skipped instead ({self._rewinds[name]} of max_rewinds "
                                   f"{rewind.max_rewinds})")

    def before(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Before `optimizer` updates at `step`: the snapshot's copies are done; a cool-down lowers its lr.

        The lr is lowered in whichever optimizer steps the model now (one the script made
        again included). What was lowered for an update whose post-hook never ran (the step
        raised after the pre-hooks: torch runs no post-hook then) is put back first, where
        nobody wrote the group's lr since.
        """
        if self.snapshots is not None:
            self.snapshots.before_update(optimizer)
        stale = self._lowered.pop(id(optimizer), None)
        if stale is not None:
            _put_back(stale[1])
        if step < self._until:
            groups = []
            for group in optimizer.param_groups:
                lr = group["lr"]
                group["lr"] = lr * self._factor
                groups.append((group, lr, group["lr"]))
            self._lowered[id(optimizer)] = (weakref.ref(optimizer), groups)

    def after(self, optimizer: torch.optim.Optimizer) -> None:
        """After `optimizer`'s update: its groups' lr as they were before the cool-down's factor (the same object)."""
        lowered = self._lowered.pop(id(optimizer), None)
        if lowered is not None and lowered[0]() is optimizer:
            _put_back(lowered[1])

    def step_ended(self, step: int) -> bool:
        """At the end of `step`: restore the snapshot of a rewind (True), or take one when it is due.

        Never raises into the step: a snapshot that cannot be taken or put back (no host
        memory) is a fault of the rules that rewind (`fail`), and the step stays skipped.
        """
        if self.snapshots is None:
            return False
        if self._rewinding is not None:
            healer, target = self._rewinding
            self._rewinding = None
            try:
                restored, not_back = self.snapshots.restore(target)
            except Exception as exc:  # noqa: BLE001 - a fault of the rule, not of the script
                self._failed([healer.key], exc)
                return False
            rewind = healer.alert.rewind
            if not_back and not_back[0].startswith("the model changed"):
                if self._said(("not restored", not_back[0])):
                    log.warning("%s/%s: cannot rewind at step %d: %s; the step is skipped instead",
                                healer.policy, healer.rule, step, not_back[0])
                return False
            self._store.inc(REWINDS, healer.key)
            count = self._rewinds[(healer.policy, healer.rule, healer.index)]
            log.warning("%s/%s: rewound at step %d to the snapshot taken after step %d: the %d steps %d..%d are "
                        "dropped (rewind %d of %d)", healer.policy, healer.rule, step, restored - 1,
                        step - restored + 1, restored, step, count, 0 if rewind is None else rewind.max_rewinds)
            for line in not_back:
                if self._said(("not restored", line)):
                    log.warning("%s/%s: rewind at step %d: %s (said once)", healer.policy, healer.rule, step, line)
            return True
        try:
            self.snapshots.take_if_due(step)
        except Exception as exc:  # noqa: BLE001 - a fault of the rules that rewind, not of the script
            self._failed([h.key for h in self.order if h.alert.then == "rewind"], exc)
        return False

    def _failed(self, keys: Sequence[tuple[str, str]], exc: Exception) -> None:
        """A fault of the rules `keys` (`fail`); once none of them is in force, no snapshot is taken any more."""
        if self._fail is None:
            raise exc
        on = [self._fail(key, exc) for key in dict.fromkeys(keys)]
        if not any(on) and self.snapshots is not None:
            self.snapshots.release()
            self.snapshots = None


def _put_back(groups: Sequence[tuple[dict[str, Any], Any, Any]]) -> None:
    """Each group's lr as it was before the factor, where the group's lr is still the one the factor wrote."""
    for group, lr, written in groups:
        if group.get("lr") is written:
            group["lr"] = lr
