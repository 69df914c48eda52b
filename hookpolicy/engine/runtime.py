"""The public handle of one attached policy set: `Attached`.

`PolicySet.attach(model)` returns it. It compiles the plan, claims the model (a policy is
never attached twice to one model), publishes the series every dashboard lists from the
start, and hands the model's steps to the step cycle (`cycle.StepCycle`), which installs
and runs every hook. `remove()` (also on exceptions, through the context manager) takes
all of them off again: hooks are global state on the user's model.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from prometheus_client import CollectorRegistry

from .. import environment
from ..errors import Halt, HookPolicyError, PolicyError
from ..export.metrics import ALERT_FIRING, MODEL_FAMILIES, POLICY_INFO, SERIES_DROPPED, STEPS, Labels
from ..export.store import ModelMetrics
from ..export.collector import store_for
from ..export.sinks import output_root
from ..export.summary import summary_lines
from ..plan.matcher import model_class
from ..plan.planner import Plan, build_plan
from ..process import collector_paused
from ..policy.model import Policy, Rule, RuleKey
from .decide.agreement import Vote
from .cycle import Leftovers, StepCycle
from .hooks.contain import each_contained
from .decide.recorder import Recorder, bounds as ring_bounds
from .heal.healing import Carried
from .measure.history import History
from .execute.executor import publish_rule_series
from .measure.rulestate import MAX_ERRORS

__all__ = ["Attached", "MAX_ERRORS"]

log = logging.getLogger("hookpolicy")


class Attached:
    """Policies attached to one model; a context manager whose `remove()` is idempotent.

    Create it with `PolicySet.attach(model)`. `plan` is what was compiled; `step` is the
    number of optimizer steps evaluated so far (the step the next update belongs to),
    starting from `start_step` (a reloaded policy continues where the old one stopped).
    `on_halt(halt)` is called just before a `Halt` is raised, so a launcher learns of it
    even when the script catches it. `generation` names the policy generation (see
    `agreement`): ranks agree on skips and halts only between rules of the same one.
    """

    @collector_paused()  # the plan and thousands of hooks on a large model: no garbage among them
    def __init__(
        self, policies: Sequence[Policy], model: torch.nn.Module, *,
        registry: Optional[CollectorRegistry] = None, rank: Optional[int] = None, audit: bool = False,
        start_step: int = 0, on_halt: Optional[Callable[[Halt], object]] = None, strict: bool = False,
        generation: int = 0,
    ) -> None:
        self.model = model
        self._on_halt = on_halt
        self.policies = tuple(policies)
        plan = build_plan(self.policies, model)
        if strict and plan.unmatched:  # before anything is installed: nothing half-attached
            raise PolicyError(plan.unmatched)
        self.rank = environment.rank(os.environ) if rank is None else rank
        self.store: ModelMetrics = store_for(registry, self.rank).for_model(model, model_class(model))
        self._cycle = StepCycle(model, self.policies, plan, self.store, self.rank, audit, start_step, self._halting,
                                generation)
        self._removed = False
        self._dropped: "Optional[weakref.finalize[..., torch.nn.Module]]" = None
        for warning in plan.warnings + tuple(ring_bounds(self.policies, plan.bindings)[1]):
            log.warning("%s", warning)
        _claim_model(model, self.policies)  # a second attach of a policy is refused here, with nothing installed
        try:
            self._publish_initial_series(audit)
            self._cycle.start()
        except BaseException:  # hookpolicy's own fault: what went in comes out again, never a half-installed policy
            self.remove()
            raise

    def _publish_initial_series(self, audit: bool) -> None:
        """Create every counter at 0, so `increase()` sees the first event and dashboards list the run."""
        for policy in self.policies:
            self.store.set(POLICY_INFO, (policy.name, policy.revision, "audit" if audit else policy.mode), 1.0)
            self.store.inc(SERIES_DROPPED, (policy.name,), 0)
        for rs in self._cycle.rules.values():
            publish_rule_series(self.store, rs)
        self.store.raise_to(STEPS, (), self.step)
        self.store.config_loaded()

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
        dropped = self._dropped
        each_contained([
            *([("the watch on the model's end", dropped.detach)] if dropped is not None else []),
            ("the model's claim", lambda: _release_model(self.model, self.policies)),
            ("the step cycle", self._cycle.remove),
            *((f"policy {policy.name}'s series", lambda policy=policy: self._forget(policy.name))
              for policy in self.policies),
        ])

    def _forget(self, policy: str) -> None:
        self.store.forget_policy(policy)
        for family in (POLICY_INFO, ALERT_FIRING):
            self.store.drop(family, _not_of(policy))

    def when_dropped(self, report: Callable[[Callable[[], None]], object]) -> None:
        """Once the model is garbage, hand `report` the call that removes this attachment's remains.

        For a launcher that governs models it does not own (`hookpolicy apply`): the script
        holds the model, and through the model's own hooks this attachment; the process-wide
        parts (optimizer step subscription, tree watch, loss tap, sinks, exported series)
        hold neither. `report` runs inside the garbage collector, maybe on another thread,
        so it should only queue the call for the training thread (locks are held there).
        The call refers to no part of the model. `remove()` before then cancels it.
        """
        remains = _Remains(self._cycle.leftovers(), self.store, self.policies)
        self._dropped = weakref.finalize(self.model, report, remains.remove)
        self._dropped.atexit = False

    @property
    def removed(self) -> bool:
        return self._removed

    def entered(self, args: Any) -> None:
        """The model's own call is under way: attached from a hook that ran before the model's own pre-hooks.

        PyTorch takes the list of forward pre-hooks before it runs the first, so the root's
        pre-hook, installed from a global one (`apply`'s discovery), misses the call it was
        installed in while the forward hook after it runs. This runs the pre-hook for it,
        so that call's end is an evaluation's or a training forward's, as for any later call.
        """
        if not self._removed:
            self._cycle.entered(args)

    @property
    def step(self) -> int:
        """The number of optimizer steps evaluated so far: the step the next update belongs to."""
        return self._cycle.step

    @property
    def generation(self) -> int:
        """The policy generation these rules belong to: 0, or what a hot reload attached them as.

        Ranks agree on a step's skip or halt only while they hold the same rules of the same
        generation (see `agreement`); a reload protocol raises it with each swap.
        """
        return self._cycle.agreement.generation

    @property
    def plan(self) -> Plan:
        """What was compiled, bound to the model as it is now (re-planned when its tree changed)."""
        return self._cycle.plan

    @property
    def recorder(self) -> Recorder:
        """The flight recorder's rings (`capture.keep`) and the dumps written so far."""
        return self._cycle.readback.recorder

    @property
    def history(self) -> History:
        """The past values of the series that history functions read (alerts, adaptive clips)."""
        return self._cycle.history

    def _halting(self, halt: Halt) -> Halt:
        """Tell `on_halt` before the Halt propagates: the script may catch or hide it."""
        if self._on_halt is not None:
            self._on_halt(halt)
        return halt

    def vote_on_reloads(self, vote: Vote) -> None:
        """Let a reload protocol take part in every step's rank agreement (`agreement.Vote`); before the first step.

        From then on this model agrees at every step in a process group, so that a new
        policy version goes in at the same step on every rank.
        """
        self._cycle.agreement.vote = vote

    def healing_state(self) -> Carried:
        """What a hot reload carries of the healing (`carry_history`): taken before `remove()`, which frees it."""
        return self._cycle.healing.carried()

    def hold_recorder(self, policies: Sequence[Policy]) -> None:
        """Before `remove()` at a hot reload to `policies`: the flight recorder's rings and waiting dumps of the
        rules `policies` hold unchanged, and the dump counts of the policies they keep by name, stay for the next
        attachment's `carry_history` (`Recorder.hold`), instead of being written (and said) at detach."""
        names = {p.name for p in policies}
        self.recorder.hold(_unchanged(_rules(self.policies), _rules(policies)),
                           [p.name for p in self.policies if p.name in names])

    def carry_history(self, previous: "Attached", healing: Optional[Carried] = None) -> None:
        """Take over the history of `previous` (a hot reload) for every rule it ran unchanged, and its `healing`.

        A rule is unchanged when it equals its namesake in `previous` but for its place in
        the file; a changed rule starts with an empty history (its windows, warmup and
        emas begin again). `healing` (`previous.healing_state()`, taken before its
        `remove()`): the cool-downs in force and the rewind counts of the unchanged rules, and
        the snapshots; a changed or removed rule's cool-down ends, said. The flight recorder's
        rings and waiting dumps that `previous.hold_recorder` kept go on here for the unchanged
        rules, and its dump counts. Called between the two attachments, before this one's first step.
        """
        mine, theirs = self._cycle.rules, previous._cycle.rules
        same = _unchanged({k: rs.rule for k, rs in theirs.items()}, {k: rs.rule for k, rs in mine.items()})
        self.history.adopt(previous.history.carry(same))
        if healing is not None:
            self._cycle.healing.adopt(healing, set(same), self._cycle.step)
        self.recorder.adopt(previous.recorder.held(), mine, same)

    def summary(self) -> list[str]:
        """What the policies did to this model so far, in a few lines (also after `remove()`).

        Steps, then per rule what it did (skipped steps, clips, alerts by severity, errors,
        switched off), then where its files went: sums of the counters this attachment
        exported (`export.summary`), of the model on every rank-local registry it shares.
        Printing nothing by itself, so that a notebook or a test that attaches often stays
        quiet: `print("\\n".join(handle.summary()))`. `hookpolicy apply` says it at the end of a run.
        """
        return summary_lines(self.store.store, self.policies, metrics="in the registry given to attach",
                             root=output_root(), models=[self.store.model])

    def last_values(self) -> Mapping[str, Mapping[Labels, float]]:
        """The latest value of every statistic this attachment computed, read-only.

        `{family: {(policy, rule, module, tensor): value}}`, e.g.
        `last_values()["hookpolicy_grad_l2_norm"][("guard", "clip", "head", "weight")]`:
        what the last read-back published (Prometheus' families and labels, without
        `rank`). Kept after `remove()`, when the exported gauges are gone; series beyond
        `spec.limits.maxSeries`, which are not exported, are included.
        """
        return self._cycle.readback.last_values()


#: model -> names of the policies attached to it, so a policy is never applied twice to one model.
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, set[str]]" = weakref.WeakKeyDictionary()


