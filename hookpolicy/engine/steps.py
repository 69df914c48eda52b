"""Where steps begin and end: optimizer step hooks, backward passes, and skipped steps.

A *step* is one `torch.optim` optimizer `step()` over the attached model's parameters.
Several optimizers stepping the same model after one backward pass (one per parameter
group, say) make one step, not several: a step is evaluated at the first optimizer step
after a backward pass. A script that steps no optimizer (manual SGD) gets one step per
backward pass, evaluated when the backward pass has finished.

Traps this module handles:
- `GradScaler.step` calls `optimizer.step()` only when the gradients are finite, after
  unscaling them; so the pre-hook sees unscaled gradients and a skipped step is never
  evaluated. Its forward/backward statistics are dropped when the next forward finds the
  gradients reset (`zero_grad()`), so an overflow step raises no false alert.
- `skip_step` cannot stop `optimizer.step()` from running; it hides the gradients
  (`p.grad = None`, which every torch optimizer skips without touching its state) and
  puts them back in the post-hook.
"""

from __future__ import annotations

import gc
import logging
import sys
import weakref
from types import FrameType
from typing import Any, Optional, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["StepTracker", "StepEvents"]

log = logging.getLogger("hookpolicy")


class StepEvents(Protocol):
    """What a tracker calls back into (the runtime)."""

    def begin_step(self) -> bool:
        """Evaluate the step's rules before the update; True means skip this step."""

    def end_step(self) -> None:
        """The update happened (or was skipped): move to the next step."""

    def discard_step(self) -> None:
        """A step that no optimizer took (GradScaler found inf): forget its statistics."""


class StepTracker:
    """Counts the steps of one model; see the module docstring for what a step is."""

    def __init__(self, model: torch.nn.Module, events: StepEvents) -> None:
        self._events = events
        self._param_ids = {id(p) for p in model.parameters()}
        self._model_params = weakref.ref(model)
        self._owned: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        self.mode = "unknown"  # "optimizer" | "manual"
        self.backward_seq = 0
        self._evaluated_seq = -1
        self._in_backward = False
        self._skip = False
        self._stash: dict[int, list[Optional[torch.Tensor]]] = {}
        self._ending = False
        self._probe: Optional[torch.nn.Parameter] = None
        _DISPATCH.add(self)

    def remove(self) -> None:
        _DISPATCH.discard(self)

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
        if self.mode == "unknown":
            self.mode = "optimizer" if self._optimizer_exists() else "manual"
            log.debug("step mode: %s", self.mode)
        if self.mode == "manual":
            self._evaluated_seq = self.backward_seq
            if self._events.begin_step():
                self._zero_grads()
            self._events.end_step()

    def _optimizer_exists(self) -> bool:
        """Whether some optimizer holds this model's parameters (a one-time scan of the heap)."""
        return any(issubclass(type(o), torch.optim.Optimizer) and self._owns(o) for o in gc.get_objects())

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
            self._owned[optimizer] = owned
        return owned

    def pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._owns(optimizer):
            return
        if self.mode != "optimizer":
            if self.mode == "manual":
                log.info("an optimizer now steps this model: counting optimizer steps from here on")
            self.mode = "optimizer"
        if self.backward_seq == 0 or self.backward_seq != self._evaluated_seq:
            self._evaluated_seq = self.backward_seq
            self._ending = True
            self._skip = False
            self._skip = self._events.begin_step()
        if self._skip:
            self._hide_grads(optimizer)

    def post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._owns(optimizer):
            return
        stash = self._stash.pop(id(optimizer), None)
        if stash is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for p, grad in zip(params, stash):
                p.grad = grad
        if self._ending:
            self._ending = False
            self._events.end_step()

    def _hide_grads(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._stash[id(optimizer)] = [p.grad for p in params]
        for p in params:
            p.grad = None


class _Dispatch:
    """One pair of global optimizer step hooks for the process, calling every live tracker.

    PyTorch iterates its global hook dicts while it calls them, so removing a handle
    from inside an optimizer step (a `remove()` called from a hook, or a halt) would raise
    `OrderedDict mutated during iteration`. Trackers come and go from this list instead;
    the global hooks are unregistered when the last tracker leaves outside an optimizer
    step, else (they do nothing meanwhile) at the next `add`/`discard` outside one.
    """

    def __init__(self) -> None:
        self._trackers: list[StepTracker] = []
        self._handles: list[RemovableHandle] = []

    def add(self, tracker: StepTracker) -> None:
        self._trackers.append(tracker)
        if not self._handles:
            self._handles = [register_optimizer_step_pre_hook(self._pre),
                             register_optimizer_step_post_hook(self._post)]

    def discard(self, tracker: StepTracker) -> None:
        if tracker in self._trackers:
            self._trackers.remove(tracker)
        if not self._trackers and self._handles and not _inside_optimizer_step():
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for tracker in list(self._trackers):
            if tracker in self._trackers:
                tracker.pre(optimizer, args, kwargs)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for tracker in list(self._trackers):
            if tracker in self._trackers:
                tracker.post(optimizer, args, kwargs)


#: The code of the wrapper PyTorch puts around every `Optimizer.step`, which calls the hooks.
_STEP_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__


def _inside_optimizer_step() -> bool:
    """Whether some thread is inside an optimizer step (iterating the global hook dicts)."""
    for top in sys._current_frames().values():
        frame: Optional[FrameType] = top
        while frame is not None:
            if frame.f_code is _STEP_WRAPPER:
                return True
            frame = frame.f_back
    return False


_DISPATCH = _Dispatch()
