"""The runtime: one attached policy set, coordinating the engine's parts.

`Attached` builds the parts and wires them; it does not run hooks itself:

- `steps.StepTracker` (with `steps.Phase`): the root module's hooks, backward passes and
  optimizer steps, calling back `begin_step`/`end_step`/`discard_step` here;
- `installer.HookInstaller`: the module hooks of the rules active this step;
- `executor.Executor`: the hook bodies, the compiled actions, error containment, and the
  buffer of device-side statistics;
- `readback.Readback`: at a step boundary, one transfer of the buffer, statistics,
  metrics, sinks, and a `StepReport` (skip, halt, sink errors, time) acted on here.

Hooks are global state on the user's model: every handle is kept and `remove()` (also
on exceptions, through the context manager) takes all of them off again.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Callable, Optional, Sequence

import torch
from prometheus_client import CollectorRegistry

from .. import environment
from ..errors import Halt, HookPolicyError
from ..export.metrics import MetricsStore, store_for
from ..export.sinks import output_root
from ..plan.planner import Plan, build_plan
from ..policy.model import Alert, Policy
from .executor import Executor
from .installer import HookInstaller
from .distributed import agree, agreeing, decode, encode
from .readback import Readback, StepReport
from .rulestate import MAX_ERRORS, rule_states
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
        start_step: int = 0, on_halt: Optional[Callable[[Halt], object]] = None,
    ) -> None:
        self.model = model
        self._on_halt = on_halt
        self.policies = tuple(policies)
        self.plan: Plan = build_plan(self.policies, model)
        self.rank = environment.rank(os.environ) if rank is None else rank
        self.step = start_step
        self.store: MetricsStore = store_for(registry, self.rank)
        self._rules = rule_states(self.plan, audit)
        phase = Phase()
        self._executor = Executor(self._rules, phase, self.store, lambda: self.step, self._halting)
        self._installer = HookInstaller(self.plan, self._rules, self._executor)
        self._report = Readback(self.store, self.policies, output_root(), self.rank)
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
        self._installer.activate(self.step)

    def _publish_initial_series(self, audit: bool) -> None:
        """Create every counter at 0, so `increase()` sees the first event and dashboards list the run."""
        for policy in self.policies:
            self.store.set("hookpolicy_policy_info", (policy.name, policy.revision, "audit" if audit else policy.mode), 1.0)
            self.store.inc("hookpolicy_series_dropped", (policy.name,), 0)
        for rs in self._rules.values():
            self.store.inc("hookpolicy_hook_errors", rs.key, 0)
            for action in rs.rule.actions:
                if isinstance(action, Alert):
                    self.store.inc("hookpolicy_alerts", (*rs.key, action.severity), 0)
                    self.store.set("hookpolicy_alert_firing", (*rs.key, action.severity), 0.0)
                    if action.then == "skip_step":
                        self.store.inc("hookpolicy_skipped_steps", rs.key, 0)
        self.store.raise_to("hookpolicy_steps", (), self.step)
        self.store.config_loaded()

    # -- public handle -----------------------------------------------------------------
    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Take every hook off the model, flush what was captured; safe to call twice."""
        if self._removed:
            return
        self._removed = True
        _release_model(self.model, self.policies)
        self._tracker.remove()
        self._installer.remove()
        try:
            self._readback(final=True)
        except Halt:
            pass
        finally:
            self._report.close()
            for policy in self.policies:
                self.store.forget_policy(policy.name)
                for family in ("hookpolicy_policy_info", "hookpolicy_alert_firing"):
                    self.store.drop(family, _not_of(policy.name))

    @property
    def removed(self) -> bool:
        return self._removed

    # -- step events (called by StepTracker) -------------------------------------------
    def begin_step(self) -> bool:
        """Run the step rules, read everything back, decide alerts; True to skip the step."""
        self._executor.run_step_rules(self._installer.step_rules())
        return self._readback(decide=True)

    def end_step(self) -> None:
        self.step += 1
        self.store.raise_to("hookpolicy_steps", (), self.step)
        self.store.set("hookpolicy_last_step_timestamp_seconds", (), time.time())
        self._installer.activate(self.step)

    def discard_step(self) -> None:
        self._executor.buffer.clear()

    def eval_forward_done(self) -> None:
        if self._executor.buffer:
            self._readback()  # an evaluation loop steps no optimizer: read back per batch

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
            self.store.inc("hookpolicy_skipped_steps", report.skip_rule)
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
        for labels, count in run.counts.items():
            self.store.inc("hookpolicy_actions", labels, count)
        for key, seconds in run.seconds.items():
            self.store.inc("hookpolicy_hook_seconds", key, seconds)
        run.counts.clear()
        run.seconds.clear()


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


def _not_of(policy: str) -> Callable[[tuple[str, ...]], bool]:
    return lambda labels: labels[0] != policy
