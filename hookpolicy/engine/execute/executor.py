"""Hook bodies: a phase check, then the rule's compiled program (`programs`), with errors contained.

`Executor` is what the installed module hooks call (`pre_hook`, `post_hook`, and through
them tensor hooks on gradients and on identity views of inputs, for `grad_output` and
`grad_input`). It picks the tensors a binding targets and hands them to
`Programs.execute`, which records into the step's ledger and may return replacement
tensors. A hook body runs under `Faults.guarded`: its exception is a fault of its rule,
its time goes to the ledger. The work around it for each rule a hook call serves (the phase
check, picking the tensors, registering a gradient's tensor hook, replacing the output) is
contained the same way (`Faults.fail`), so no fault of hookpolicy's reaches the script's
forward or backward pass, and the hook's other rules still run.

**Named tensors** (`named_tensors`, `replace_tensors`, `selector`): floating-point tensors
inside the tuples, lists and dicts that modules take and return.

A module's output may be a tensor, a tuple `(logits, hidden)`, a dict `{"logits": ...}`
or any nesting of these. Every floating-point tensor in it is a target, named by its
path: `""` for a bare tensor, `"0"`, `"1"` for positions, `"logits"` for keys, `"1.0"`
for nesting. `select` keeps the tensors whose first path component is listed.

**Installing module hooks per step** (`HookInstaller`): a module carries a hook only while
one of its rules is active.

At each step boundary `activate(step)` recomputes the set of active rules (their `every`
and `steps` window, minus rules switched off by errors, minus the rules with `trigger.after`
that no alert woke). If the set is unchanged nothing
happens; otherwise every module hook is removed and re-registered for exactly the active
rules, grouped per module: one forward pre-hook (`forward_pre` targets, and the identity
views of `grad_input`) and one forward hook (`forward` and `backward` targets). A rule
with `every: 100` therefore has no hook installed on 99 steps out of 100. The hooks go
through `module_hooks`, so copies and saves of the model never carry them; `rebind(plan)`
installs them anew for a model whose tree changed.

**Rules that wake on an alert** (`trigger.after`): such a rule is asleep, with no hook
installed, until `wake(fired, step)` hears that an alert of the rule it names fired at the
decision of `step` (the step cycle hands it the alerts every rank agreed fired, so every rank
wakes the same rules at the same step). It is then awake on the steps `step + 1` to
`step + steps`, at the next `activate`; an alert that fires while it is awake moves the end to
`steps` steps after the later alert. The window counts step numbers (`hookpolicy_steps_total`),
so a step that was skipped or rewound is one of them.

**Re-binding** (`Rebinding`): the rules bound anew when the model's tree changes, at a step boundary only.

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
from typing import Any, Callable, Collection, Iterator, Mapping, Optional, Protocol, Sequence, Union

import torch

from ...export.metrics import ALERT_FIRING, ALERTS, HOOK_ERRORS, REWINDS, SKIPPED_STEPS
from ...export.store import ModelMetrics
from ...plan.planner import Binding, Plan, build_plan
from ...process import Once
from ...policy.model import Alert, AlertKey, Policy, RuleKey
from ..hooks import module_hooks, tensor_hooks
from .programs import Faults, Programs, measure_plans, measures_only, ran_labels
from ..measure.rulestate import RuleState, rebind
from .steps import Phase, recomputing

__all__ = ["Call", "Executor", "HookInstaller", "Rebinding", "named_tensors", "publish_rule_series", "replace_tensors", "selector", "woken"]

log = logging.getLogger("hookpolicy")

Named = list[tuple[str, torch.Tensor]]


class Executor:
    """Runs the rules of one attachment inside module hooks; see the module docstring."""

    def __init__(
        self, rules: dict[tuple[str, str], RuleState], phase: Phase, faults: Faults, programs: Programs,
    ) -> None:
        self.rules = rules
        self.guarded = faults.guarded
        self._fail = faults.fail
        self._programs = programs
        self._phase = phase
        self.rules_changed()
        self._versions: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self._said_inplace = Once()  # (policy, rule[, module]): grad_input that cannot be observed

    def rules_changed(self) -> None:
        """Derive what the hook bodies need from `rules` (again, after a rule joined on a rebind)."""
        self._selectors = {key: selector(rs.rule.select) for key, rs in self.rules.items()}
        #: each binding's `Call` (by the binding's id, the binding kept to tell a reused id), made at its first install
        self._calls: dict[int, tuple[Binding, Call]] = {}

    def calls(self, bindings: Sequence[Binding]) -> tuple["Call", ...]:
        """What a hook call does for each of `bindings` (`Call`), decided when its hook is first installed and
        kept until the rules are bound anew (a rule with `every: 10` has its hooks installed 10 times in 100 steps)."""
        calls = []
        for b in bindings:
            known = self._calls.get(id(b))
            if known is None or known[0] is not b:
                known = self._calls[id(b)] = (b, Call(self.rules[b.key], b, self._selectors[b.key], self._grad_hook))
            calls.append(known[1])
        return tuple(calls)

    # -- module hooks ------------------------------------------------------------------
    def pre_hook(self, calls: Sequence[Call], module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        """hook(module, args, kwargs) -> None or (new_args, new_kwargs), for `calls`."""
        inputs: Any = (args, kwargs)
        changed = False
        for c in calls:
            rs = c.rs
            try:  # each call contained as its rule's body is (`Faults.fail`): no fault of ours reaches the forward
                if rs.off or (c.train is not None and self._phase.training(module) != c.train):
                    continue
                if c.target == "grad_input":
                    inputs, hooked = self.guarded(rs, self._hook_grad_input, c, inputs) or (inputs, False)
                    changed |= hooked
                elif not recomputing():  # asked inside the containment: torch's private call
                    new = self.guarded(rs, self._run_named, c, _input_tensors(inputs, c.keep))
                    if new:
                        inputs, changed = _replace_inputs(inputs, new), True
            except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: its rule's, never the script's
                self._fail(rs, exc)
        return inputs if changed else None

    def post_hook(self, calls: Sequence[Call], module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        """hook(module, args, kwargs, output) -> None or a new output, for `calls`.

        A bare output tensor (exactly `torch.Tensor`: no DTensor, no other subclass) takes
        the short road: its gradient's tensor hook is the call's own (`Call.on_grad`), and a
        program that only measures goes to `Programs.measure`. Anything else walks the output.
        """
        changed = False
        bare = type(output) is torch.Tensor
        for c in calls:
            rs = c.rs
            try:  # as in `pre_hook`: a fault of this call is its rule's, and the next call runs
                if rs.off or (c.train is not None and self._phase.training(module) != c.train):
                    continue
                target = c.target
                if target == "grad_output":
                    if bare:
                        if output.requires_grad and output.is_floating_point() and output.numel() > 0:
                            tensor_hooks.add(output, c.on_grad)
                        continue
                    for name, t in named_tensors(output, c.keep):
                        if t.requires_grad:
                            tensor_hooks.add(t, grad_hook_of(self._grad_hook, c, name))
                elif target == "grad_input":
                    self._check_grad_input(c, (args, kwargs))
                elif not recomputing():  # asked inside the containment: torch's private call
                    if bare and c.measures and target == "output":
                        if output.is_floating_point() and output.numel() > 0:
                            self._programs.measure(rs, target, c.rows, output, c.ran, c.plans)
                        continue
                    named = (named_tensors(output, c.keep) if target == "output"
                             else _input_tensors((args, kwargs), c.keep))
                    new = self.guarded(rs, self._run_named, c, named)
                    if new and target == "output":
                        output, changed = replace_tensors(output, new), True
            except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: its rule's, never the script's
                self._fail(rs, exc)
        return output if changed else None

    def _grad_hook(self, c: Call, name: str, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """hook(grad) -> None or a new gradient, for the tensor `name` of `c`'s target."""
        rs = c.rs
        try:  # as in `pre_hook`: a fault here is its rule's, and the backward pass goes on with `grad`
            if rs.off or grad is None or grad.numel() == 0:
                return None
            if c.measures and type(grad) is torch.Tensor:
                rows = c.rows if name == "" else [(c.binding.module, name)]
                self._programs.measure(rs, c.target, rows, grad, c.ran, c.plans)
                return None
            new = self.guarded(rs, self._run_named, c, [(name, grad)])
            return new[name] if new else None
        except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: its rule's, never the script's
            self._fail(rs, exc)
            return None

    def _hook_grad_input(self, c: Call, inputs: Any) -> tuple[Any, bool]:
        """Route each input through an identity view whose gradient is this module's own."""
        b = c.binding
        views: dict[str, torch.Tensor] = {}
        for name, t in _input_tensors(inputs, c.keep):
            if t.requires_grad:
                view = t.view_as(t)
                tensor_hooks.add(view, grad_hook_of(self._grad_hook, c, name))
                views[name] = view
        if not views:
            if self._said_inplace(b.key + (b.module,)):
                log.warning("%s/%s: no input of %s requires grad, so its grad_input never fires",
                            *b.key, b.module or "<root>")
            return inputs, False
        self._versions[id(b)] = [(v, v._version) for v in views.values()]
        return _replace_inputs(inputs, views), True

    def _check_grad_input(self, c: Call, inputs: Any) -> None:
        b = c.binding
        for view, version in self._versions.pop(id(b), []):
            if view._version != version and self._said_inplace(b.key):
                log.warning(
                    "%s/%s: %s modifies its input in place, so its grad_input cannot be observed; "
                    "use grad_output of the module before it", *b.key, b.module or "<root>",
                )

    # -- programs ----------------------------------------------------------------------

    def _run_named(self, c: Call, named: Named) -> Optional[dict[str, torch.Tensor]]:
        if not named:
            return None
        rows = [(c.binding.module, name) for name, _ in named]
        new = self._programs.execute(c.rs, c.target, rows, [t for _, t in named], inplace=False)
        return None if new is None else {name: t for (name, _), t in zip(named, new)}