def _unchanged(old: Mapping[RuleKey, Rule], new: Mapping[RuleKey, Rule]) -> list[RuleKey]:
    """The rules of `new` that a hot reload leaves alone: equal to their namesake in `old` but for their place in
    the file (what carries their history, healing and flight recorder over)."""
    return [key for key, rule in new.items() if key in old and replace(old[key], index=rule.index) == rule]


def _rules(policies: Sequence[Policy]) -> dict[RuleKey, Rule]:
    return {(p.name, r.name): r for p in policies for r in p.rules}


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


class _Remains:
    """What is left of an attachment whose model was dropped: `remove()` takes it out of the process."""

    def __init__(self, leftovers: Leftovers, store: ModelMetrics, policies: Sequence[Policy]) -> None:
        self._leftovers, self._store, self._policies = leftovers, store, tuple(policies)
        self._removed = False

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        each_contained([  # every series labelled with the model leaves; the process-wide ones (policy info) stay
            ("the dropped model's parts", self._leftovers.remove),
            *((f"policy {policy.name}'s series", lambda name=policy.name: self._store.forget_policy(name))
              for policy in self._policies),
            ("the dropped model's series", self._drop_series),
        ])

    def _drop_series(self) -> None:
        for family in MODEL_FAMILIES:
            self._store.drop(family, _none)


def _none(labels: tuple[str, ...]) -> bool:
    return False


def _not_of(policy: str) -> Callable[[tuple[str, ...]], bool]:
    return lambda labels: labels[0] != policy
