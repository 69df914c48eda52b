"""Hook bodies: a phase check, then the rule's compiled program (`programs`), with errors contained.

`Executor` is what the installed module hooks call (`pre_hook`, `post_hook`, and through
them tensor hooks on gradients and on identity views of inputs, for `grad_output` and
`grad_input`). It picks the tensors a binding targets and hands them to
`Programs.execute`, which records into the step's ledger and may return replacement
tensors. A hook body runs under `Faults.guarded`: its exception is a fault of its rule,
its time goes to the ledger.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ...plan.planner import Binding
from ...process import Once
from ...policy.model import Rule
from .faults import Faults
from .programs import Programs
from ..measure.rulestate import RuleState
from .steps import Phase, recomputing
from .structure import named_tensors, replace_tensors, selector

__all__ = ["Executor"]

log = logging.getLogger("hookpolicy")

Named = list[tuple[str, torch.Tensor]]


class Executor:
    """Runs the rules of one attachment inside module hooks; see the module docstring."""

    def __init__(
        self, rules: dict[tuple[str, str], RuleState], phase: Phase, faults: Faults, programs: Programs,
    ) -> None:
        self.rules = rules
        self.guarded = faults.guarded
        self._programs = programs
        self._phase = phase
        self.rules_changed()
        self._versions: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self._said_inplace = Once()  # (policy, rule[, module]): grad_input that cannot be observed

    def rules_changed(self) -> None:
        """Derive what the hook bodies need from `rules` (again, after a rule joined on a rebind)."""
        self._selectors = {key: selector(rs.rule.select) for key, rs in self.rules.items()}

    # -- module hooks ------------------------------------------------------------------
    def pre_hook(self, bindings: list[Binding], args: Any, kwargs: Any) -> Any:
        """hook(module, args, kwargs) -> None or (new_args, new_kwargs), for `bindings`."""
        inside_recompute = recomputing()
        inputs: Any = (args, kwargs)
        changed = False
        for b in bindings:
            rs = self.rules[b.key]
            if rs.off or not self._phase_ok(rs.rule, b.obj):
                continue
            if b.target == "grad_input":
                inputs, hooked = self.guarded(rs, self._hook_grad_input, rs, b, inputs) or (inputs, False)
                changed |= hooked
            elif not inside_recompute:
                new = self.guarded(rs, self._run_named, rs, b, _input_tensors(inputs, self._selectors[b.key]))
                if new:
                    inputs, changed = _replace_inputs(inputs, new), True
        return inputs if changed else None

    def post_hook(self, bindings: list[Binding], module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        """hook(module, args, kwargs, output) -> None or a new output, for `bindings`."""
        inside_recompute = recomputing()
        changed = False
        for b in bindings:
            rs = self.rules[b.key]
            if rs.off or not self._phase_ok(rs.rule, module):
                continue
            keep = self._selectors[b.key]
            if b.target == "grad_output":
                for name, t in named_tensors(output, keep):
                    if t.requires_grad:
                        t.register_hook(lambda g, rs=rs, b=b, name=name: self._grad_hook(rs, b, name, g))  # type: ignore[no-untyped-call]
            elif b.target == "grad_input":
                self._check_grad_input(rs, b, (args, kwargs))
            elif not inside_recompute:
                named = named_tensors(output, keep) if b.target == "output" else _input_tensors((args, kwargs), keep)
                new = self.guarded(rs, self._run_named, rs, b, named)
                if new and b.target == "output":
                    output, changed = replace_tensors(output, new), True
        return output if changed else None

    def _phase_ok(self, rule: Rule, module: Optional[torch.nn.Module] = None) -> bool:
        phase = rule.trigger.phase
        return phase == "any" or self._phase.training(module) == (phase == "train")

    def _grad_hook(self, rs: RuleState, b: Binding, name: str, grad: torch.Tensor) -> Optional[torch.Tensor]:
        if rs.off or grad is None or grad.numel() == 0:
            return None
        new = self.guarded(rs, self._run_named, rs, b, [(name, grad)])
        return new[name] if new else None

    def _hook_grad_input(self, rs: RuleState, b: Binding, inputs: Any) -> tuple[Any, bool]:
        """Route each input through an identity view whose gradient is this module's own."""
        views: dict[str, torch.Tensor] = {}
        for name, t in _input_tensors(inputs, self._selectors[b.key]):
            if t.requires_grad:
                view = t.view_as(t)
                view.register_hook(lambda g, rs=rs, b=b, name=name: self._grad_hook(rs, b, name, g))  # type: ignore[no-untyped-call]
                views[name] = view
        if not views:
            if self._said_inplace(b.key + (b.module,)):
                log.warning("%s/%s: no input of %s requires grad, so its grad_input never fires",
                            *b.key, b.module or "<root>")
            return inputs, False
        self._versions[id(b)] = [(v, v._version) for v in views.values()]
        return _replace_inputs(inputs, views), True

    def _check_grad_input(self, rs: RuleState, b: Binding, inputs: Any) -> None:
        for view, version in self._versions.pop(id(b), []):
            if view._version != version and self._said_inplace(b.key):
                log.warning(
                    "%s/%s: %s modifies its input in place, so its grad_input cannot be observed; "
                    "use grad_output of the module before it", *b.key, b.module or "<root>",
                )

    # -- programs ----------------------------------------------------------------------

    def _run_named(self, rs: RuleState, b: Binding, named: Named) -> Optional[dict[str, torch.Tensor]]:
        if not named:
            return None
        rows = [(b.module, name) for name, _ in named]
        new = self._programs.execute(rs, b.target, rows, [t for _, t in named], inplace=False)
        return None if new is None else {name: t for (name, _), t in zip(named, new)}


def _input_tensors(inputs: tuple[Any, Any], keep: Any) -> Named:
    args, kwargs = inputs
    return named_tensors(args, keep) + named_tensors(kwargs, keep)


def _replace_inputs(inputs: tuple[Any, Any], new: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    args, kwargs = inputs
    return replace_tensors(args, new), replace_tensors(kwargs, new)
