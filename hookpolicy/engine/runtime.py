"""The runtime: one attached policy set, coordinating the engine's parts.

`Attached` builds the parts and wires them; it does not run hooks itself:

- `steps.StepTracker` (with `steps.Phase`): the root module's hooks, backward passes and
  optimizer steps, calling back `begin_step`/`end_step`/`discard_step` here;
- `installer.HookInstaller`: the module hooks of the rules active this step;
- `executor.Executor`: the hook bodies, the compiled actions, error containment, and the
  buffer of device-side statistics;
- `readback.Readback`: at a step boundary, one transfer of the buffer, statistics,
  metrics, sinks, and a `StepReport` (skip, halt, sink errors, time) acted on here;
- `module_hooks.watch`: a module or parameter assigned inside the model (`model.head =
  ...`, LoRA injection) marks the plan stale; it is rebuilt and the rules bound anew at
  the next step boundary (`_replan_if_changed`), never between a step's micro-batches.

Hooks are global state on the user's model: every handle is kept and `remove()` (also
on exceptions, through the context manager) takes all of them off again.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections import defaultdict
from dataclasses import replace
from typing import Callable, Mapping, Optional, Sequence

import torch
from prometheus_client import CollectorRegistry

from .. import environment
from ..errors import Halt, HookPolicyError, PolicyError
from ..export.metrics import (
    ACTIONS, ALERT_FIRING, ALERTS, HOOK_ERRORS, HOOK_SECONDS, LAST_STEP_TIMESTAMP, POLICY_INFO,
    SERIES_DROPPED, SKIPPED_STEPS, STEPS, Labels, ModelMetrics, store_for,
)
from ..export.sinks import output_root
from ..plan.matcher import model_class
from ..plan.planner import Plan, build_plan
from ..policy.model import LOSS, Alert, Clip, Policy, Rule, Scale
from . import module_hooks
from .executor import Executor
from .history import History
from .installer import HookInstaller
from .loss import LossTap
from .distributed import agree, agreeing, decode, encode
from .readback import Readback, StepReport
from .rulestate import MAX_ERRORS, RuleState, rebind, rule_states
from .steps import Phase, StepTracker

__all__ = ["Attached", "MAX_ERRORS"]

log = logging.getLogger("hookpolicy")


class Attached:
    """Policies attached to one model; a context manager whose `remove()` is idempotent.

    Create it with `PolicySet.attach(model)`. `plan` is what was compiled; `step` is the
    number of optimizer steps evaluated so far (the step the next update belongs to),
    starting from `start_step` (a reloaded policy continues where the old one stopped).
    `on_halt(halt)` is called just before a `Halt` is raised, so a launcher learns of it
    even when the script catches it.
    """

    def __init__(
        self, policies: Sequence[Policy], model: torch.nn.Module, *,
        registry: Optional[CollectorRegistry] = None, rank: Optional[int] = None, audit: bool = False,
        start_step: int = 0, on_halt: Optional[Callable[[Halt], object]] = None, strict: bool = False,
    ) -> None:
        self.model = model
        self._on_halt = on_halt
        self.policies = tuple(policies)
        self.plan: Plan = build_plan(self.policies, model)
        if strict and self.plan.unmatched:  # before anything is installed: nothing half-attached
            raise PolicyError(self.plan.unmatched)
        self.rank = environment.rank(os.environ) if rank is None else rank
        self.step = start_step
        self.store: ModelMetrics = store_for(registry, self.rank).for_model(model, model_class(model))
        self._audit = audit
        self._rules = rule_states(self.plan, audit)
        phase = Phase()
        #: the past values of the series that history functions read (alerts, adaptive clips)
        self.history = History()
        self._executor = Executor(self._rules, phase, self.store, lambda: self.step, self._halting, self.history)
        self._installer = HookInstaller(self.plan, self._rules, self._executor)
        self._report = Readback(self.store, self.policies, output_root(), self.rank, self.history)
        # Whether a step's decision must be every rank's (one collective a step, see distributed.py).
        self._decides = any(
            isinstance(a, Alert) and a.then in ("skip_step", "halt")
            for rs in self._rules.values() if rs.enforce for a in rs.rule.actions
        )
        self._removed = False
        for warning in self.plan.warnings:
            log.warning("%s", warning)
        _claim_model(model, self.policies)  # from here on nothing raises before the hooks are in
        self._publish_initial_series(audit)
        self._tracker = StepTracker(model, self, phase)
        self._loss: Optional[LossTap] = None
        if any(rule.target == LOSS for policy in self.policies for rule in policy.rules):
            self._loss = self._tracker.loss_tap = LossTap(self.store.model)
        self._stale = False  # the model's tree changed since the plan was built
        self._forwarded = False  # a training forward ran in this step
        self._watching = module_hooks.watch(model, self)
        self._warn_self_reducing()
        self._activate()

    def _publish_initial_series(self, audit: bool) -> None:
        """Create every counter at 0, so `increase()` sees the first event and dashboards list the run."""
        for policy in self.policies:
            self.store.set(POLICY_INFO, (policy.name, policy.revision, "audit" if audit else policy.mode), 1.0)
            self.store.inc(SERIES_DROPPED, (policy.name,), 0)
        for rs in self._rules.values():
            self._publish_rule_series(rs)
        self.store.raise_to(STEPS, (), self.step)
        self.store.config_loaded()

    def _publish_rule_series(self, rs: RuleState) -> None:
        self.store.inc(HOOK_ERRORS, rs.key, 0)
        for action in rs.rule.actions:
            if isinstance(action, Alert):
                self.store.inc(ALERTS, (*rs.key, action.severity), 0)
                self.store.set(ALERT_FIRING, (*rs.key, action.severity), 0.0)
                if action.then == "skip_step":
                    self.store.inc(SKIPPED_STEPS, rs.key, 0)

    # -- public handle -----------------------------------------------------------------
    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Take every hook off the model, flush what was captured; safe to call twice; never raises.

        It runs in `finally` blocks, at a hot reload and at interpreter exit, where an
        exception would end the training script (or print a traceback at exit): what fails
        while flushing (a full disk) is a fault of its rule, reported and counted like one.
        """
        if self._removed:
            return
        self._removed = True
        _release_model(self.model, self.policies)
        self._watching.remove()
        self._tracker.remove()
        self._installer.remove()
        if self._loss is not None:
            self._loss.remove()
        try:
            self._readback(final=True)
        except Halt:
            pass
        finally:
            self._report.close()
            for policy in self.policies:
                self.store.forget_policy(policy.name)
                for family in (POLICY_INFO, ALERT_FIRING):
                    self.store.drop(family, _not_of(policy.name))

    @property
    def removed(self) -> bool:
        return self._removed

    def carry_history(self, previous: "Attached") -> None:
        """Take over the history of `previous` (a hot reload) for every rule it ran unchanged.

        A rule is unchanged when it equals its namesake in `previous` but for its place in
        the file; a changed rule starts with an empty history (its windows, warmup and
        emas begin again). Called between the two attachments, before this one's first step.
        """
        same = [key for key, rs in self._rules.items()
                if key in previous._rules and replace(previous._rules[key].rule, index=rs.rule.index) == rs.rule]
        self.history.series.update(previous.history.carry(same).series)

    def last_values(self) -> Mapping[str, Mapping[Labels, float]]:
        """The latest value of every statistic this attachment computed, read-only.

        `{family: {(policy, rule, module, tensor): value}}`, e.g.
        `last_values()["hookpolicy_grad_l2_norm"][("guard", "clip", "head", "weight")]`:
        what the last read-back published (Prometheus' families and labels, without
        `rank`). Kept after `remove()`, when the exported gauges are gone; series beyond
        `spec.limits.maxSeries`, which are not exported, are included.
        """
        return self._report.last_values()

    # -- step events (called by StepTracker) -------------------------------------------
    def begin_step(self, left_out: frozenset[int] = frozenset()) -> bool:
        """Run the step rules (on the parameters not in `left_out`), read everything back, decide alerts;
        True to skip the step."""
        self._replan_if_changed()
        rules = self._installer.step_rules()
        loss = None
        if self._loss is not None:
            loss = self._loss.take(self.step, ["/".join(rs.key) for rs in rules if rs.rule.target == LOSS])
        self._executor.run_step_rules(rules, loss, left_out)
        return self._readback(decide=True)

    def end_step(self) -> None:
        self.step += 1
        self.store.raise_to(STEPS, (), self.step)
        self.store.set(LAST_STEP_TIMESTAMP, (), time.time())
        self._forwarded = False
        self._replan_if_changed()
        self._activate()

    def _activate(self) -> None:
        """The hooks of the rules active on this step; the loss looked for only if a loss rule is among them."""
        self._installer.activate(self.step)
        if self._loss is not None:
            self._loss.set_active(any(rs.rule.target == LOSS for rs in self._installer.step_rules()))

    def discard_step(self) -> None:
        self._executor.buffer.clear()
        if self._loss is not None:
            self._loss.clear()
        self._forwarded = False

    def training_forward(self) -> None:
        if self._stale and not self._forwarded:
            self._replan_if_changed()
        self._forwarded = True

    # -- the model's tree changes (called by module_hooks) -----------------------------
    def tree_changed(self, parent: torch.nn.Module, name: str, value: object) -> None:
        """`parent.name = value` is about to land inside the model: re-plan at the next step boundary."""
        if parent._modules.get(name, parent._parameters.get(name)) is not value:
            self._stale = True

    def _replan_if_changed(self) -> None:
        """Bind the rules anew to the model as it is now, if its tree changed since the plan.

        Called where no step is half-governed: before a step's first training forward,
        before its step rules, after its update. The new hooks go in at the installer's
        next `activate`; series of modules no longer bound are removed.
        """
        if not self._stale or self._removed:
            return
        self._stale = False
        try:
            plan = build_plan(self.policies, self.model)
        except Exception as exc:  # noqa: BLE001 - a guardrail that cannot re-plan must not stop training
            log.warning("the model changed at step %d and cannot be planned again (%s: %s); "
                        "the policies stay bound to the modules they had", self.step, type(exc).__name__, exc)
            return
        gone = {b.module for b in self.plan.bindings} - {b.module for b in plan.bindings}
        self.plan = plan
        for rs in rebind(self._rules, plan, self._audit):
            self._publish_rule_series(rs)
        self._executor.rules_changed()
        self._installer.rebind(plan)
        self._activate()
        self._tracker.refresh()
        self._watching.update(list(self.model.modules()))
        self._warn_self_reducing()
        for warning in plan.warnings:
            log.warning("%s", warning)
        for policy in self.policies:
            self.store.forget_modules(policy.name, gone)
        log.info("the model changed at step %d: %d binding(s) now", self.step, len(plan.bindings))

    def _warn_self_reducing(self) -> None:
        """Say once per class when its copies would carry hookpolicy's hooks (it reduces itself)."""
        hooked = {type(self.model), *(type(b.obj) for b in self.plan.bindings if b.hook != "step")}
        for cls in hooked - _CHECKED_CLASSES:
            _CHECKED_CLASSES.add(cls)
            if module_hooks.reduces_itself(cls):
                log.warning("%s defines its own __reduce_ex__/__reduce__, so a copy, pickle or "
                            "torch.save of it would carry hookpolicy's hooks; remove() the policy before copying it",
                            cls.__qualname__)

    def eval_forward_done(self) -> None:
        if self._executor.buffer:
            self._readback()  # an evaluation loop steps no optimizer: read back per batch

    def unguardable(self, reason: str, refuse: bool) -> None:
        """Say once that step rules cannot act as written here; with `refuse`, switch off those that would change anything.

        A rule that would clip, scale, skip or halt in enforce mode is refused rather than
        run as a no-op or on partial gradients; audit and capture-only rules keep running
        and their numbers come with this warning.
        """
        step_rules = [rs for rs in self._rules.values() if rs.rule.trigger.at == "step"]
        if not step_rules:
            return
        refused = [rs for rs in step_rules if refuse and rs.enforce and not rs.off and _acts(rs.rule)]
        for rs in refused:
            rs.refused = reason
        tail = f"; refused: {', '.join('/'.join(rs.key) for rs in refused)}" if refused else ""
        log.warning("%s: %s%s", self.store.model, reason, tail)

    # -- readback ----------------------------------------------------------------------
    def _readback(self, final: bool = False, decide: bool = False) -> bool:
        """Report the buffered statistics (one transfer) and decide the step; True to skip it.

        `final` (at `remove()`) publishes what is left but takes no skip or halt decision;
        `decide` (at a step, not at an evaluation forward) makes the decision every rank's.
        A sink that failed is a fault of its rule (`Executor.fail`: counted, maybe a Halt).
        """
        run = self._executor
        entries, run.buffer = run.buffer, []
        report = self._report.run(entries, self.step, final)
        for key, seconds in report.seconds.items():
            run.seconds[key] += seconds
        for rs, exc in report.errors:
            run.fail(rs, exc)
        self._flush_counters()
        if decide and agreeing(self._decides):
            self._agree(report)
        if not report.skip and not final:  # a skipped step did not happen: its values never become the baseline
            self.history.commit(report.observed)
        if report.halt is not None:
            raise self._halting(report.halt)
        return report.skip

    def _agree(self, report: StepReport) -> None:
        """One small collective: a skip or halt decided on any rank becomes this rank's too (distributed.agree)."""
        keys = list(self._rules)
        halt = report.halt
        codes = agree(encode(None if report.skip_rule is None else keys.index(report.skip_rule)),
                      encode(None if halt is None else keys.index((halt.policy, halt.rule))))
        other_skip, other_halt = decode(codes[0]), decode(codes[1])
        if not report.skip and other_skip is not None:
            report.skip, report.skip_rule = True, keys[other_skip[0]]
            self.store.inc(SKIPPED_STEPS, report.skip_rule)
            log.warning("%s/%s: step %d skipped, as rank %d decided", *report.skip_rule, self.step, other_skip[1])
        if halt is None and other_halt is not None:
            policy, rule = keys[other_halt[0]]
            report.halt = Halt(policy, rule, self.step, f"rank {other_halt[1]} halted; every rank stops at the same step")

    def _halting(self, halt: Halt) -> Halt:
        """Tell `on_halt` before the Halt propagates: the script may catch or hide it."""
        if self._on_halt is not None:
            self._on_halt(halt)
        return halt

    def _flush_counters(self) -> None:
        run = self._executor
        counts: dict[tuple[str, ...], int] = defaultdict(int)
        for labels, _ in run.ran:
            counts[labels] += 1
        for labels, count in counts.items():
            self.store.inc(ACTIONS, labels, count)
        for key, seconds in run.seconds.items():
            self.store.inc(HOOK_SECONDS, key, seconds)
        run.ran.clear()
        run.seconds.clear()


#: module classes `_warn_self_reducing` has looked at
_CHECKED_CLASSES: set[type] = set()

#: model -> names of the policies attached to it, so a policy is never applied twice to one model.
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, set[str]]" = weakref.WeakKeyDictionary()


def _claim_model(model: torch.nn.Module, policies: Sequence[Policy]) -> None:
    names = _ATTACHED.setdefault(model, set())
    twice = sorted(names.intersection(p.name for p in policies))
    if twice:
        raise HookPolicyError(
            f"policy {', '.join(twice)} is already attached to this {type(model).__name__}; "
            "remove() the first attachment before attaching it again"
        )
    names.update(p.name for p in policies)


def _release_model(model: torch.nn.Module, policies: Sequence[Policy]) -> None:
    _ATTACHED.get(model, set()).difference_update(p.name for p in policies)


def _acts(rule: Rule) -> bool:
    """Whether a rule changes training: a clip or scale, or an alert that skips the step or halts."""
    return any(isinstance(a, (Clip, Scale)) or (isinstance(a, Alert) and a.then != "log") for a in rule.actions)


def _not_of(policy: str) -> Callable[[tuple[str, ...]], bool]:
    return lambda labels: labels[0] != policy