class Call:
    """What a hook call does for one binding, decided when its hook is installed, not at each call.

    The rule's state, its phase (`train`: None for `phase: any`), its tensor selector, the
    row of a bare tensor, the `hookpolicy_actions_total` labels its program counts, whether
    the program only measures (`programs.measures_only`: nothing it does can change a
    tensor) and then its passes' row plans (`programs.measure_plans`), and the tensor hook of a bare output's gradient, made once. What cannot be
    known then (whether the output is a bare tensor or a DTensor, a recomputed forward, the
    phase of this forward, a rule switched off since) is still asked at each call.
    """

    __slots__ = ("rs", "binding", "target", "train", "keep", "measures", "plans", "rows", "ran", "on_grad")

    def __init__(
        self, rs: RuleState, binding: Binding, keep: Selector,
        on_grad: GradBody,
    ) -> None:
        self.rs = rs
        self.binding = binding
        self.target = binding.target
        phase = rs.rule.trigger.phase
        self.train: Optional[bool] = None if phase == "any" else phase == "train"
        self.keep = keep
        self.measures = measures_only(rs)
        self.plans = measure_plans(rs) if self.measures else ()
        self.rows = [(binding.module, "")]
        self.ran = ran_labels(rs, binding.module)
        self.on_grad = grad_hook_of(on_grad, self, "")


