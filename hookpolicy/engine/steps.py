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
- `skip_step` cannot stop `optimizer.step()` from running; it hides the gradients
  (`p.grad = None`, which every torch optimizer skips without touching its state) and
  puts them back in the post-hook.
- The root module carries two small hooks, installed here: the pre-hook decides the
  phase (train/eval) once per forward (`Phase`), the post-hook marks backward passes
  with a tensor hook on each output. Both skip a forward that activation checkpointing
  re-runs inside the backward pass (`recomputing()`). They go through `module_hooks`, so
  copies and saves of the model never carry them.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional, Protocol

import torch

from . import heap, module_hooks, optimizer_hooks
from .loss import LossTap
from .scopes import Scopes
from .structure import named_tensors

__all__ = ["Phase", "StepEvents", "StepTracker", "recomputing"]

log = logging.getLogger("hookpolicy")


class StepEvents(Protocol):
    """What a tracker calls back into (the runtime)."""

    def begin_step(self, left_out: frozenset[int] = frozenset()) -> bool:
        """Evaluate the step's rules before the update, leaving out the parameters with ids in `left_out`
        (another optimizer's, see `scopes`); True means skip this step."""

    def end_step(self) -> None:
        """The update happened (or was skipped): move to the next step."""

    def discard_step(self) -> None:
        """A step that no optimizer took (GradScaler found inf): forget its statistics."""

    def eval_forward_done(self) -> None:
        """A forward of the root outside training ended (an evaluation loop steps no optimizer)."""

    def training_forward(self) -> None:
        """A training forward of the root is about to run (its modules' hooks have not run yet)."""

    def unguardable(self, reason: str, refuse: bool) -> None:
        """Step rules cannot act as written on this model (`reason`); `refuse`: switch them off."""


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
    """Counts the steps of one model; see the module docstring for what a step is.

    Installs the root module's two hooks and subscribes to every optimizer step
    (`optimizer_hooks`); `remove()` takes both off. `phase` is written by the root's
    pre-hook and read by the hook bodies.
    """

    def __init__(self, model: torch.nn.Module, events: StepEvents, phase: Phase) -> None:
        self._events = events
        self.phase = phase
        self._param_ids = {id(p) for p in model.parameters()}
        self._model_params = weakref.ref(model)
        self._owned: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        self._scopes = Scopes(self._parameters)
        self.mode = "unknown"  # "optimizer" | "manual"
        self.backward_seq = 0
        self._evaluated_seq = -1
        self._in_backward = False
        self._skip = False
        self._stash: dict[int, tuple[list[Optional[torch.Tensor]], dict[Any, dict[str, Any]]]] = {}
        self._ending = False
        self._probe: Optional[torch.nn.Parameter] = None
        self._hooked_steps = 0  # step hook calls (before and after the update) for this model
        self._stepping = False  # between before_update and after_update: updates are the optimizer's
        self._last_backward: Optional[tuple[torch.nn.Parameter, int, int]] = None  # probe, its version, _hooked_steps
        self._reported: set[str] = set()
        #: where the model's training outputs and closure returns go when a loss rule exists (`target: loss`)
        self.loss_tap: Optional[LossTap] = None
        self._grad_before: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None  # (a parameter, its .grad)
        self._subscription = optimizer_hooks.subscribe(self, optimizer_hooks.STEP_TRACKING)
        self._root_handles = [
            module_hooks.forward_pre_hook(model, self._root_pre),
            module_hooks.forward_hook(model, self._root_post, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._root_handles:
            handle.remove()
        self._root_handles.clear()
        self._subscription.remove()

    def refresh(self) -> None:
        """The model's parameters changed (a module or parameter replaced): whose optimizer is whose anew."""
        self._param_ids = self._current_param_ids()
        self._owned = weakref.WeakKeyDictionary()
        self._scopes.reset()

    def _parameters(self) -> list[torch.nn.Parameter]:
        model = self._model_params()
        return [] if model is None else list(model.parameters())

    def _current_param_ids(self) -> set[int]:
        model = self._model_params()
        return self._param_ids if model is None else {id(p) for p in model.parameters()}

    # -- the root's forward ------------------------------------------------------------
    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        phase = self.phase
        phase.depth += 1
        if phase.depth > 1 or recomputing():
            return
        phase.train = module.training and torch.is_grad_enabled()
        if phase.train:
            self.check_forward()
            self._events.training_forward()

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        phase = self.phase
        phase.depth = max(0, phase.depth - 1)
        if phase.depth or recomputing():
            return
        if not phase.train:
            self._events.eval_forward_done()
        elif torch.is_grad_enabled():
            if self.loss_tap is not None:
                self.loss_tap.model_output(output)
            for _, t in named_tensors(output, lambda name: True):
                if t.requires_grad:
                    t.register_hook(self.output_grad_hook)  # type: ignore[no-untyped-call]

    # -- backward passes ---------------------------------------------------------------
    def output_grad_hook(self, grad: torch.Tensor) -> None:
        """Registered on the root's outputs: the first one to fire marks a backward pass."""
        if not self._in_backward:
            self._in_backward = True
            self.backward_seq += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
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
            if self._events.begin_step():
                self._zero_grads()
            self._events.end_step()

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
                     "on, evaluated when it ends (before such an update)", refuse=False)

    def _report(self, reason: str, refuse: bool) -> None:
        if reason not in self._reported:
            self._reported.add(reason)
            self._events.unguardable(reason, refuse)

    def _optimizer_exists(self) -> bool:
        """Whether some optimizer holds this model's parameters (a one-time scan of the heap)."""
        return any(self._owns(o) for o in heap.live_optimizers())

    def _zero_grads(self) -> None:
        model = self._model_params()
        if model is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()

    def check_forward(self) -> None:
        """Called at each training forward of the root: drop a step GradScaler skipped."""
        if (self.mode == "optimizer" and self.backward_seq > self._evaluated_seq
                and self._probe is not None and self._probe.grad is None and not self._in_backward):
            self._evaluated_seq = self.backward_seq
            self._events.discard_step()

    # -- optimizer steps ---------------------------------------------------------------
    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        owned = self._owned.get(optimizer)
        if owned is None:
            owned = any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])
            if not owned:  # the model may hold new parameter objects since (`model.to()` can make them)
                self._param_ids = self._current_param_ids()
                owned = any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])
            self._owned[optimizer] = owned
        return owned

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer_hooks` subscriber: evaluate the step at its first optimizer step."""
        if not self._owns(optimizer):
            return
        if self.mode != "optimizer":
            if self.mode == "manual":
                log.info("an optimizer now steps this model: counting optimizer steps from here on")
            self.mode = "optimizer"
        self._hooked_steps += 1
        self._stepping = True
        if torch._C._current_graph_task_id() != -1:
            self._report(f"{type(optimizer).__name__} steps inside the backward pass (an optimizer in backward), "
                         "before the step's gradients are final", refuse=True)
        if self.backward_seq == 0 or self.backward_seq != self._evaluated_seq or self._scopes.rewritten(optimizer):
            if self.backward_seq > 0 and not any(
                    p.grad is not None for g in optimizer.param_groups for p in g["params"] if id(p) in self._param_ids):
                self._report(f"{type(optimizer).__name__} steps its parameters after a backward pass, but none of "
                             "them has a .grad (a wrapper keeps the gradients elsewhere)", refuse=True)
            self._evaluated_seq = self.backward_seq
            self._ending = True
            self._skip = False
            self._skip = self._events.begin_step(self._scopes.evaluating(optimizer))
            self._scopes.mark(optimizer)
        else:
            self._scopes.continuing(optimizer)
        if self._skip:
            self._hide_grads(optimizer)

    def closure_starting(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer_hooks` subscriber: note a gradient before the step's closure runs (for `closure_returned`)."""
        self._grad_before = None
        if self.loss_tap is not None and self.loss_tap.active and self._owns(optimizer):
            param = next((p for g in optimizer.param_groups for p in g["params"] if id(p) in self._param_ids), None)
            if param is not None:
                self._grad_before = (param, param.grad)

    def closure_returned(self, optimizer: torch.optim.Optimizer, loss: Any) -> None:
        """`optimizer_hooks` subscriber: the first closure call of a step returned `loss`.

        A closure that added its gradients to ones already there (the same `.grad` tensor
        before and after it) ran after micro-batches accumulated outside `step()`, whose
        losses it does not return: the tap says so once.
        """
        if self.loss_tap is not None and self._owns(optimizer):
            before, self._grad_before = self._grad_before, None
            accumulated = before is not None and before[1] is not None and before[0].grad is before[1]
            self.loss_tap.closure_loss(loss, accumulated)

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer_hooks` subscriber: put hidden gradients and the optimizer's state back, end the step."""
        if not self._owns(optimizer):
            return
        self._stepping = False
        self._hooked_steps += 1  # an update that ended after the last backward pass is an optimizer's too
        stash = self._stash.pop(id(optimizer), None)
        if stash is not None:
            grads, state = stash
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for p, grad in zip(params, grads):
                p.grad = grad
            for p in [p for p in optimizer.state if p not in state]:
                del optimizer.state[p]
            optimizer.state.update(state)
        if self._ending:
            self._ending = False
            self._events.end_step()

    def _hide_grads(self, optimizer: torch.optim.Optimizer) -> None:
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
