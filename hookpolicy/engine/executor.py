"""Hook bodies: a phase check, then the rule's compiled program, with errors contained.

`Executor` is what the installed hooks call (`pre_hook`, `post_hook`, and through them
tensor hooks on gradients) and what step tracking calls for `step` rules
(`run_step_rules`). Everything it records goes to the step's `Ledger`, which the step
cycle owns: a statistics pass appends an `Entry` (device-side partials), a clip a
`ClipEntry`, every action the module it ran on; a clip or scale returns replacement
tensors (or changes parameter gradients in place at `step`). A hook body runs under
`Faults.guarded`: its exception is a fault of its rule, its time goes to the ledger.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence, cast

import torch

from .actions import MutateOp, StatsOp, clip_norm, clip_unitwise, mutate
from ..plan.planner import Binding, param as find_param
from ..process import Once
from ..policy.expr import Value
from ..policy.model import LOSS, Clip, Rule
from .distributed import Shards, local_shards, sum_over_groups, shard_name, shard_partials, unit_shards
from .faults import Faults
from .history import History, group_key
from .ledger import ClipEntry, Entry, Ledger
from .rulestate import RuleState
from .stats import tensor_partials
from .steps import Phase, recomputing
from .structure import named_tensors, replace_tensors, selector

__all__ = ["Executor"]

log = logging.getLogger("hookpolicy")

Named = list[tuple[str, torch.Tensor]]


class Executor:
    """Runs the rules of one attachment inside hooks, recording into `ledger`; see the module docstring."""

    def __init__(
        self, rules: dict[tuple[str, str], RuleState], phase: Phase, ledger: Ledger, faults: Faults,
        history: History,
    ) -> None:
        self.rules = rules
        self.history = history
        self._ledger = ledger
        self._faults = faults
        self.guarded = faults.guarded
        self._phase = phase
        self.rules_changed()
        self._versions: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self._said_inplace = Once()  # (policy, rule[, module]): grad_input that cannot be observed
        self._said_limits = Once()  # (rule key, action index): adaptive thresholds that are not positive

    def rules_changed(self) -> None:
        """Derive what the hook bodies need from `rules` (again, after a rule joined on a rebind)."""
        self._selectors = {key: selector(rs.rule.select) for key, rs in self.rules.items()}
        # A step rule's count of finite elements waits for the readback (no pass over the
        # gradients in a normal step, see stats.resolve_counts) unless some step rule clips or
        # scales the gradients in between, which could change what the count would see.
        self._defer_step_counts = not any(
            not isinstance(op, StatsOp) for rs in self.rules.values() if rs.rule.trigger.at == "step" for op in rs.program
        )

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
        new = self._execute(rs, b.target, rows, [t for _, t in named], inplace=False)
        return None if new is None else {name: t for (name, _), t in zip(named, new)}

    def run_step_rules(
        self, rules: Sequence[RuleState], loss: Optional[torch.Tensor] = None, left_out: frozenset[int] = frozenset(),
    ) -> None:
        """Run `step` rules on their parameters' gradients or weights (in place), in order.

        `loss` is the step's micro-batch losses (`loss.LossTap.take`), the tensor of the
        `target: loss` rules; when None (none seen) those rules evaluate nothing.
        `left_out`: ids of parameters another optimizer updates, not this step (`scopes`).
        """
        for rs in rules:
            if rs.rule.target != LOSS:
                self.guarded(rs, self._run_step_rule, rs, left_out)
            elif loss is not None:
                self.guarded(rs, self._execute, rs, LOSS, [("", "")], [loss], False)

    def _run_step_rule(self, rs: RuleState, left_out: frozenset[int]) -> None:
        rows: list[tuple[str, str]] = []
        tensors: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []  # AGC's: the weight of each gradient in `tensors`
        unitwise = any(isinstance(op, MutateOp) and op.unitwise for op in rs.program)
        for b in rs.bindings:
            for pname, path in zip(b.params, b.paths()):
                param = find_param(b.obj, path)
                if left_out and id(param) in left_out:
                    continue
                t = param.grad if rs.rule.target == "grad" else param.detach()
                if t is not None and t.numel() > 0:
                    rows.append((b.module, pname))
                    tensors.append(t)
                    if unitwise:
                        weights.append(param)
        if tensors:
            self._execute(rs, rs.rule.target, rows, tensors, inplace=True, defer=self._defer_step_counts,
                          weights=weights)

    def _execute(
        self, rs: RuleState, target: str, rows: list[tuple[str, str]], tensors: list[torch.Tensor], inplace: bool,
        defer: bool = False, weights: Sequence[torch.Tensor] = (),
    ) -> Optional[list[torch.Tensor]]:
        """Run a rule's program on tensors; returns replacements when a mutation applied."""
        changed = False
        modules = {module for module, _ in rows}
        for op, count_keys in zip(rs.program, rs.count_keys):
            if isinstance(op, StatsOp):
                sharded = local_shards(tensors)
                copies = _copies(op, rows, tensors, sharded) if op.tensors else []
                deferred = defer and "finite" in op.kinds and sharded is None
                if sharded is not None:
                    matrix = shard_partials(sharded[0], op.kinds)
                elif deferred:
                    matrix = tensor_partials(tensors, op.kinds, defer_counts=True)
                else:
                    matrix = tensor_partials(tensors, op.kinds)
                self._ledger.entries.append(Entry(rs, op, target, rows, [t.numel() for t in tensors], matrix, copies,
                                         list(tensors) if deferred else None,
                                         None if sharded is None else sharded[1]))
                self._ledger.ran.update((key, module) for key in count_keys for module in modules)
            elif op.unitwise:
                self._ledger.ran.update((count_keys[0], module) for module in modules)
                counts = self._clip_units(rs, op, rows, tensors, list(weights))
                # what it clipped (audit: would have) goes to the read-back; AGC measures no group norm
                report = torch.stack([torch.full_like(counts, math.nan), counts], dim=1)
                self._ledger.entries.append(ClipEntry(rs, op.index, list(rows), report, [None] * len(rows)))
            else:
                self._ledger.ran.update((count_keys[0], module) for module in modules)
                action = op.action
                if isinstance(action, Clip) and action.max_norm is not None:
                    tensors, clipped = self._clip(rs, op.index, action, rows, tensors, inplace)
                    changed |= clipped
                elif rs.enforce:
                    tensors = mutate(action, list(tensors), _groups(rows, getattr(action, "per", "tensor")), inplace)
                    changed = True
        return tensors if changed else None

    def _clip_units(
        self, rs: RuleState, op: MutateOp, rows: list[tuple[str, str]], grads: list[torch.Tensor],
        weights: list[torch.Tensor],
    ) -> torch.Tensor:
        """AGC on a step rule's gradients (in place when enforced); per tensor, the units it clipped.

        On DTensors it works on the local shards, and the counts are those of the full
        tensors, the same on every rank (see `distributed.unit_shards`).
        """
        clip = cast(Clip, op.action)
        assert clip.unitwise_ratio is not None  # op.unitwise
        flat = next((rows[k] for k, w in enumerate(weights) if getattr(w, "_fsdp_flattened", False)), None)
        if flat is not None:  # FSDP1 marks the parameters it flattened (torch/distributed/fsdp/_flat_param.py)
            raise ValueError(
                f"{flat[0] or '<root>'}.{flat[1]} is flattened by FSDP1 (FullyShardedDataParallel): its gradient "
                "is a 1-D slice of a flat buffer whose units (rows) cannot be told apart, so AGC is not applied; "
                "FSDP2 (fully_shard) is supported")
        units = unit_shards(grads, weights)
        if units is None:
            return clip_unitwise(grads, weights, clip.unitwise_ratio, clip.eps, rs.enforce)
        counts = clip_unitwise(units.grads, units.weights, clip.unitwise_ratio, clip.eps, rs.enforce,
                               units.split, sum_over_groups)
        return torch.cat(sum_over_groups(list(torch.split(counts, 1)), units.apart))

    def _clip(
        self, rs: RuleState, index: int, action: Clip, rows: list[tuple[str, str]], tensors: list[torch.Tensor],
        inplace: bool,
    ) -> tuple[list[torch.Tensor], bool]:
        """A norm clip (in audit mode: its measurement only); what it did goes to the read-back as a `ClipEntry`."""
        groups = _groups(rows, action.per)
        keys = [group_key(*rows[group[0]], action.per) for group in groups]
        limits = self._limits(rs, index, action, keys)
        new, report = clip_norm(list(tensors), limits, action.norm_type, groups, inplace, apply=rs.enforce)
        self._ledger.entries.append(ClipEntry(rs, index, keys, report, limits))
        applied = rs.enforce and any(limit is not None for limit in limits)
        return (new, True) if applied else (tensors, False)

    def _limits(self, rs: RuleState, index: int, action: Clip, keys: list[tuple[str, str]]) -> list[Optional[float]]:
        """Each group's max_norm now: the number, or the expression evaluated on its norm's history.

        A group whose series has fewer than `warmup` values, or whose threshold is NaN (no
        history yet) or not positive, is not clipped this time (a threshold <= 0 is said once).
        """
        if not isinstance(action.max_norm, Value):
            return [action.max_norm] * len(keys)
        expression = action.max_norm
        tracked = self.history.tracking(rs.key, index, ("norm",), action.calls, action.warmup)
        limits: list[Optional[float]] = []
        for module, tensor in keys:
            if not tracked.ready(module, tensor):
                limits.append(None)
                continue
            limit = tracked.threshold(expression, module, tensor)
            if limit <= 0 and self._said_limits((rs.key, index)):
                log.warning("%s/%s: max_norm %s is %g at step %d for %s, which clips nothing; a threshold that is "
                            "not positive never clips (said once)", *rs.key, expression, limit, self._faults.step(),
                            module or "<root>")
            limits.append(limit if limit > 0 else None)  # NaN > 0 is False: no history, no clip
        return limits


