"""Re-binding: the rules bound anew when the model's tree changes, at a step boundary only.

PyTorch's module and parameter registration hooks (`module_hooks.watch`) tell `Rebinding`
that `parent.name = value` is about to land inside the model (`model.head = ...`, LoRA
injection); the step cycle calls `rebind(step)` where no step is half-governed (before a
step's first training forward, before its step rules, after its update), which plans
again and binds the rules to the model as it is now. The new hooks go in at the
installer's next `activate`; series of modules no longer bound are removed.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Optional, Protocol, Sequence

import torch

from ...export.metrics import ALERT_FIRING, ALERTS, HOOK_ERRORS, REWINDS, SKIPPED_STEPS
from ...export.store import ModelMetrics
from ...plan.planner import Plan, build_plan
from ...policy.model import Alert, Policy
from ...process import Once
from ..hooks import module_hooks
from .executor import HookInstaller
from ..measure.rulestate import RuleState, rebind

__all__ = ["Rebinding", "publish_rule_series"]

log = logging.getLogger("hookpolicy")


class _Derived(Protocol):
    """A part that derives what it needs from the rules (again, after a rule joined on a rebind)."""

    def rules_changed(self) -> None: ...


class _Refreshed(Protocol):
    """A part that learns the model's parameters anew (whose optimizer is whose)."""

    def refresh(self) -> None: ...


class Rebinding:
    """The plan of one attached model, bound anew after its tree changed; see the module docstring."""

    def __init__(
        self, model: torch.nn.Module, policies: Sequence[Policy], plan: Plan, rules: dict[tuple[str, str], RuleState],
        store: ModelMetrics, audit: bool, derived: Sequence[_Derived], installer: HookInstaller,
        refreshed: _Refreshed,
    ) -> None:
        self.model = model
        self.policies = policies
        self.plan = plan
        self._rules = rules
        self._store = store
        self._audit = audit
        self._derived = derived
        self._installer = installer
        self._refreshed = refreshed
        #: the model's tree changed since the plan was built
        self.stale = False
        self._watching: Optional[module_hooks.Watching] = None
        #: where a fault of `tree_changed` goes (the cycle's rules, `hooks.contain.Owner`); set by the cycle
        self.fault: Optional[Callable[[str, Exception], None]] = None

    def start(self) -> None:
        """Watch the model's tree (a `module_hooks.watch` subscriber)."""
        self._watching = module_hooks.watch(self.model, _WeakTree(self))
        _warn_self_reducing(self.model, self.plan)

    @property
    def watching(self) -> Optional[module_hooks.Watching]:
        """The tree watch (process-wide, holding this object weakly); None before `start()`."""
        return self._watching

    def remove(self) -> None:
        if self._watching is not None:
            self._watching.remove()

    def tree_changed(self, parent: torch.nn.Module, name: str, value: object) -> None:
        """`parent.name = value` is about to land inside the model: re-plan at the next step boundary."""
        if parent._modules.get(name, parent._parameters.get(name)) is not value:
            self.stale = True

    def rebind(self, step: int) -> bool:
        """Bind the rules anew to the model as it is now, if its tree changed since the plan; True when it did."""
        if not self.stale:
            return False
        self.stale = False
        try:
            plan = build_plan(self.policies, self.model)
        except Exception as exc:  # noqa: BLE001 - a guardrail that cannot re-plan must not stop training
            log.warning("the model changed at step %d and cannot be planned again (%s: %s); "
                        "the policies stay bound to the modules they had", step, type(exc).__name__, exc)
            return False
        gone = {b.module for b in self.plan.bindings} - {b.module for b in plan.bindings}
        self.plan = plan
        for rs in rebind(self._rules, plan, self._audit):
            publish_rule_series(self._store, rs)
        for part in self._derived:
            part.rules_changed()
        self._installer.rebind(plan)
        self._refreshed.refresh()
        if self._watching is not None:
            self._watching.update(list(self.model.modules()))
        _warn_self_reducing(self.model, plan)
        for warning in plan.warnings:
            log.warning("%s", warning)
        for policy in self.policies:
            self._store.forget_modules(policy.name, gone)
        log.info("the model changed at step %d: %d binding(s) now", step, len(plan.bindings))
        return True


def publish_rule_series(store: ModelMetrics, rs: RuleState) -> None:
    """Create a rule's counters at 0, so `increase()` sees its first event."""
    store.inc(HOOK_ERRORS, rs.key, 0)
    for action in rs.rule.actions:
        if isinstance(action, Alert):
            store.inc(ALERTS, (*rs.key, action.severity), 0)
            store.set(ALERT_FIRING, (*rs.key, action.severity), 0.0)
            if action.then == "skip_step":
                store.inc(SKIPPED_STEPS, rs.key, 0)
            elif action.then == "rewind":
                store.inc(REWINDS, rs.key, 0)


#: module classes `_warn_self_reducing` has looked at (each once a process)
_CHECKED_CLASSES = Once()


def _warn_self_reducing(model: torch.nn.Module, plan: Plan) -> None:
    """Say once per class when its copies would carry hookpolicy's hooks (it reduces itself)."""
    hooked = {type(model), *(type(b.obj) for b in plan.bindings if b.hook != "step")}
    for cls in hooked:
        if _CHECKED_CLASSES(cls) and module_hooks.reduces_itself(cls):
            log.warning("%s defines its own __reduce_ex__/__reduce__, so a copy, pickle or "
                        "torch.save of it would carry hookpolicy's hooks; remove() the policy before copying it",
                        cls.__qualname__)


class _WeakTree:
    """A `Rebinding` as the process-wide tree watch sees it: weakly, so the watch keeps no dropped model alive."""

    def __init__(self, rebinding: Rebinding) -> None:
        self._rebinding = weakref.ref(rebinding)

    def tree_changed(self, parent: torch.nn.Module, name: str, value: object) -> None:
        rebinding = self._rebinding()
        if rebinding is not None:
            rebinding.tree_changed(parent, name, value)

    def fault(self, where: str, exc: Exception) -> None:
        """A fault of `tree_changed` (`hooks.contain.Owner`): the cycle's rules'; said once as the process's without."""
        rebinding = self._rebinding()
        fault = None if rebinding is None else rebinding.fault
        if fault is None:
            raise exc
        fault(where, exc)