#: `Executor._grad_hook`: the body of a gradient's tensor hook, given its call and the tensor's name
GradBody = Callable[["Call", str, torch.Tensor], Optional[torch.Tensor]]


def grad_hook_of(body: GradBody, c: Call, name: str) -> Callable[[torch.Tensor], Optional[torch.Tensor]]:
    """`hook(grad) -> None or a new gradient` for the tensor `name` of `c`'s target: `body` with its first
    arguments given, as a function (see `bound`), of fixed arity (no argument tuples built per call)."""
    return lambda grad: body(c, name, grad)


def bound(fn: Callable[..., Any], *head: Any) -> Callable[..., Any]:
    """`fn` with its first arguments given: a function, not a `functools.partial`.

    A hook lives in a module's or a tensor's hook dict, and `copy.deepcopy` of the model
    copies those dicts wherever `nn.Module.__reduce_ex__`'s filter is not in place (a class
    with its own reduction, the filter switched off after its faults). It keeps a function as
    it is, but deep-copies a partial's arguments: the rules' state, with its locks, which
    cannot be copied, so the user's copy would raise.
    """
    return lambda *rest: fn(*head, *rest)


def post_hook_of(
    run: "Executor", calls: tuple["Call", ...],
) -> Callable[[torch.nn.Module, Any, Any, Any], Any]:
    """`hook(module, args, kwargs, output)` running `run.post_hook` for `calls`: `bound`, of fixed arity."""
    post = run.post_hook
    return lambda module, args, kwargs, output: post(calls, module, args, kwargs, output)


def _input_tensors(inputs: tuple[Any, Any], keep: Any) -> Named:
    args, kwargs = inputs
    return named_tensors(args, keep) + named_tensors(kwargs, keep)


