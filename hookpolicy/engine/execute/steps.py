"""Where steps begin and end: optimizer step hooks, backward passes, and skipped steps.

A *step* is one `torch.optim` optimizer `step()` over the attached model's parameters.
Several optimizers stepping the same model after one backward pass (one per parameter
group, say) make one step, not several: a step is evaluated at the first optimizer step
after a backward pass. Optimizers that step in turn, each after its own backward pass (a
GAN), make one step each, and each step's rules see only the parameters it updates
(`scopes`). A script that steps no optimizer (manual SGD) gets one step per backward
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
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Optional

import torch

from ... import process
from ..hooks import heap
from ..measure.rulestate import RuleState, refuse
from .scopes import Scopes

__all__ = ["HiddenGrads", "Phase", "StepTracker", "recomputing"]

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
        # not a method of this tracker: each parameter's hook holds the scopes, and a tracker
        # (holding a parameter as its probe) reachable from it would keep a dropped model's
        # parameters alive, in a cycle through PyTorch's C++ hook list that gc cannot see
        self._scopes = Scopes(functools.partial(_parameters_of, self._model_params))
        self.mode = "unknown"  # "optimizer" | "manual"
        self.backward_seq = 0
        self._evaluated_seq = -1
        self._in_backward = False
        #: the step being evaluated is skipped: its optimizers' updates get no gradients
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
        """Take the parameters' hooks off (`scopes`)."""
        self._scopes.remove()

    def refresh(self) -> None:
        """The model's parameters changed (a module or parameter replaced): whose optimizer is whose anew."""
        self._param_ids = self._current_param_ids()
        self._owned = weakref.WeakKeyDictionary()
        self._scopes.reset()

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
        self._scopes.touched = True  # a backward call reached the model (`loss`), also where no parameter hook fires
        if self._in_backward:
            return False
        self._in_backward = True
        self.backward_seq += 1
        return True

    def backward_done(self) -> bool:
        """A backward pass ended; True when no optimizer steps this model, so this backward pass is a step."""
        self._in_backward = False
        model = self._model_params()
        if model is not None:
            self._probe = next((p for p in model.parameters() if p.grad is not None), None)
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
        owned = self._owned.get(optimizer)
        if owned is None:
            owned = any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])
            if not owned:  # the model may hold new parameter objects since (`model.to()` can make them)
                self._param_ids = self._current_param_ids()
                owned = any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])
            self._owned[optimizer] = owned
        return owned

    def update_starts(self, optimizer: torch.optim.Optimizer) -> Optional[frozenset[int]]:
        """Before this model's `optimizer` updates: the ids of the parameters to leave out of a step to
        evaluate now (another optimizer's, see `scopes`), or None when the update continues a step evaluated."""
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
        grads = any(p.grad is not None for g in optimizer.param_groups for p in g["params"] if id(p) in self._param_ids)
        name = type(optimizer).__name__
        if self.backward_seq > 0 and not grads:
            self._report(f"{name} steps its parameters after a backward pass, but none of "
                         "them has a .grad (a wrapper keeps the gradients elsewhere)", refused=True)
        elif unwritten and grads and self._scopes.several(optimizer):
            self._report(f"{name} steps gradients that no backward pass wrote through autograd's accumulation "
                         "(assigned by the script, or sharded by FSDP2), while other optimizers step this model "
                         "too: which step they belong to and which parameters it updates cannot be told",
                         refused=True)

    def evaluated(self, optimizer: torch.optim.Optimizer, skip: bool) -> None:
        """The step `optimizer` began was evaluated: `skip` it or not."""
        self.skipping = skip

    def update_ends(self, optimizer: torch.optim.Optimizer) -> bool:
        """After `optimizer`'s update: True when the step ends."""
        if not self.owns(optimizer):
            return False
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
