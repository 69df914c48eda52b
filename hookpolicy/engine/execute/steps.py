"""Where steps begin and end: optimizer step hooks, backward passes, and skipped steps.

A *step* is one `torch.optim` optimizer `step()` over the attached model's parameters.
Several optimizers stepping the same model after one backward pass (one per parameter
group, say) make one step, not several: a step is evaluated at the first optimizer step
after a backward pass. Optimizers that step in turn, each after its own backward pass (a
GAN), make one step each, and each step's rules see only the parameters it updates
(`Scopes`). A script that steps no optimizer (manual SGD) gets one step per backward
pass, evaluated when the backward pass has finished.

Traps this module handles:
- `GradScaler.step` calls `optimizer.step()` only when the gradients are finite, after
  unscaling them; so the pre-hook sees unscaled gradients and a skipped step is never
  evaluated. Its forward/backward statistics are dropped when the next forward finds the
  gradients reset (`zero_grad()`), so an overflow step raises no false alert.
- `skip_step` cannot stop `optimizer.step()` from running: the step cycle hides the
  gradients from it (`HiddenGrads`) and puts them back after the update.
- The root module's two small hooks (installed by the step cycle, `cycle`) ask here:
  the pre-hook decides the phase (train/eval) once per forward (`Phase`), the post-hook
  marks backward passes with a tensor hook on each output. Both skip a forward that
  activation checkpointing re-runs inside the backward pass (`recomputing()`).

`StepTracker` only answers and keeps count; it calls nothing back. The step cycle asks it
at each event (`update_starts`, `backward_done`, ...) and does the step's work itself.

**Skipping a step** (`HiddenGrads`): `skip_step` cannot stop `optimizer.step()` from
running, so it hides the gradients.

`p.grad = None` makes every torch optimizer leave a parameter alone without touching its
state; `restore` puts the gradients back in the step post-hook.

**Which parameters a step covers, and whether an optimizer step begins one** (`Scopes`):
from what backward passes wrote.

A GAN in one module (a LightningModule with a generator and a discriminator, each with
its own optimizer and its own backward pass) steps the model twice per iteration: the
discriminator's step, then the generator's. Each is a hookpolicy step, and at each one
the other optimizer's parameters still hold gradients from *its* backward pass (or from
this loss flowing through it), stale for this update. A `step` rule over the whole model
must not clip, count or skip on them: at an optimizer's step it sees only the parameters
that step updates. Several optimizers stepping after one backward pass (one per
parameter group), on the other hand, make one step.

**What a backward pass wrote** is known from PyTorch itself: every governed parameter
that requires grad carries a post-accumulate-grad hook
(`Tensor.register_post_accumulate_grad_hook`), which the autograd engine calls right after
it accumulated that parameter's gradient, whatever started the backward pass (the
model's forward or not, `zero_grad` with `set_to_none` or in place, a closure inside
`step()`). The hook runs no Python: it takes the parameter's id out of a dict
(`Scopes._hook_params`), and whoever asks takes the writes in first (`_flush`: the ids
gone from the dict join two sets); no tensor is read, no host sync. `written`: since its
optimizer's last step; `unseen`: since the last step was evaluated. An optimizer's step

- **begins a step** when one of its parameters was written since the last evaluation
  (`begins` is True): a backward pass came after it;
- **belongs to the step evaluated last** when its parameters were written, but all
  before that evaluation (False): it steps after the same backward pass as the
  optimizer evaluated there;
- is **unknown** when none of its parameters was written by a backward pass since its
  last step (None): gradients assigned by the script, or a stack whose backward does not
  accumulate into these parameters (FSDP2 writes the sharded `.grad` itself). The caller
  falls back on the model's own backward passes (`StepTracker`) and, where several optimizers
  step the model, says it cannot tell their steps apart.

**What a step updates** is learned from what stepped together: the optimizers that step
after one backward pass form a group, remembered per optimizer. At an optimizer's step
the rules leave out the parameters of every other optimizer seen stepping that was not
in its group the last time it stepped. Parameters no optimizer holds (frozen weights a
`target: weight` rule watches) are never left out; nor, on the very first step of an
optimizer, those of optimizers that have not stepped yet (nothing says yet that they step
apart: at worst that first step sees more than it updates).

Cost: one C call per written parameter per backward pass (a `dict.pop`, no Python frame);
at each optimizer step a few set operations done in C over its parameter ids. Each optimizer's parameter ids are computed once and kept while its
`param_groups` look the same (the ids and lengths of the groups' lists, so an
`add_param_group` is seen); the left-out set is rebuilt only when a group or an
optimizer's parameters change. The hooks are on the parameters, not in the module's
dicts: copies, pickles and `torch.save` of the model do not carry them.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import AbstractSet, Any, Callable, Iterable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from ... import process
from ..hooks import heap
from ..measure.rulestate import RuleState, refuse

__all__ = ["HiddenGrads", "Phase", "Scopes", "StepTracker", "recomputing"]

log = logging.getLogger("hookpolicy")


class Phase:
    """Whether the forward in progress trains, decided once at the root's forward."""

    def __init__(self) -> None:
        self.train = True
        self.depth = 0  # nesting of the root's forward (a model calling itself)

    def training(self, module: Optional[torch.nn.Module] = None) -> bool:
        """The root's decision inside its forward; outside it (a submodule called alone), `module`'s own."""
        if self.depth > 0 or module is None:
            return self.train
        return module.training and torch.is_grad_enabled()


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside the backward pass."""
    return bool(torch._C._current_graph_task_id() != -1)


class StepTracker:
    """Tells where the steps of one model begin and end; see the module docstring for what a step is.

    `phase` is written at the root's forward and read by the hook bodies. A step rule that
    cannot act as written on this model (an optimizer in backward, gradients kept elsewhere)
    is refused in `rules` (`rulestate.refuse`), said once per reason.
    """

    def __init__(self, model: torch.nn.Module, phase: Phase, rules: dict[tuple[str, str], RuleState],
                 name: str) -> None:
        self.phase = phase
        self._rules = rules
        self._name = name
        self._param_ids = {id(p) for p in model.parameters()}
        self._model_params = weakref.ref(model)
        self._owned: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        #: the optimizer `owns` last found owning this model: asked three times a step, answered without a lookup
        self._last_owner: Optional["weakref.ref[torch.optim.Optimizer]"] = None
        # not a method of this tracker: each parameter's hook holds the scopes, and a tracker
        # (holding a parameter as its probe) reachable from it would keep a dropped model's
        # parameters alive, in a cycle through PyTorch's C++ hook list that gc cannot see
        self._scopes = Scopes(functools.partial(_parameters_of, self._model_params))
        self.mode = "unknown"  # "optimizer" | "manual"
        self.backward_seq = 0
        self._evaluated_seq = -1
        self._in_backward = False
        #: the step being evaluated is skipped (the cycle sets it once it decided): its optimizers' updates get no gradients
        self.skipping = False
        self._ending = False
        self._probe: Optional[torch.nn.Parameter] = None
        self._hooked_steps = 0  # step hook calls (before and after the update) for this model
        self._stepping = False  # between before_update and after_update: updates are the optimizer's
        self._last_backward: Optional[tuple[torch.nn.Parameter, int, int]] = None  # probe, its version, _hooked_steps
        self._reported = process.Once()

    @property
    def scopes(self) -> Scopes:
        """What backward passes wrote to this model's parameters, and which optimizers step it together."""
        return self._scopes

    def remove(self) -> None:
        """Take the parameters' hooks off (`Scopes`)."""
        self._scopes.remove()

    def refresh(self) -> None:
        """The model's parameters changed (a module or parameter replaced): whose optimizer is whose anew."""
        self._param_ids = self._current_param_ids()
        self._owned = weakref.WeakKeyDictionary()
        self._last_owner = None
        self._scopes.reset()
        self._probe = None

    def _current_param_ids(self) -> set[int]:
        model = self._model_params()
        return self._param_ids if model is None else {id(p) for p in model.parameters()}

    # -- the root's forward ------------------------------------------------------------
    def forward_starts(self, module: torch.nn.Module) -> bool:
        """The root's forward begins: decide the phase; True when it is a training forward (not nested, not recomputed)."""
        phase = self.phase
        phase.depth += 1
        if phase.depth > 1 or recomputing():
            return False
        phase.train = module.training and torch.is_grad_enabled()
        return phase.train

    def forward_ends(self) -> Optional[bool]:
        """The root's forward ended: False for an evaluation forward, True for a training one under grad, else None."""
        phase = self.phase
        phase.depth = max(0, phase.depth - 1)
        if phase.depth or recomputing():
            return None
        if not phase.train:
            return False
        return True if torch.is_grad_enabled() else None

    def dropped(self) -> bool:
        """At a training forward: whether the step before was never taken (GradScaler found inf), once."""
        if (self.mode == "optimizer" and self.backward_seq > self._evaluated_seq
                and self._probe is not None and self._probe.grad is None and not self._in_backward):
            self._evaluated_seq = self.backward_seq
            return True
        return False

    # -- backward passes ---------------------------------------------------------------
    def backward_starts(self) -> bool:
        """A gradient reached a root output: True for the first of a backward pass."""
        self._scopes.reached()  # a backward call reached the model (`loss`), also where no parameter hook fires
        if self._in_backward:
            return False
        self._in_backward = True
        self.backward_seq += 1
        return True

    def backward_done(self) -> bool:
        """A backward pass ended; True when no optimizer steps this model, so this backward pass is a step."""
        self._in_backward = False
        probe = self._probe  # kept while it has a gradient: a walk of the model costs ~80 us a pass, cold
        if probe is None or probe.grad is None or id(probe) not in self._param_ids:
            model = self._model_params()
            self._probe = None if model is None else next((p for p in model.parameters() if p.grad is not None), None)
        self._check_hookless_update()
        if self.mode == "unknown":
            self.mode = "optimizer" if self._optimizer_exists() else "manual"
            log.debug("step mode: %s", self.mode)
        if self.mode == "manual":
            self._evaluated_seq = self.backward_seq
            self._scopes.used_up()
            return True
        return False

    def _check_hookless_update(self) -> None:
        """Parameters changed since the last backward pass, yet no optimizer step hook fired?

        Then something updates the model without `Optimizer.step`'s hooks (a custom update,
        or the unhooked step function): rules evaluated at an optimizer step would never
        run. Counting switches to one step per backward pass, evaluated when it ends, which
        is before such an update; the switch is said once. The in-place update shows in the
        parameter's version counter; reading it costs nothing.
        """
        probe, last = self._probe, self._last_backward
        self._last_backward = None if probe is None else (probe, probe._version, self._hooked_steps)
        if (self.mode != "optimizer" or self._stepping or probe is None or last is None or last[0] is not probe
                or last[2] != self._hooked_steps or last[1] == probe._version):
            return
        self.mode = "manual"
        self._report("its parameters changed between two backward passes without an optimizer step hook "
                     "firing, so optimizer steps cannot be seen; steps are counted per backward pass from here "
                     "on, evaluated when it ends (before such an update)", refused=False)

    def _report(self, reason: str, refused: bool) -> None:
        if self._reported(reason):
            refuse(self._rules, self._name, reason, refused)

    def _optimizer_exists(self) -> bool:
        """Whether some optimizer holds this model's parameters (a one-time scan of the heap)."""
        return any(self.owns(o) for o in heap.live_optimizers())

    def zero_grads(self) -> None:
        """Skip a step counted per backward pass: zero the gradients no optimizer step will see."""
        model = self._model_params()
        if model is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()

    # -- optimizer steps ---------------------------------------------------------------
    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` holds some of this model's parameters (asked once per optimizer)."""
        last = self._last_owner
        if last is not None and last() is optimizer:
            return True
        owned = self._owned.get(optimizer)
        if owned is None:
            owned = any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])
            if not owned:  # the model may hold new parameter objects since (`model.to()` can make them)
                self._param_ids = self._current_param_ids()
                owned = any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])
            self._owned[optimizer] = owned
        if owned:
            self._last_owner = weakref.ref(optimizer)
        return owned

    def update_starts(self, optimizer: torch.optim.Optimizer) -> Optional[frozenset[int]]:
        """Before this model's `optimizer` updates: the ids of the parameters to leave out of a step to
        evaluate now (another optimizer's, see `Scopes`), or None when the update continues a step evaluated."""
        if self.mode != "optimizer":
            if self.mode == "manual":
                log.info("an optimizer now steps this model: counting optimizer steps from here on")
            self.mode = "optimizer"
        self._hooked_steps += 1
        self._stepping = True
        if torch._C._current_graph_task_id() != -1:
            self._report(f"{type(optimizer).__name__} steps inside the backward pass (an optimizer in backward), "
                         "before the step's gradients are final", refused=True)
        begins = self._scopes.begins(optimizer)
        unwritten = begins is None  # no backward pass wrote its gradients since its last step
        if begins is None:  # the model's own backward passes tell
            begins = self.backward_seq == 0 or self.backward_seq != self._evaluated_seq
        if begins or unwritten:
            self._check_grads(optimizer, unwritten)
        if not begins:
            self._scopes.continuing(optimizer)
            return None
        self._evaluated_seq = self.backward_seq
        self._ending = True
        self.skipping = False
        return self._scopes.evaluating(optimizer)

    def _check_grads(self, optimizer: torch.optim.Optimizer, unwritten: bool) -> None:
        """Say when `optimizer`'s step cannot be guarded as written (each said once, acting rules refused).

        None of its gradients at all after a backward pass: a wrapper keeps them elsewhere.
        `unwritten` (no backward pass wrote them since its last step), with other optimizers
        stepping this model: which step they belong to cannot be told (the post-accumulate-
        grad hooks did not fire: gradients assigned by the script, or FSDP2 writing the
        sharded `.grad` itself).
        """
        grads = False  # any of its parameters of this model with a .grad (a loop: no generator, stops at the first)
        ids = self._param_ids
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in ids and p.grad is not None:
                    grads = True
                    break
            if grads:
                break
        name = type(optimizer).__name__
        if self.backward_seq > 0 and not grads:
            self._report(f"{name} steps its parameters after a backward pass, but none of "
                         "them has a .grad (a wrapper keeps the gradients elsewhere)", refused=True)
        elif unwritten and grads and self._scopes.several(optimizer):
            self._report(f"{name} steps gradients that no backward pass wrote through autograd's accumulation "
                         "(assigned by the script, or sharded by FSDP2), while other optimizers step this model "
                         "too: which step they belong to and which parameters it updates cannot be told",
                         refused=True)

    def update_ends(self, optimizer: torch.optim.Optimizer) -> bool:
        """After the update of `optimizer`, one that `owns` this model (the caller asked): True when the step ends."""
        self._stepping = False
        self._hooked_steps += 1  # an update that ended after the last backward pass is an optimizer's too
        self._scopes.stepped(optimizer)
        ending, self._ending = self._ending, False
        return ending


def _parameters_of(model: "weakref.ref[torch.nn.Module]") -> list[torch.nn.Parameter]:
    """The parameters of `model` while it lives, else none."""
    module = model()
    return [] if module is None else list(module.parameters())


class HiddenGrads:
    """The gradients (and optimizer state) hidden from the optimizers of a skipped step, per optimizer."""

    def __init__(self) -> None:
        self._stash: dict[int, tuple[list[Optional[torch.Tensor]], dict[Any, dict[str, Any]]]] = {}

    def hide(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the step: no gradient for the optimizer, and its state as it is now restored afterwards.

        Every torch optimizer leaves a parameter without `.grad` alone, but not all of its
        bookkeeping: LBFGS counts the closure evaluation (`func_evals`) after the closure
        that hid them. A shallow copy of each parameter's state dict, taken only on a
        skipped step, puts such counters back; the state tensors are not touched.
        """
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = {p: dict(s) for p, s in optimizer.state.items()}
        self._stash[id(optimizer)] = ([p.grad for p in params], state)
        for p in params:
            p.grad = None

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """After the update: the gradients hidden from `optimizer` and its state as it was, back (if hidden)."""
        stash = self._stash.pop(id(optimizer), None)
        if stash is not None:
            grads, state = stash
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for p, grad in zip(params, grads):
                p.grad = grad
            for p in [p for p in optimizer.state if p not in state]:
                del optimizer.state[p]
            optimizer.state.update(state)


Optimizer = torch.optim.Optimizer
_Signature = tuple[tuple[int, int], ...]


def _signature(optimizer: Optimizer) -> _Signature:
    groups = optimizer.param_groups
    if len(groups) == 1:  # the usual optimizer: what the line below gives, without a generator
        params = groups[0]["params"]
        return ((id(params), len(params)),)
    return tuple((id(g["params"]), len(g["params"])) for g in groups)


class Scopes:
    """The backward passes' writes to one model's parameters, and the optimizers that step it, grouped by step."""

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._params = params
        #: each optimizer seen stepping -> the optimizers that stepped with it in its last step
        self._groups: "weakref.WeakKeyDictionary[Optimizer, weakref.WeakSet[Optimizer]]" = weakref.WeakKeyDictionary()
        self._current: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
        self._ids: "weakref.WeakKeyDictionary[Optimizer, tuple[_Signature, frozenset[int]]]" = (
            weakref.WeakKeyDictionary())
        self._left_out: dict[int, tuple[tuple[object, ...], frozenset[int]]] = {}
        #: `param_ids`' last answer (the optimizer, its signature, the ids): asked twice a step, found without `_ids`
        self._last_ids: Optional[tuple["weakref.ref[Optimizer]", _Signature, frozenset[int]]] = None
        #: `evaluating`'s one optimizer seen, stepping alone, and its group, while `_groups` is as it was (`_changes`)
        self._alone: Optional[tuple["weakref.ref[Optimizer]", "weakref.WeakSet[Optimizer]", int]] = None
        self._changes = 0
        self._written: set[int] = set()  # ids written by a backward pass since their optimizer's last step
        self._unseen: set[int] = set()  # ids written since the last evaluated step
        self._touched = False
        #: the ids of the hooked parameters, each mapped to None; `_fresh` holds those not written since `_flush`
        self._all: dict[int, None] = {}
        self._fresh: dict[int, None] = {}
        self._every: frozenset[int] = frozenset()  # the keys of `_all`
        self._hooks: dict[int, tuple["weakref.ref[torch.Tensor]", RemovableHandle]] = {}
        self._hook_params()

    # -- the writes ------------------------------------------------------------------------
    @property
    def touched(self) -> bool:
        """Set by every write; whoever wants to know whether a backward pass wrote this model clears it first."""
        self._flush()
        return self._touched

    @touched.setter
    def touched(self, value: bool) -> None:
        self._flush()  # the writes so far come before the clearing
        self._touched = value

    def reached(self) -> None:
        """A backward pass reached the model: `touched`, with or without a parameter written (no `_flush`
        needed: the writes not taken in yet would set it too)."""
        self._touched = True

    def _flush(self) -> None:
        """Take in the writes the hooks noted since the last call: the ids popped from `_fresh`."""
        fresh = self._fresh
        left = len(fresh)
        if left == len(self._all):
            return
        if left == 0:  # every hooked parameter written (the usual step): no set to build
            wrote: AbstractSet[int] = self._every
            fresh.update(self._all)
        else:
            wrote = self._all.keys() - fresh.keys()
            fresh.update(dict.fromkeys(wrote))  # not `_all`: a write landing meanwhile (another thread's) is kept
        self._written |= wrote
        self._unseen |= wrote
        self._touched = True

    def _hook_params(self) -> None:
        """A post-accumulate-grad hook on every parameter that requires grad and has none of ours yet.

        The hook is `functools.partial(self._fresh.pop, id(p))`: torch calls it with the
        parameter, which becomes `pop`'s default, so the call takes the id out of `_fresh`
        and holds nothing. It runs no Python frame (about a third of a Python hook's cost,
        and more in a step's cold caches), and it refers to no tensor and not to this
        object: a dropped model's parameters are freed as before (a hook that kept the
        tensor, `list.append`, would hold it from the C++ hook list, in a cycle gc cannot
        see). The second write to a parameter before `_flush` finds the id gone and returns
        the default, the parameter itself: torch's hook caller (`_call_hooks`) takes a hook
        returning its own argument as returning None.
        """
        self._flush()
        self._hooks = {key: known for key, known in self._hooks.items() if known[0]() is not None}
        for p in self._params():
            known = self._hooks.get(id(p))
            if p.requires_grad and p.is_leaf and (known is None or known[0]() is not p):
                key = id(p)  # one int object for the hook, `_hooks`, `_all` and `_fresh`: found by identity
                handle = p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    functools.partial(self._fresh.pop, key))
                self._hooks.pop(key, None)
                self._hooks[key] = (weakref.ref(p), handle)
        self._all.clear()
        self._all.update(dict.fromkeys(self._hooks))
        self._every = frozenset(self._all)
        self._fresh.clear()
        self._fresh.update(self._all)

    def remove(self) -> None:
        self._flush()
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._all.clear()
        self._every = frozenset()
        self._fresh.clear()

    def reset(self) -> None:
        """The model's parameters changed: hook the new ones, forget the parameter ids (the groups stay)."""
        self._ids = weakref.WeakKeyDictionary()
        self._last_ids = None
        self._left_out.clear()
        self._hook_params()

    # -- optimizer steps -------------------------------------------------------------------
    def param_ids(self, optimizer: Optimizer) -> frozenset[int]:
        """The ids of the parameters `optimizer` updates, recomputed when its param_groups changed."""
        signature = _signature(optimizer)
        last = self._last_ids
        if last is not None and last[0]() is optimizer and last[1] == signature:
            return last[2]
        cached = self._ids.get(optimizer)
        if cached is None or cached[0] != signature:
            cached = (signature, frozenset(id(p) for g in optimizer.param_groups for p in g["params"]))
            self._ids[optimizer] = cached
            self._hook_params()  # a parameter unfrozen since (requires_grad set) gets its hook now
        self._last_ids = (weakref.ref(optimizer), *cached)
        return cached[1]

    def begins(self, optimizer: Optimizer) -> Optional[bool]:
        """Whether `optimizer`'s step begins a step (True), belongs to the one evaluated last (False),
        or cannot be told from the writes (None); see the module docstring."""
        ids = self.param_ids(optimizer)
        self._flush()
        if not self._unseen.isdisjoint(ids):
            return True
        if not self._written.isdisjoint(ids):
            return False
        return None

    def several(self, optimizer: Optimizer) -> bool:
        """Whether optimizers other than `optimizer` were seen stepping this model."""
        return any(o is not optimizer for o in self._groups)

    def evaluating(self, optimizer: Optimizer) -> frozenset[int]:
        """A step is evaluated at `optimizer`'s step: the ids of parameters its rules leave out."""
        self._flush()
        self._unseen.clear()
        alone = self._alone
        if alone is not None and alone[0]() is optimizer and alone[2] == self._changes:
            self._current = alone[1]  # as found below at its last step: nothing was added to `_groups` since
            return frozenset()
        group = self._groups.get(optimizer)
        if group is not None and len(group) == 1 and len(self._groups) == 1:
            # the one optimizer seen, stepping alone (its group holds it): what the lines below give, without
            # iterating a WeakSet (a guarded Python iteration, the costliest part of a step's start)
            self._current = group
            self._alone = (weakref.ref(optimizer), group, self._changes)
            return frozenset()
        members = [optimizer] if group is None else list(group)
        if group is None or len(members) != 1:
            group = weakref.WeakSet([optimizer])
            self._groups[optimizer] = group
            self._changes += 1
        self._current = group
        if len(self._groups) == len(members):
            return frozenset()
        apart = [o for o in self._groups if o not in members]
        own = [self.param_ids(o) for o in members]
        others = [self.param_ids(o) for o in apart]
        key = (tuple(map(id, members)), tuple(map(id, apart)), *own, None, *others)  # the sets themselves: no id reuse
        cached = self._left_out.get(id(optimizer))
        if cached is None or cached[0] != key:
            cached = (key, frozenset().union(*others).difference(*own))
            self._left_out[id(optimizer)] = cached
        return cached[1]

    def continuing(self, optimizer: Optimizer) -> None:
        """`optimizer` steps in the step evaluated last (after the same backward pass)."""
        self._current.add(optimizer)
        self._groups[optimizer] = self._current
        self._changes += 1

    def used_up(self) -> None:
        """A step without an optimizer (one per backward pass) was evaluated: every write so far is its."""
        self._flush()
        self._written.clear()
        self._unseen.clear()

    def stepped(self, optimizer: Optimizer) -> None:
        """`optimizer` updated its parameters: what was written to them is used up."""
        ids = self.param_ids(optimizer)
        self._flush()
        self._written.difference_update(ids)
        self._unseen.difference_update(ids)