def _input_tensors(inputs: tuple[Any, Any], keep: Any) -> Named:
    args, kwargs = inputs
    return named_tensors(args, keep) + named_tensors(kwargs, keep)


def _replace_inputs(inputs: tuple[Any, Any], new: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    args, kwargs = inputs
    return replace_tensors(args, new), replace_tensors(kwargs, new)


def _groups(rows: Sequence[tuple[str, str]], per: str) -> list[list[int]]:
    if per == "tensor":
        return [[i] for i in range(len(rows))]
    if per == "rule":
        return [list(range(len(rows)))]
    by_module: dict[str, list[int]] = {}
    for i, (module, _) in enumerate(rows):
        by_module.setdefault(module, []).append(i)
    return list(by_module.values())


def _copies(
    op: StatsOp, rows: list[tuple[str, str]], tensors: list[torch.Tensor],
    sharded: Optional[tuple[list[torch.Tensor], Shards]],
) -> list[tuple[int, str, str, torch.Tensor]]:
    """Detached copies for tensor files; of a DTensor, this rank's shard (the whole would take a collective)."""
    if sharded is None:
        return [(index, module, name, t.detach().clone())
                for index, _ in op.tensors for (module, name), t in zip(rows, tensors)]
    names = [shard_name(name) if groups else name for (_, name), groups in zip(rows, sharded[1].groups)]
    return [(index, module, names[i], sharded[0][i].detach().clone())
            for index, _ in op.tensors for i, (module, _) in enumerate(rows)]
