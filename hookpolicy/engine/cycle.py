"""The step cycle: what happens at one step of one attached model, in the order it happens.

Before the update (`before_update`, the optimizer step pre-hook; or, for a script that
steps no optimizer, the end of its backward pass):

    scope -> active rules -> loss -> execute -> read back -> decide -> agree (and reduce the loss)
          -> the job's loss rules (the same read-back) -> publish -> the alerts that fired, every rank's
          (wake rules: `trigger.after`; the bounded skips among them) -> heal -> the skips held back past `max_in_a_row` (applied unless
          their rule's heal acted) -> write the alert records (what each did) -> commit history
          -> hide gradients -> lower the lr (a cool-down)

After it (`after_update`): restore the hidden gradients -> measure the update (`updates`,
read back at the next read-back) -> the lr as it was -> at the step's end, restore a
snapshot (a rewind) or take one -> count the step -> activate the next step's rules (the woken among them).

The parts below the cycle do one job each and return what they found; none calls the
cycle back. `steps.StepTracker` tells where steps begin and end (and which parameters a
step covers, `steps.Scopes`); `executor.HookInstaller` says which rules are active; the hook
bodies (`executor.Executor`, through `programs.Programs`) append to the step's `Ledger`,
which the cycle owns; the read-back (`readback.Readback`) reads the ledger's entries and
returns a decision (skip, halt, faults of sinks, time); `agreement.Agreement` makes that
decision every rank's; `history.History.commit` keeps what a step that happened saw;
`steps.HiddenGrads` hides a skipped step's gradients from its optimizers; `healing.Healing`
holds a cool-down's learning rate factor and a rewind's snapshots. The cycle
also installs the root module's two hooks (the phase of each forward, backward passes)
and has the rules re-bound when the model's tree changed (`executor.Rebinding`), at a step
boundary only.

Three paths read the ledger back, each a method of its own: a step's (`_decide`: read back,
agree, heal, commit), an evaluation forward's (`_evaluation`: publish only; a script's eval
loop steps no optimizer) and the last one at `remove()` (`_last`: what is left, no decision).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections import Counter
from operator import itemgetter
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..errors import Halt
from ..export.metrics import ACTIONS, AGREEMENT_WAIT, HOOK_SECONDS, SKIPPED_STEPS
from ..export.store import ModelMetrics
from ..export.sinks import output_root
from ..plan.planner import Plan
from ..policy.model import AFTER_UPDATE, LOSS, AlertKey, Policy, rule_name
from .hooks import module_hooks, optimizer_hooks, tensor_hooks
from .hooks.contain import each_contained
from .decide.agreement import Agreed, Agreement, job_loss_rule, reduced
from .hooks.wrappers import data_parallel
from .decide.alerts import StepReport
from .execute.executor import Executor, HookInstaller, Rebinding, named_tensors
from .execute.programs import Faults, Programs
from .heal.healing import Healing
from .measure.history import History
from .execute.ledger import Ledger, Ran
from .hooks.loss import LossTap
from .decide.readback import Reading, Readback
from .decide.replicas import Replicas
from .measure.rulestate import RuleState, rule_states
from .execute.steps import HiddenGrads, Phase, Scopes, StepTracker
from .execute.updates import Updates

__all__ = ["StepCycle", "Leftovers"]

log = logging.getLogger("hookpolicy")


class StepCycle:
    """The steps of one attached model; see the module docstring.

    Built before anything is installed (nothing here raises once `start()` ran);
    `remove()` takes every hook off and publishes what is left.
    """

    def __init__(
        self, model: torch.nn.Module, policies: Sequence[Policy], plan: Plan, store: ModelMetrics, rank: int,
        audit: bool, start_step: int, halting: Callable[[Halt], Halt], generation: int = 0,
    ) -> None:
        self.model = model
        self.store = store
        #: the step the next update belongs to
        self.step = start_step
        self._halting = halting
        self.rules = rule_states(plan, audit)
        #: the past values of the series that history functions read (alerts, adaptive clips)
        self.history = History(budgets={policy.name: policy.max_history_values for policy in policies})
        self.ledger = Ledger()
        self._faults = Faults(store, lambda: self.step, halting, self.ledger, lambda: self.agreement.active())
        phase = Phase()
        self.programs = Programs(self.rules, self.ledger, self._faults, self.history)
        self.executor = Executor(self.rules, phase, self._faults, self.programs)
        self.installer = HookInstaller(plan, self.rules, self.executor)
        self.agreement = Agreement(policies, self.rules, generation, model)
        self._steps = StepTracker(model, phase, self.rules, store.model)
        self.replicas = Replicas(model)
        self.readback = Readback(store, policies, output_root(), rank, self.history, self.replicas.exported)
        self._hidden = HiddenGrads()
        self.updates = Updates(self.programs)
        #: `then: cool_down` and `then: rewind`, and the snapshots a rewind goes back to
        self.healing = Healing(model, policies, store, self._heal_fault)
        self._loss: Optional[LossTap] = None
        if any(rule.target == LOSS for policy in policies for rule in policy.rules):
            self._loss = LossTap(store.model, _WeakReached(self._steps.scopes))
            self._loss.owner = _WeakFaults(self, loss_only=True)
        self._rebinding = Rebinding(model, policies, plan, self.rules, store, audit,
                                    (self.executor, self.programs, self.agreement), self.installer, self._steps)
        self._rebinding.fault = _WeakFaults(self).fault
        self._forwarded = False  # a training forward ran in this step
        self._checked_parallel = False  # whether the model showed data parallelism was looked at (job's loss)
        #: the actions that ran at the last step counted (`_count`) and their counts per action's labels
        self._ran: set[Ran] = set()
        self._ran_counts: list[tuple[tuple[str, ...], int]] = []
        self._removed = False
        self._handles: list[Any] = []
        #: no `step` rule active on this step and no loss tapped (`_activate`): an update evaluates nothing
        self._quiet = False

    def start(self) -> None:
        """Subscribe to optimizer steps, hook the root, watch the tree; activate the first step's rules."""
        self._handles.append(optimizer_hooks.subscribe(_WeakSteps(self), optimizer_hooks.STEP_TRACKING))
        self._handles.append(module_hooks.forward_pre_hook(self.model, self._pre_hook))  # each kept once made:
        self._handles.append(module_hooks.forward_hook(self.model, self._post_hook, always_call=True))  # remove()
        self._rebinding.start()
        self.replicas.start(self.rules)
        self._activate()

    def remove(self) -> None:
        """Every hook off, then the last read-back (no decision), then the sinks closed; never raises."""
        self._removed = True
        handles = self._handles + self.replicas.handles + self.healing.handles
        self._handles.clear()
        self.replicas.handles.clear()
        self.healing.handles.clear()
        snapshots = self.healing.snapshots  # a handle kept after remove() holds no copy of the model
        each_contained([
            ("the tree watch", self._rebinding.remove),
            *((f"a hook of the model ({type(h).__name__})", h.remove) for h in handles),
            *([("the snapshots", snapshots.release)] if snapshots is not None else []),
            ("the step tracking", self._steps.remove),
            ("the rules' module hooks", self.installer.remove),
            *([("the loss tap", self._loss.remove)] if self._loss is not None else []),
            ("the last read-back", self._last_contained),
            ("the sinks", self.readback.close),
        ])

    def _last_contained(self) -> None:
        """`_last`, its fault the model's rules' (counted, said; under `onError: halt` said: no step is left)."""
        try:
            self._last()
        except Halt:
            pass
        except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: said and counted, never out of remove()
            try:
                self.fault("the last read-back at remove()", exc)
            except Halt as halt:  # onError: halt, with no step left to halt: said instead
                log.error("hookpolicy: %s/%s: not halted (onError: halt): %s, after the model's last step",
                          halt.policy, halt.rule, halt.message)

    def leftovers(self) -> "Leftovers":
        """What `remove()` takes out of the process once the model is gone; none of it refers to the model."""
        return Leftovers([self._handles, self.installer.handles, self.replicas.handles, self.healing.handles],
                         self._rebinding.watching,
                         self._loss, self.readback)

    # -- the step --------------------------------------------------------------------------
    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer_hooks` subscriber: evaluate the step at its first update; hide the gradients to skip it."""
        if not self._steps.owns(optimizer):
            return
        left_out = self._steps.update_starts(optimizer)  # scope: None when this update continues the step
        if left_out is not None:
            self._steps.skipping = self._evaluate(left_out)
        if self._steps.skipping:
            self._hidden.hide(optimizer)
        else:
            self.updates.before(optimizer, self.installer.step_rules())
        self.healing.before(optimizer, self.step)

    def _evaluate(self, left_out: frozenset[int]) -> bool:
        """Run the step's rules on the parameters not in `left_out`, then decide the step; True to skip it.

        In a process group the loss rules that see the job's loss (`ranks: job`) wait for the
        agreement, whose collective carries every rank's loss; they run after it.
        """
        if self._rebinding.stale:  # the tree changed: bound anew first (which sets `_quiet` again)
            self._replan_if_changed()
        agreeing = self.agreement.active()  # a process group cannot come up during the step's evaluation
        if self._quiet and not agreeing and self.ledger.empty():
            return False  # no step rule, no loss, nothing measured: what `_decide` below would find, without its calls
        rules = self.installer.step_rules()
        job = [rs for rs in rules if job_loss_rule(rs)] if agreeing else []
        loss = self._take_loss([rs for rs in rules if rs.rule.target == LOSS and rs not in job])
        if job:
            self._say_not_data_parallel(job)
        self.programs.run_step_rules([rs for rs in rules if rs not in job] if job else rules, loss, left_out)
        return self._decide(job, loss, agreeing)

    def _take_loss(self, rules: Sequence[RuleState]) -> Optional[torch.Tensor]:
        """This rank's roots of the step; a missing loss is said for `rules` (those that would see this rank's)."""
        if self._loss is None:
            return None
        return self._loss.take(self.step, [rule_name(rs.key) for rs in rules])

    # -- the three read-backs: a step's, an evaluation forward's, the last one at remove() ----
    def _decide(self, job: Sequence[RuleState], loss: Optional[torch.Tensor], agreeing: bool) -> bool:
        """The step's read-back and decision, top to bottom; True to skip the step.

        Read back what the ledger holds (one transfer) -> agree with every rank on the skip,
        halt and heal, reducing this rank's `loss` with every rank's -> the same read-back
        takes what the agreement reduced (the job's loss to the rules `job`, the `ranks: job`
        statistics: host-side values) -> publish the step's statistics, all at once -> the
        step's heal (`_heal`, the one place that sets it) and what became of each alert that
        could heal -> the alert records -> skips counted -> the history committed.
        A sink that failed is a fault of its rule (`Faults.fail`: counted, maybe a Halt).
        `agreeing`: whether this attachment agrees at its steps (`Agreement.active`, asked once a step).
        """
        if not job and loss is None and self.ledger.empty() and not agreeing:
            return False  # an inactive step: nothing measured, nothing to report, agree on or decide
        layout = self.agreement.layout
        held = bool(layout.slots) and agreeing  # `ranks: job` statistics wait for the agreement
        done = self.ledger.close()
        reading = self.readback.read(done.entries, self.step, final=False, hold=reduced if held else None)
        report = reading.report
        if agreeing:
            self._fail(report)  # a sink fault's halt (onError: halt) goes into this step's agreement
        pending = self._faults.take_pending(self.step)
        if report.halt is None:
            report.halt = pending
        own = len(report.pending)
        agreed = self.agreement.agree(report, self.step, loss, layout.values(report.held) if held else (),
                                      heal=self.healing.choose(report.heals),
                                      fired=frozenset(p.key for p in report.pending)) if agreeing else None
        if agreed is not None:
            self.store.inc(AGREEMENT_WAIT, (), agreed.waited)
            later = self._agreed(job, agreed, loss)
            self.readback.add(reading, later.entries, decides=agreed.same)
            done.join(later)
        self._publish(reading, done)
        report.fired = _fired(report, agreed, own)
        self.readback.bounded(report, self.rules)  # every rank's alike: the counts in a row are kept from them
        self.installer.wake(report.fired, self.step)
        report.heal = self._heal(report, agreed)
        healed = self.healing.decided(report, self.step, self._steps.mode == "optimizer")
        self.readback.bounded_skips(report, healed)
        self._settle(report, healed, decided=True, step=self.step)
        for key in report.skip_by:
            self.store.inc(SKIPPED_STEPS, key)
        # a skipped step did not happen: its values never become the baseline (an earlier update's did)
        self.history.commit([o for o in report.observed if not report.skip or self._updated(o.key[0])])
        if report.halt is not None:
            raise self._halting(report.halt)
        return report.skip

    def _heal(self, report: StepReport, agreed: Optional[Agreed]) -> int:
        """The heal the step takes (`healing.heal_order` place + 1; 0 for none): the only place that sets it.

        Alone, this rank's choice. In a group, the highest any rank took (the agreement's MAX),
        and the job's loss rules' heals, which are every rank's as they are; none at a step
        where the ranks hold different rules.
        """
        if agreed is None:
            return self.healing.choose(report.heals)
        if not agreed.same:
            return 0
        return max(agreed.heal, self.healing.choose(report.heals))

    def _evaluation(self) -> None:
        """An evaluation forward's read-back (no optimizer steps): publish what it measured; it decides no step.

        A fault's halt kept for an agreement (`Faults.pending`) is taken here, alone, as an alert's halt is.
        """
        report = self._read_and_publish(final=False)
        pending = self._faults.take_pending(self.step)
        if report.halt is None:
            report.halt = pending
        self._say_held(report)
        self._settle(report, {}, decided=False)
        for key in report.skip_by:
            self.store.inc(SKIPPED_STEPS, key)
        self.history.commit([o for o in report.observed if not report.skip or self._updated(o.key[0])])
        if report.halt is not None:
            raise self._halting(report.halt)

    def _last(self) -> None:
        """At `remove()`: publish what the ledger still holds; no decision, nothing committed to the history."""
        report = self._read_and_publish(final=True)
        pending = self._faults.take_pending(self.step)
        if pending is not None:
            log.error("hookpolicy: %s/%s: not halted (onError: halt): the model's steps ended before the ranks "
                      "could agree on it", pending.policy, pending.rule)
        self._say_held(report)
        self._settle(report, {}, decided=False)

    def _say_held(self, report: StepReport) -> None:
        if report.held:  # outside a step: the other ranks may be gone, or elsewhere
            log.info("ranks: job statistics measured outside a training step (an unfinished step at detach) "
                     "are not reduced across ranks nor published")

    def _read_and_publish(self, final: bool) -> StepReport:
        """Read back what the ledger holds (one transfer) and publish it, outside a step's decision.

        The `ranks: job` statistics are held back (not reduced across ranks: the other ranks
        may be gone, or elsewhere) and not published (`_say_held`).
        """
        held = bool(self.agreement.layout.slots) and self.agreement.active()
        done = self.ledger.close()
        return self._publish(self.readback.read(done.entries, self.step, final, hold=reduced if held else None), done)

    def _publish(self, reading: Reading, done: Ledger) -> StepReport:
        """Publish a read-back's statistics, count what its ledger `done` recorded, hand its sink faults to `Faults`."""
        report = self.readback.publish(reading)
        self._count(done, report.seconds)
        self._fail(report)
        return report

    def _fail(self, report: StepReport) -> None:
        """Hand the sink faults `report` holds so far to `Faults` (each once)."""
        errors, report.errors = report.errors, []
        for rs, exc in errors:
            self._faults.fail(rs, exc)

    def _settle(self, report: StepReport, healed: Mapping[tuple[tuple[str, str], int], str], decided: bool,
                step: Optional[int] = None) -> None:
        """Write the alert records of `report` now that what their `then` did is known (and, at a decided `step`,
        the flight recorder's dumps); faults to `Faults`."""
        for rs, exc in self.readback.settle(report, healed, decided, step):
            self._faults.fail(rs, exc)

    def _agreed(self, job: Sequence[RuleState], agreed: Agreed, own: Optional[torch.Tensor]) -> Ledger:
        """What the agreement reduced, as the ledger records it: the job's loss as the entries of the rules
        `job`, and the `ranks: job` activation statistics.

        These values exist only after the collective; they are host-side (the agreement's
        rows), so the step's read-back takes them in with no transfer from the device.
        """
        if job and agreed.loss is None and self._loss is not None:
            self._loss.missing(self.step, [rule_name(rs.key) for rs in job], job=True)
        if job and agreed.loss is not None:
            self.programs.record_job_loss(job, *agreed.loss, own)
        if agreed.tail is not None:
            self.ledger.entries.extend(self.agreement.layout.entries(agreed.tail))
        return self.ledger.close()

    def _say_not_data_parallel(self, job: Sequence[RuleState]) -> None:
        """Once: a model in a process group in which no data parallelism shows still gets the job's loss; say so."""
        if self._checked_parallel:
            return
        self._checked_parallel = True
        if not data_parallel(self.model):
            import torch.distributed as dist
            log.warning(
                "%s: %s is in a process group of %d ranks but holds no DDP, FSDP or DTensor parameters: its loss "
                "rules see every rank's backward roots together, the job's loss when the ranks hold replicas of "
                "one model; if each rank trains a model of its own, or under pipeline parallelism (a stage's "
                "backward from the next stage's gradient is no loss), write ranks: own",
                ", ".join(rule_name(rs.key) for rs in job), self.store.model, dist.get_world_size())

    def _updated(self, rule: tuple[str, str]) -> bool:
        """Whether `rule` measures an update already applied (`updates`): a skip now does not undo it."""
        rs = self.rules.get(rule)
        return rs is not None and rs.rule.target in AFTER_UPDATE

    def _count(self, done: Ledger, seconds: dict[tuple[str, str], float]) -> None:
        """`hookpolicy_actions_total` (once per step and binding) and `hookpolicy_hook_seconds_total`."""
        if done.ran != self._ran:  # counted again only when other actions or modules ran than last time
            self._ran, self._ran_counts = done.ran, list(Counter(map(itemgetter(0), done.ran)).items())
        self.store.inc_all(ACTIONS, self._ran_counts)  # bindings per action's labels
        for key, spent in seconds.items():
            done.seconds[key] += spent
        self.store.inc_all(HOOK_SECONDS, done.seconds.items())

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer_hooks` subscriber: restore hidden gradients and state; at the step's end, count and activate."""
        if not self._steps.owns(optimizer):
            return
        self._hidden.restore(optimizer)
        self.updates.after(optimizer, self.step, self._steps.skipping)
        self.healing.after(optimizer)
        if self._steps.update_ends(optimizer):
            if self.healing.step_ended(self.step):
                self.readback.restart_streaks()
            self._end_step()

    def _end_step(self) -> None:
        self.step += 1
        self.store.step_ended(self.step, time.time())  # STEPS raised to it, LAST_STEP_TIMESTAMP now: one lock
        self._forwarded = False
        if self._rebinding.stale:  # else `_replan_if_changed` has nothing to do
            self._replan_if_changed()
        self._activate()

    @property
    def plan(self) -> Plan:
        return self._rebinding.plan

    def _replan_if_changed(self) -> None:
        """Bind the rules anew if the model's tree changed (`executor.Rebinding`), and activate them."""
        if not self._removed and self._rebinding.rebind(self.step):
            self._activate()

    def _activate(self) -> None:
        """The hooks of the rules active on this step; the loss looked for only if a loss rule is among them."""
        self.installer.activate(self.step)
        if self._loss is not None:
            self._loss.set_active(any(rs.rule.target == LOSS for rs in self.installer.step_rules()))
        self._quiet = self._loss is None and not self.installer.has_step_rules

    def _heal_fault(self, key: tuple[str, str], exc: Exception) -> bool:
        """A snapshot that could not be taken or put back: a fault of rule `key`; whether the rule is still in force."""
        rs = self.rules.get(key)
        if rs is None or rs.off:
            return False
        self._faults.fail(rs, exc)
        return not rs.off

    def fault(self, where: str, exc: Exception, loss_only: bool = False) -> None:
        """A fault of hookpolicy's own part at `where` (a patch of torch, `hooks.contain`), done for this model's
        rules (its loss rules: `loss_only`): their containment (`Faults.fail_all`); a `Halt` under `onError: halt`."""
        rules = [rs for rs in self.rules.values() if not loss_only or rs.rule.target == LOSS]
        self._faults.fail_all(rules, where, exc)

    # -- the root's forward and backward passes ---------------------------------------------
    def entered(self, args: Any) -> None:
        """The root's call under way when it was attached (`Attached.entered`): its pre-hook, run now."""
        self._pre_hook(self.model, args)

    # Each hook torch calls is contained: a fault of the cycle's own is `fault`, never the script's exception.
    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        try:
            self._root_pre(module, args)
        except Halt:
            raise
        except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: contained
            self.fault("the model's forward pre-hook", exc)

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        try:
            self._root_post(module, args, output)
        except Halt:
            raise
        except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: contained
            self.fault("the model's forward hook", exc)

    def _grad_hook(self, grad: torch.Tensor) -> None:
        """On the root's outputs: the first one to fire marks a backward pass and queues its end (`_pass_ended`).

        The end is queued twice, behind the callbacks queued during the pass. The engine runs
        its final callbacks in the order they were queued, including those queued by a
        callback (`GraphTask::exec_post_processing` walks the list by index). DDP's reducer
        queues `finalize_backward`, which writes the averaged gradients, when its last bucket
        is ready, after this first callback: queued from the first callback, the step of a
        script that steps no optimizer reads the gradients DDP averaged. The first callback
        is `functools.partial(queue_callback, self._pass_ended)`, no Python frame: called by
        the engine among its final callbacks, where a graph task is current, the one thing
        `queue_callback` checks.
        """
        try:
            if self._steps.backward_starts():
                engine = torch.autograd.Variable._execution_engine
                engine.queue_callback(functools.partial(engine.queue_callback, self._pass_ended))
        except Halt:
            raise
        except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: contained
            self.fault("the backward marker on the model's output", exc)

    def _pass_ended(self) -> None:
        try:
            if self._steps.backward_done():  # no optimizer steps this model: the backward pass is the step
                self.updates.no_optimizer(self.installer.step_rules(), self.store.model)
                if self._evaluate(frozenset()):
                    self._steps.zero_grads()
                self._end_step()
        except Halt:
            raise
        except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: contained
            self.fault("the end of the backward pass", exc)

    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self._steps.forward_starts(module):
            return
        if self._steps.dropped():  # GradScaler found inf: no optimizer took the step before
            self.ledger.discard()
            if self._loss is not None:
                self._loss.clear()
            self._forwarded = False
        if self._rebinding.stale and not self._forwarded:
            self._replan_if_changed()
        self._forwarded = True

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        training = self._steps.forward_ends()
        if training is False:
            if self.ledger.entries:
                self._evaluation()  # an evaluation loop steps no optimizer: read back per batch
        elif training:
            if isinstance(output, torch.Tensor):  # the usual root output: no walk
                if output.requires_grad and output.is_floating_point() and output.numel() > 0:
                    tensor_hooks.add(output, self._grad_hook)
                return
            for _, t in named_tensors(output, _ALL):
                if t.requires_grad:
                    tensor_hooks.add(t, self._grad_hook)



