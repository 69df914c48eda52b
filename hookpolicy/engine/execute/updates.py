"""The step targets known only after the update: `update` (w_after - w_before) and `optimizer_state`.

Both describe what an optimizer step did, so both are measured in the optimizer's step
post-hook, after the update, and their device-side partials go to the ledger stamped with
the step they belong to (`Entry.step`): the next read-back (the next step's, or the last
one at `remove()`) reads them with the other statistics, in the same one transfer. So
nothing they show can change that step any more: check refuses `then: skip_step`, clip and
scale on them, and a `halt` stops training before the next update.

`update` needs the parameter from before the update. `before` copies the parameters the
active `update` rules measure, on their device, only on a step where such a rule is active
and the step is not skipped, and only those the stepping optimizer updates (in its
parameter groups, with a gradient): no copy on any other step. The copy also gives
`update_ratio` its denominator, the sum of squares of the parameter before the update
(`stats.sums_of_squares`, on the device). `after` turns the copies into the updates in
place (`before - after`, negated) and hands them to the rules' programs. Under FSDP2 the
parameters are DTensors: the copies and updates are too, and `programs` reduces the
partials of their local shards over the mesh at the read-back, like those of gradients.

`optimizer_state` reads `optimizer.state[p]` after the update: the keys its `match.state`
globs name, or by default every floating-point state tensor shaped like its parameter
(Adam's moments, SGD's momentum buffer; not Adam's `step` counter). Its tensors are named
`<param>.<key>` (`weight.exp_avg_sq`); `per: module` and `per: rule` group a module's (or
the rule's) tensors of one key, never two keys together (`group_key`).

A step that did not update has neither: one a policy skipped (its gradients hidden), one
GradScaler skipped (no `optimizer.step()` ran), one whose closure was never called.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from ...plan.planner import param as find_param
from ...plan.planner import STATE_KEYS
from ...policy.model import AFTER_UPDATE, OPTIMIZER_STATE, UPDATE, rule_name
from ...process import Once
from ...policy.patterns import NamePattern, compile_glob
from ..measure.distributed import local_shards
from .programs import Programs
from ..measure.rulestate import RuleState
from ..measure.stats import sums_of_squares

__all__ = ["Updates", "state_group_key"]

log = logging.getLogger("hookpolicy")


def state_group_key(module: str, tensor: str, per: str) -> tuple[str, str]:
    """`history.group_key` for `optimizer_state`: the state key stays in the tensor part of every group."""
    key = tensor.rpartition(".")[2]
    return (module, tensor) if per == "tensor" else ((module, key) if per == "module" else ("", key))


class _Copies(NamedTuple):
    """An `update` rule's parameters from before the update: rows, parameters, copies, their sums of squares."""

    rows: list[tuple[str, str]]
    params: list[torch.Tensor]
    copies: list[torch.Tensor]
    references: torch.Tensor


@dataclass
class _Pending:
    """What one optimizer's update is to be measured by: its rules, and each `update` rule's copies."""

    rules: list[RuleState]
    #: the ids of the parameters the optimizer updates (`_stepped`, before the update)
    stepped: set[int]
    copies: dict[tuple[str, str], _Copies] = field(default_factory=dict)