def _replace_inputs(inputs: tuple[Any, Any], new: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    args, kwargs = inputs
    return replace_tensors(args, new), replace_tensors(kwargs, new)


Selector = Callable[[str], bool]


def selector(select: Sequence[Union[int, str]]) -> Selector:
    """A predicate on tensor names keeping those whose first component is in `select`."""
    if not select:
        return lambda name: True
    wanted = frozenset(str(s) for s in select)
    return lambda name: name == "" or name.split(".", 1)[0] in wanted


def named_tensors(obj: Any, keep: Selector) -> list[tuple[str, torch.Tensor]]:
    """Every non-empty floating-point tensor in `obj` with its path name, in order."""
    return [(name, t) for name, t in _walk(obj, "") if keep(name)]


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() > 0:
            yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _walk(item, _join(prefix, str(i)))
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from _walk(item, _join(prefix, str(key)))


def _join(prefix: str, part: str) -> str:
    return f"{prefix}.{part}" if prefix else part


def replace_tensors(obj: Any, new: Mapping[str, torch.Tensor], prefix: str = "") -> Any:
    """A copy of `obj` with the tensors named in `new` swapped in; containers keep their type."""
    if isinstance(obj, torch.Tensor):
        return new.get(prefix, obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(replace_tensors(v, new, _join(prefix, str(i))) for i, v in enumerate(obj)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(replace_tensors(v, new, _join(prefix, str(i))) for i, v in enumerate(obj))
    if isinstance(obj, dict):
        out = obj.copy()
        for key, value in obj.items():
            out[key] = replace_tensors(value, new, _join(prefix, str(key)))
        return out
    return obj


def woken(window: tuple[int, int], step: int, steps: int) -> tuple[int, int]:
    """The steps `[first, end)` a rule is awake on once an alert it waits for fired at the decision of `step`,
    given the window it had (`(0, 0)`: none): the `steps` steps after `step`, a window still open extended.
    `HookInstaller.wake` and `hookpolicy replay` both call it."""
    first, end = window
    if end <= step + 1:  # asleep (or awake to this step at most): a new window after this step
        first = step + 1
    return first, step + 1 + steps


class HookInstaller:
    """The module hooks of one attachment; their bodies are the executor's."""

    def __init__(self, plan: Plan, rules: dict[tuple[str, str], RuleState], executor: Executor) -> None:
        self._plan = plan
        self._rules = rules
        self._executor = executor
        self._active: Optional[frozenset[tuple[str, str]]] = None
        self._step: list[RuleState] = []  # the `step` rules of `_active`, in plan order (switched off or not)
        self._handles: list[module_hooks.OwnHandle] = []
        #: per rule with `trigger.after`: the steps it is awake on, `range(first, end)` (none until woken)
        self.awake: dict[RuleKey, tuple[int, int]] = {}

    def wake(self, fired: Collection[AlertKey], step: int) -> None:
        """The alerts that `fired` at the decision of `step` (every rank's): wake the rules that wait for them."""
        rules = {rule for rule, _ in fired}
        for key, rs in self._rules.items():
            after = rs.rule.trigger.after
            if after is None or after.rule not in rules:
                continue
            self.awake[key] = woken(self.awake.get(key, (0, 0)), step, after.steps)

    def _awake(self, key: RuleKey, step: int) -> bool:
        """Whether a rule with `trigger.after` is within a window its alert woke (`activate` asks only for those)."""
        first, end = self.awake.get(key, (0, 0))
        return first <= step < end

    def rebind(self, plan: Plan) -> None:
        """Bind to `plan` (the model changed); the next `activate` installs its hooks whatever the set."""
        self._plan = plan
        self._active = None
        self._step = []

    def activate(self, step: int) -> None:
        """Install hooks for the rules active at `step`; nothing changes if the set is the same."""
        active = frozenset(
            key for key, rs in self._rules.items()
            if not rs.off and rs.rule.trigger.active_at(step)
            and (rs.rule.trigger.after is None or self._awake(key, step))
        )
        if active == self._active:
            return
        self._active = active
        self._step = [rs for key, rs in self._rules.items() if rs.rule.trigger.at == "step" and key in active]
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
                    module, bound(run.pre_hook, run.calls(pre)), with_kwargs=True))
            if post:
                self._handles.append(module_hooks.forward_hook(
                    module, post_hook_of(run, run.calls(post)), with_kwargs=True))

    def step_rules(self) -> list[RuleState]:
        """The `step` rules active now and not switched off, in plan order (found when the active set changed)."""
        return [rs for rs in self._step if not rs.off]

    @property
    def has_step_rules(self) -> bool:
        """Whether a `step` rule is active now, switched off or not (False: `step_rules()` is empty, whatever turns off)."""
        return bool(self._step)

    @property
    def handles(self) -> list[module_hooks.OwnHandle]:
        """The module hooks installed now (the list itself, kept up to date; they hold no module)."""
        return self._handles

    def remove(self) -> None:
        """Take every module hook off (the active set is kept)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


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