def _fired(report: StepReport, agreed: Optional[Agreed], own: int) -> frozenset[AlertKey]:
    """The alerts that fired at a step's decision, the same on every rank (`StepReport.fired`).

    Alone, those of `report`. In a group, those any rank saw (`Agreed.fired`, the row's bits)
    and those the read-back evaluated after the collective (`report.pending` past the first `own`):
    the job's loss rules and the `ranks: job` statistics, the same values on every rank, so
    the same alerts. None at a step where the ranks hold different rules.
    """
    if agreed is None:
        return frozenset(p.key for p in report.pending)
    if not agreed.same:
        return frozenset()
    return agreed.fired | frozenset(p.key for p in report.pending[own:])


def _ALL(name: str) -> bool:
    return True


class Leftovers:
    """The process-wide parts of a cycle whose model was dropped, and `remove()` to take them out.

    These are held by the process (the optimizer step subscription, the tree watch, the
    loss tap's share of the backward wrapper, the sinks' open files, the share each module
    hook has in `module_hooks`' process-wide patch, the snapshots' watch on LR schedulers
    and GradScalers being made) and hold the cycle only weakly, so they
    hold nothing of the model; the hooks themselves went with the model.
    Nothing is read back: what the model's last forwards captured after its last
    optimizer step is not written.
    """

    def __init__(
        self, handles: Sequence[list[Any]], watching: Optional[module_hooks.Watching], loss: Optional[LossTap],
        readback: Readback,
    ) -> None:
        self._handles, self._watching, self._loss, self._readback = handles, watching, loss, readback

    def remove(self) -> None:
        """Never raises: each part contained (`each_contained`)."""
        handles = [h for hs in self._handles for h in hs]  # the cycle's and the installer's lists, as they are now
        for hs in self._handles:
            hs.clear()
        each_contained([
            *((f"a hook of a dropped model ({type(h).__name__})", h.remove) for h in handles),
            *([("the tree watch", self._watching.remove)] if self._watching is not None else []),
            *([("the loss tap", self._loss.remove)] if self._loss is not None else []),
            ("the sinks", self._readback.close),
        ])


