"""The runtime: installs exactly the hooks a plan needs, runs them, and reads back once a step.

Hook bodies are a trigger check plus the compiled program of their rule: statistics
stay on the device as partial matrices in `self._buffer`; at the step boundary
`_readback` fetches all of them with one transfer, finishes the statistics, publishes
metrics, writes logs and tensor files, and decides alerts (skip the step, halt).

Hooks are installed per step: at each step boundary the set of active rules (their
`every` and `steps` window) is recomputed, and a module keeps a hook only while one of
its rules is active, so an inactive rule costs nothing at all. The root module always
carries two small hooks: one decides the phase (train/eval) once per forward, the other
marks backward passes for the step tracker.

Hooks are global state on the user's model: every handle is kept and `remove()` (also
on exceptions, through the context manager) takes all of them off again.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
import weakref
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import torch
from prometheus_client import CollectorRegistry
from torch.utils.hooks import RemovableHandle

from .actions import StatsOp, compile_rule, mutate
from ..errors import Halt, HookPolicyError
from ..export.metrics import MetricsStore, store_for
from ..policy.model import Alert, Policy, Rule
from ..plan.planner import Binding, Plan, build_plan
from .readback import MAX_ERRORS, Entry, Readback, RuleState
from ..export.sinks import output_root
from .stats import tensor_partials
from .steps import StepTracker
from .structure import named_tensors, replace_tensors, selector

__all__ = ["Attached", "MAX_ERRORS"]

log = logging.getLogger("hookpolicy")

Named = list[tuple[str, torch.Tensor]]


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
        self.rank = _default_rank() if rank is None else rank
        self.step = start_step
        self.store: MetricsStore = store_for(registry, self.rank)
        self._rules: dict[tuple[str, str], RuleState] = {}
        for b in self.plan.bindings:
            rs = self._rules.get(b.key)
            if rs is None:
                mode = "audit" if audit else b.rule.mode
                rs = self._rules[b.key] = RuleState(b.policy, b.rule, compile_rule(b.rule), mode)
            rs.bindings.append(b)
        self._selectors = {key: selector(rs.rule.select) for key, rs in self._rules.items()}
        # A step rule's count of finite elements waits for the readback (no pass over the
        # gradients in a normal step, see stats.resolve_counts) unless some step rule clips or
        # scales the gradients in between, which could change what the count would see.
        self._defer_step_counts = not any(
            not isinstance(op, StatsOp) for rs in self._rules.values() if rs.rule.trigger.at == "step" for op in rs.program
        )
        self._buffer: list[Entry] = []
        self._counts: dict[tuple[str, ...], float] = defaultdict(float)
        self._seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._report = Readback(self.store, self.policies, output_root(), self.rank, self._fail, self._seconds)
        self._active: Optional[frozenset[tuple[str, str]]] = None
        self._module_handles: list[RemovableHandle] = []
        self._train = True
        self._root_depth = 0
        self._removed = False
        self._versions: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self._warned_inplace: set[tuple[str, ...]] = set()
        for warning in self.plan.warnings:
            log.warning("%s", warning)
        _claim_model(model, self.policies)  # from here on nothing raises before the hooks are in
        self._publish_initial_series(audit)
        self._tracker = StepTracker(model, self)
        self._root_handles = [
            model.register_forward_pre_hook(self._root_pre),
            model.register_forward_hook(self._root_post, always_call=True),
        ]
        self._activate()

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
        self.store.set("hookpolicy_config_last_reload_successful", (), 1.0)

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
        for handle in [*self._root_handles, *self._module_handles]:
            handle.remove()
        self._module_handles.clear()
        self._tracker.remove()
        try:
            self._readback(final=True)
        except Halt:
            pass
        finally:
            for rs in self._rules.values():
                for sink in rs.logs.values():
                    sink.close()
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
        for rs in self._ordered_rules(hook="step"):
            self._guarded(rs, self._run_step_rule, rs)
        return self._readback()

    def end_step(self) -> None:
        self.step += 1
        self.store.raise_to("hookpolicy_steps", (), self.step)
        self.store.set("hookpolicy_last_step_timestamp_seconds", (), time.time())
        self._activate()

    def discard_step(self) -> None:
        self._buffer.clear()

    # -- installing hooks --------------------------------------------------------------
    def _activate(self) -> None:
        """Install hooks for the rules active at `self.step`; nothing changes if the set is the same."""
        active = frozenset(
            key for key, rs in self._rules.items()
            if not rs.off and rs.rule.trigger.active_at(self.step)
        )
        if active == self._active:
            return
        self._active = active
        for handle in self._module_handles:
            handle.remove()
        self._module_handles.clear()
        by_module: dict[int, tuple[torch.nn.Module, list[Binding], list[Binding]]] = {}
        for b in self.plan.bindings:
            if b.key not in active or b.hook == "step":
                continue
            module, pre, post = by_module.setdefault(id(b.obj), (b.obj, [], []))
            if b.hook == "forward_pre" or b.target == "grad_input":
                pre.append(b)
            if b.hook in ("forward", "backward"):
                post.append(b)
        for module, pre, post in by_module.values():
            if pre:
                self._module_handles.append(module.register_forward_pre_hook(
                    lambda m, a, k, pre=pre: self._pre_hook(pre, a, k), with_kwargs=True))
            if post:
                self._module_handles.append(module.register_forward_hook(
                    lambda m, a, k, o, post=post: self._post_hook(post, m, a, k, o), with_kwargs=True))

    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._root_depth += 1
        if self._root_depth > 1 or _recomputing():
            return
        self._train = module.training and torch.is_grad_enabled()
        if self._train:
            self._tracker.check_forward()

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_depth or _recomputing():
            return
        if not self._train:
            if self._buffer:
                self._readback()  # an evaluation loop steps no optimizer: read back per batch
        elif torch.is_grad_enabled():
            for _, t in named_tensors(output, lambda name: True):
                if t.requires_grad:
                    t.register_hook(self._tracker.output_grad_hook)  # type: ignore[no-untyped-call]

    # -- hook bodies -------------------------------------------------------------------
    def _phase_ok(self, rule: Rule, module: Optional[torch.nn.Module] = None) -> bool:
        phase = rule.trigger.phase
        if phase == "any":
            return True
        train = self._train if self._root_depth > 0 or module is None else (
            module.training and torch.is_grad_enabled())
        return train == (phase == "train")

    def _pre_hook(self, bindings: list[Binding], args: Any, kwargs: Any) -> Any:
        recomputing = _recomputing()
        inputs: Any = (args, kwargs)
        changed = False
        for b in bindings:
            rs = self._rules[b.key]
            if rs.off or not self._phase_ok(rs.rule, b.obj):
                continue
            if b.target == "grad_input":
                inputs, hooked = self._guarded(rs, self._hook_grad_input, rs, b, inputs) or (inputs, False)
                changed |= hooked
            elif not recomputing:
                new = self._guarded(rs, self._run_named, rs, b, _input_tensors(inputs, self._selectors[b.key]))
                if new:
                    inputs, changed = _replace_inputs(inputs, new), True
        return inputs if changed else None

    def _post_hook(self, bindings: list[Binding], module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        recomputing = _recomputing()
        changed = False
        for b in bindings:
            rs = self._rules[b.key]
            if rs.off or not self._phase_ok(rs.rule, module):
                continue
            keep = self._selectors[b.key]
            if b.target == "grad_output":
                for name, t in named_tensors(output, keep):
                    if t.requires_grad:
                        t.register_hook(lambda g, rs=rs, b=b, name=name: self._grad_hook(rs, b, name, g))  # type: ignore[no-untyped-call]
            elif b.target == "grad_input":
                self._check_grad_input(rs, b, (args, kwargs))
            elif not recomputing:
                named = named_tensors(output, keep) if b.target == "output" else _input_tensors((args, kwargs), keep)
                new = self._guarded(rs, self._run_named, rs, b, named)
                if new and b.target == "output":
                    output, changed = replace_tensors(output, new), True
        return output if changed else None

    def _grad_hook(self, rs: RuleState, b: Binding, name: str, grad: torch.Tensor) -> Optional[torch.Tensor]:
        if rs.off or grad is None or grad.numel() == 0:
            return None
        new = self._guarded(rs, self._run_named, rs, b, [(name, grad)])
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
            if b.key + (b.module,) not in self._warned_inplace:
                self._warned_inplace.add(b.key + (b.module,))
                log.warning("%s/%s: no input of %s requires grad, so its grad_input never fires",
                            *b.key, b.module or "<root>")
            return inputs, False
        self._versions[id(b)] = [(v, v._version) for v in views.values()]
        return _replace_inputs(inputs, views), True

    def _check_grad_input(self, rs: RuleState, b: Binding, inputs: Any) -> None:
        for view, version in self._versions.pop(id(b), []):
            if view._version != version and b.key not in self._warned_inplace:
                self._warned_inplace.add(b.key)
                log.warning(
                    "%s/%s: %s modifies its input in place, so its grad_input cannot be observed; "
                    "use grad_output of the module before it", *b.key, b.module or "<root>",
                )

    def _run_named(self, rs: RuleState, b: Binding, named: Named) -> Optional[dict[str, torch.Tensor]]:
        if not named:
            return None
        rows = [(b.module, name) for name, _ in named]
        new = self._execute(rs, b.target, rows, [t for _, t in named], inplace=False)
        return None if new is None else {name: t for (name, _), t in zip(named, new)}

    def _run_step_rule(self, rs: RuleState) -> None:
        rows: list[tuple[str, str]] = []
        tensors: list[torch.Tensor] = []
        for b in rs.bindings:
            for pname in b.params:
                param = b.obj._parameters.get(pname)
                if param is None:  # not a registered parameter (a property, a wrapper's alias)
                    param = getattr(b.obj, pname)
                t = param.grad if rs.rule.target == "grad" else param.detach()
                if t is not None and t.numel() > 0:
                    rows.append((b.module, pname))
                    tensors.append(t)
        if tensors:
            self._execute(rs, rs.rule.target, rows, tensors, inplace=True, defer=self._defer_step_counts)

    def _execute(
        self, rs: RuleState, target: str, rows: list[tuple[str, str]], tensors: list[torch.Tensor], inplace: bool,
        defer: bool = False,
    ) -> Optional[list[torch.Tensor]]:
        """Run a rule's program on tensors; returns replacements when a mutation applied."""
        changed = False
        for op, count_keys in zip(rs.program, rs.count_keys):
            if isinstance(op, StatsOp):
                copies = [
                    (index, module, name, t.detach().clone())
                    for index, _ in op.tensors for (module, name), t in zip(rows, tensors)
                ]
                deferred = defer and "finite" in op.kinds
                matrix = tensor_partials(tensors, op.kinds, defer_counts=True) if deferred else tensor_partials(tensors, op.kinds)
                self._buffer.append(Entry(rs, op, target, rows, [t.numel() for t in tensors], matrix, copies,
                                          list(tensors) if deferred else None))
                for key in count_keys:
                    self._counts[key] += 1
            else:
                self._counts[count_keys[0]] += 1
                if rs.enforce:
                    tensors = mutate(op.action, list(tensors), _groups(rows, getattr(op.action, "per", "tensor")), inplace)
                    changed = True
        return tensors if changed else None

    def _guarded(self, rs: RuleState, fn: Any, *args: Any) -> Any:
        """Call a hook body, timing it; an exception is contained per the policy's onError."""
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - containment is the point
            self._fail(rs, exc)
            return None
        finally:
            self._seconds[rs.key] += time.perf_counter() - start

    def _fail(self, rs: RuleState, exc: BaseException) -> None:
        rs.errors += 1
        self.store.inc("hookpolicy_hook_errors", rs.key)
        if rs.policy.on_error == "halt":
            raise self._halting(
                Halt(rs.policy.name, rs.rule.name, self.step, f"hook error: {type(exc).__name__}: {exc}")
            ) from exc
        if rs.errors == 1:
            log.error(
                "%s/%s raised at step %d (logged once; the rule is switched off after %d errors):\n%s",
                *rs.key, self.step, MAX_ERRORS, "".join(traceback.format_exception(exc)).rstrip(),
            )
        if rs.errors == MAX_ERRORS:
            log.error("%s/%s switched off after %d errors", *rs.key, MAX_ERRORS)

    # -- readback ----------------------------------------------------------------------
    def _readback(self, final: bool = False) -> bool:
        """Report the buffered statistics (one transfer) and decide the step; True to skip it.

        `final` (at `remove()`) publishes what is left but takes no skip or halt decision.
        """
        entries, self._buffer = self._buffer, []
        skip, halt = self._report.run(entries, self.step, final)
        self._flush_counters()
        if halt is not None:
            raise self._halting(halt)
        return skip

    def _halting(self, halt: Halt) -> Halt:
        """Tell `on_halt` before the Halt propagates: the script may catch or hide it."""
        if self._on_halt is not None:
            self._on_halt(halt)
        return halt

    def _flush_counters(self) -> None:
        for labels, count in self._counts.items():
            self.store.inc("hookpolicy_actions", labels, count)
        for key, seconds in self._seconds.items():
            self.store.inc("hookpolicy_hook_seconds", key, seconds)
        self._counts.clear()
        self._seconds.clear()

    def _ordered_rules(self, hook: str) -> list[RuleState]:
        active = self._active or frozenset()
        return [rs for key, rs in self._rules.items()
                if rs.rule.trigger.at == hook and key in active and not rs.off]


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


def _recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside the backward pass."""
    return bool(torch._C._current_graph_task_id() != -1)


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


def _default_rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0