class Updates:
    """The `update` and `optimizer_state` rules of one attachment, around each optimizer's update."""

    def __init__(self, programs: Programs) -> None:
        self._programs = programs
        self._pending: dict[int, _Pending] = {}  # id(optimizer) -> what its update is measured by
        self._globs: dict[tuple[str, ...], list[NamePattern]] = {}
        self._named: dict[tuple[tuple[str, ...], str], bool] = {}  # (match.state, key): whether a glob names it
        self._said = Once()

    def no_optimizer(self, rules: Sequence[RuleState], model: str) -> None:
        """A step of a model no optimizer steps: its `update` and `optimizer_state` rules have nothing to measure (said once)."""
        mine = [rs for rs in rules if rs.rule.target in AFTER_UPDATE]
        if mine and self._said(model):
            log.warning("%s: no torch.optim optimizer steps it (its parameters are updated by hand), so %s measure "
                        "nothing: update and optimizer_state are what an optimizer step did (said once)", model,
                        ", ".join(rule_name(rs.key) for rs in mine))

    def before(self, optimizer: torch.optim.Optimizer, rules: Sequence[RuleState]) -> None:
        """`optimizer` is about to apply a step that is not skipped: copy what the active `update` rules need.

        `rules` are the step rules active now; nothing is done (or copied) without an
        `update` or `optimizer_state` rule among them.
        """
        mine = [rs for rs in rules if rs.rule.target in AFTER_UPDATE]
        self._pending.pop(id(optimizer), None)
        if not mine:
            return
        pending = self._pending[id(optimizer)] = _Pending(mine, _stepped(optimizer))
        for rs in mine:
            if rs.rule.target == UPDATE:
                self._programs.guarded(rs, self._copy, rs, pending.stepped, pending)

    def _copy(self, rs: RuleState, stepped: set[int], pending: _Pending) -> None:
        rows, params = _parameters(rs, stepped)
        if not params:
            return
        with torch.no_grad():
            copies = _snapshot(params)
            sharded = local_shards(copies)
            references = sums_of_squares(copies if sharded is None else sharded[0])
        pending.copies[rs.key] = _Copies(rows, params, copies, references)

    def after(self, optimizer: torch.optim.Optimizer, step: int, skipped: bool) -> None:
        """`optimizer` applied `step` (or, `skipped`, did not): measure the update and the state it left."""
        pending = self._pending.pop(id(optimizer), None)
        if pending is None or skipped:
            return
        for rs in pending.rules:
            if rs.off:
                continue
            if rs.rule.target == UPDATE:
                copied = pending.copies.get(rs.key)
                if copied is not None:
                    self._programs.guarded(rs, self._update, rs, copied, step)
            else:
                self._programs.guarded(rs, self._state, rs, optimizer, pending.stepped, step)

    def _update(self, rs: RuleState, copied: _Copies, step: int) -> None:
        deltas = copied.copies
        with torch.no_grad():
            torch._foreach_sub_(deltas, [p.detach() for p in copied.params])  # w_before - w_after, in the copies
            torch._foreach_neg_(deltas)
        self._programs.execute(rs, UPDATE, copied.rows, deltas, False, references=copied.references, step=step)

    def _state(self, rs: RuleState, optimizer: torch.optim.Optimizer, stepped: set[int], step: int) -> None:
        rows: list[tuple[str, str]] = []
        tensors: list[torch.Tensor] = []
        names, params = _parameters(rs, stepped)
        held: set[str] = set()  # the state keys the optimizer holds for these parameters
        for (module, name), p in zip(names, params):
            for key, value in optimizer.state.get(p, {}).items():
                held.add(str(key))
                if not isinstance(key, str) or not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    continue
                wanted = self._names(rs.rule.match.state, key) if rs.rule.match.state else value.shape == p.shape
                if wanted and value.numel() > 0:
                    rows.append((module, f"{name}.{key}"))
                    tensors.append(value.detach())
        if tensors:
            self._programs.execute(rs, OPTIMIZER_STATE, rows, tensors, False, step=step)
        elif params and self._said((rs.key, type(optimizer).__name__)):
            self._say_stateless(rs, optimizer, sorted(held))

    def _say_stateless(self, rs: RuleState, optimizer: torch.optim.Optimizer, held: list[str]) -> None:
        """An `optimizer_state` rule whose optimizer keeps nothing it can measure: said at the first step, once."""
        kind = type(optimizer).__name__
        wanted = (f"named {', '.join(rs.rule.match.state)}" if rs.rule.match.state
                  else "shaped like its parameter")
        has = f"it holds {', '.join(held)}" if held else "it holds none for them"
        log.warning("%s: %s keeps no state tensor %s for the parameters this rule binds (%s), so the rule measures "
                    "nothing and its alerts never evaluate; %s (said once)", rule_name(rs.key), kind, wanted, has,
                    STATE_KEYS.get(kind, "see `hookpolicy explain` for what torch's optimizers keep"))

    def _names(self, globs: tuple[str, ...], key: str) -> bool:
        """Whether one of `globs` (a rule's `match.state`) names the state key `key` (matched once per key)."""
        named = self._named.get((globs, key))
        if named is None:
            patterns = self._globs.get(globs)
            if patterns is None:
                patterns = self._globs[globs] = [compile_glob(g) for g in globs]
            named = self._named[(globs, key)] = any(g.fullmatch(key) for g in patterns)
        return named


def _snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each parameter, on its device: the only copies `update` makes, on active steps only."""
    return [p.detach().clone() for p in params]


def _stepped(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the parameters `optimizer` updates now: in its groups, with a gradient."""
    return {id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None}


def _parameters(rs: RuleState, stepped: set[int]) -> tuple[list[tuple[str, str]], list[torch.Tensor]]:
    """The (module, parameter) rows and parameters of `rs` among `stepped`, in binding order."""
    rows: list[tuple[str, str]] = []
    params: list[torch.Tensor] = []
    for b in rs.bindings:
        for name, path in zip(b.params, b.paths()):
            p = find_param(b.obj, path)
            if id(p) in stepped and p.numel() > 0:
                rows.append((b.module, name))
                params.append(p)
    return rows, params