class _WeakSteps:
    """The cycle as the process-wide optimizer step subscriber sees it: weakly, so that the
    subscription list keeps no dropped model alive (the model's root hooks hold the cycle)."""

    def __init__(self, cycle: StepCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        cycle = self._cycle()
        if cycle is not None:
            cycle.before_update(optimizer)

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        cycle = self._cycle()
        if cycle is not None:
            cycle.after_update(optimizer)

    def fault(self, where: str, exc: Exception) -> None:
        cycle = self._cycle()
        if cycle is not None:
            cycle.fault(where, exc)


class _WeakFaults:
    """The cycle (or its loss rules) as the owner of a fault of a process-wide patch (`hooks.contain.Owner`): weakly."""

    def __init__(self, cycle: StepCycle, loss_only: bool = False) -> None:
        self._cycle = weakref.ref(cycle)
        self._loss_only = loss_only

    def fault(self, where: str, exc: Exception) -> None:
        cycle = self._cycle()
        if cycle is not None:
            cycle.fault(where, exc, self._loss_only)


class _WeakReached:
    """The model's scopes as its loss tap (held by the process-wide backward wrapper) sees them: weakly."""

    def __init__(self, scopes: Scopes) -> None:
        self._scopes = weakref.ref(scopes)

    @property
    def touched(self) -> bool:
        scopes = self._scopes()
        return scopes is not None and scopes.touched

    @touched.setter
    def touched(self, value: bool) -> None:
        scopes = self._scopes()
        if scopes is not None:
            scopes.touched = value
