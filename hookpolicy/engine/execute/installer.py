"""Installing module hooks per step: a module carries a hook only while one of its rules is active.

At each step boundary `activate(step)` recomputes the set of active rules (their `every`
and `steps` window, minus rules switched off by errors). If the set is unchanged nothing
happens; otherwise every module hook is removed and re-registered for exactly the active
rules, grouped per module: one forward pre-hook (`forward_pre` targets, and the identity
views of `grad_input`) and one forward hook (`forward` and `backward` targets). A rule
with `every: 100` therefore has no hook installed on 99 steps out of 100. The hooks go
through `module_hooks`, so copies and saves of the model never carry them; `rebind(plan)`
installs them anew for a model whose tree changed.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..hooks import module_hooks
from .executor import Executor
from ...plan.planner import Binding, Plan
from ..measure.rulestate import RuleState

__all__ = ["HookInstaller"]


class HookInstaller:
    """The module hooks of one attachment; their bodies are the executor's."""

    def __init__(self, plan: Plan, rules: dict[tuple[str, str], RuleState], executor: Executor) -> None:
        self._plan = plan
        self._rules = rules
        self._executor = executor
        self._active: Optional[frozenset[tuple[str, str]]] = None
        self._handles: list[module_hooks.OwnHandle] = []

    def rebind(self, plan: Plan) -> None:
        """Bind to `plan` (the model changed); the next `activate` installs its hooks whatever the set."""
        self._plan = plan
        self._active = None

    def activate(self, step: int) -> None:
        """Install hooks for the rules active at `step`; nothing changes if the set is the same."""
        active = frozenset(
            key for key, rs in self._rules.items()
            if not rs.off and rs.rule.trigger.active_at(step)
        )
        if active == self._active:
            return
        self._active = active
        self.remove()
        by_module: dict[int, tuple[torch.nn.Module, list[Binding], list[Binding]]] = {}
        for b in self._plan.bindings:
            if b.key not in active or b.hook == "step":
                continue
            module, pre, post = by_module.setdefault(id(b.obj), (b.obj, [], []))
            if b.hook == "forward_pre" or b.target == "grad_input":
                pre.append(b)
            if b.hook in ("forward", "backward"):
                post.append(b)
        run = self._executor
        for module, pre, post in by_module.values():
            if pre:
                self._handles.append(module_hooks.forward_pre_hook(
                    module, lambda m, a, k, pre=pre: run.pre_hook(pre, a, k), with_kwargs=True))
            if post:
                self._handles.append(module_hooks.forward_hook(
                    module, lambda m, a, k, o, post=post: run.post_hook(post, m, a, k, o), with_kwargs=True))

    def step_rules(self) -> list[RuleState]:
        """The `step` rules active now and not switched off, in plan order."""
        active = self._active or frozenset()
        return [rs for key, rs in self._rules.items()
                if rs.rule.trigger.at == "step" and key in active and not rs.off]

    @property
    def handles(self) -> list[module_hooks.OwnHandle]:
        """The module hooks installed now (the list itself, kept up to date; they hold no module)."""
        return self._handles

    def remove(self) -> None:
        """Take every module hook off (the active set is kept)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
