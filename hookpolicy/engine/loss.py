"""`target: loss`: the loss a script backpropagates, one value per micro-batch, stacked at the step.

The loss is not a tensor of the governed model, so it is looked for where a training
script hands it over, from three sources, preferred in this order at each step:

1. an optimizer closure's return value (`optimizer.step(closure)`, Lightning's automatic
   optimization; the first call of the step, as the step rules see it);
2. the governed model's own output at a training forward: `ModelOutput.loss` / a `loss`
   key, a 0-dim floating tensor returned alone, or the first one in a returned tuple or
   list (nanoGPT's `(logits, loss)`);
3. the outputs of loss modules (`torch.nn.modules.loss._Loss` subclasses such as
   `nn.CrossEntropyLoss()`) called through `__call__` with grad mode on, which a script
   usually holds outside the model.

Every value is detached (no graph kept, no host sync) and kept on its device; at the
step the values of the most preferred source that saw any are stacked into one vector,
the rule's tensor: `mean` is the step's average loss, `max` the worst micro-batch,
`numel` the number of micro-batches. A step on which no source saw a loss evaluates
nothing and says so once (`LossTap.take`): never a silent no-op.

Loss modules are found without a process-wide hook on every call: `LossModules` watches
all module calls (PyTorch's global forward hook, 1-4 us a call) only during the first
step a loss rule is active, and hooks the loss modules it meets one by one; when that
step ends the global hook comes off and only those instances carry a hook, and only
while a loss rule is active. A loss module first called later is not seen. A script that builds its
criterion anew at each call (`nn.MSELoss()(out, y)`) is recognised when that instance is
garbage-collected, and keeps the global hook while a loss rule is active.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import torch
from torch.nn.modules.loss import _Loss
from torch.utils.hooks import RemovableHandle

from . import module_hooks
from ..plan.planner import LOSS_SOURCES

__all__ = ["LossModules", "LossTap", "loss_in_output"]

log = logging.getLogger("hookpolicy")


def loss_in_output(output: Any) -> Optional[torch.Tensor]:
    """The loss a model's forward returned, if it returned one (see the module docstring)."""
    if isinstance(output, torch.Tensor):
        return output if _scalar(output) else None
    if isinstance(output, Mapping):
        found = output.get("loss")
        return found if isinstance(found, torch.Tensor) and _scalar(found) else None
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor) and _scalar(t)), None)
    found = getattr(output, "loss", None)
    return found if isinstance(found, torch.Tensor) and _scalar(found) else None


def _scalar(t: torch.Tensor) -> bool:
    return t.dim() == 0 and t.is_floating_point()


class LossTap:
    """The losses one governed model's step handed over, per source; `take()` stacks them at the step.

    `active` is set by the runtime at each step boundary (a loss rule is evaluated on this
    step); while it is off nothing is collected and no loss module is watched for it.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self._sources: tuple[list[torch.Tensor], ...] = ([], [], [])
        self.active = False
        self._searched = False  # a step with this tap active has ended: its loss modules are known
        self.fleeting = False  # a loss module met while it was joined was collected: its script makes them anew
        self._warned = False
        self._warned_partial = False

    def set_active(self, active: bool) -> None:
        if active != self.active:
            self.active = active
            if active:
                _MODULES.join(self, search=not self._searched)
            else:
                _MODULES.leave(self)

    def closure_loss(self, loss: Any, accumulated: bool = False) -> None:
        """What the step's closure returned; `accumulated`: its gradients were added to earlier micro-batches'."""
        if self.active and isinstance(loss, torch.Tensor) and _scalar(loss):
            self._sources[0].append(loss.detach())
            if accumulated and not self._warned_partial:
                self._warned_partial = True
                log.warning("%s: the closure passed to optimizer.step() added its gradients to ones already there "
                            "(micro-batches accumulated outside step(), as with Lightning's accumulate_grad_batches, "
                            "or a zero_grad(set_to_none=False)): target: loss is what the closure returned, "
                            "one value a step, not the earlier micro-batches' losses (Lightning: the last "
                            "micro-batch's loss divided by accumulate_grad_batches)", self.model)

    def model_output(self, output: Any) -> None:
        if self.active:
            found = loss_in_output(output)
            if found is not None:
                self._sources[1].append(found.detach())

    def module_loss(self, loss: torch.Tensor) -> None:
        self._sources[2].append(loss.detach())

    def clear(self) -> None:
        for source in self._sources:
            source.clear()

    def take(self, step: int, rules: Sequence[str]) -> Optional[torch.Tensor]:
        """The step's losses as one vector from the preferred source, or None (said once) when none was seen.

        `rules` names the loss rules evaluated on this step (`policy/rule`), for the warning.
        """
        values = next((source for source in self._sources if source), None)
        vector = None
        if values is not None:
            dtype = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
            vector = torch.stack([v.to(dtype) for v in values])
        self.clear()
        if self.active:
            self._searched = True
            _MODULES.searched(self)
        if vector is None and rules and not self._warned:
            self._warned = True
            log.warning("%s: no loss seen at step %d of %s; looked for: %s. A loss computed by a function "
                        "outside these (F.cross_entropy(...) in the script) cannot be seen: call a loss module "
                        "(nn.CrossEntropyLoss()(logits, y)), return the loss from forward, or pass a closure to "
                        "optimizer.step(); until then the rule evaluates nothing",
                        ", ".join(rules), step, self.model, "; ".join(LOSS_SOURCES))
        return vector

    def remove(self) -> None:
        self.set_active(False)
        self.clear()


class LossModules:
    """The one watcher of loss modules for every `LossTap` of the process (see the module docstring)."""

    def __init__(self) -> None:
        self._taps: list[LossTap] = []
        self._searching: set[int] = set()  # ids of joined taps whose first active step has not ended
        self._known: "weakref.WeakKeyDictionary[_Loss, _Hooked]" = weakref.WeakKeyDictionary()
        self._global: Optional[RemovableHandle] = None
        self._said_shared = False  # a loss module's value went to several models (said once a process)

    @property
    def watching_every_call(self) -> bool:
        return self._global is not None

    def join(self, tap: LossTap, search: bool) -> None:
        if tap not in self._taps:
            self._taps.append(tap)
        if search:
            self._searching.add(id(tap))
        self._sync()

    def leave(self, tap: LossTap) -> None:
        if tap in self._taps:
            self._taps.remove(tap)
        self._searching.discard(id(tap))
        self._sync()

    def searched(self, tap: LossTap) -> None:
        """`tap`'s first active step ended: the loss modules of its script have been met."""
        if id(tap) in self._searching:
            self._searching.discard(id(tap))
            self._sync()

    def _sync(self) -> None:
        """Hooks for exactly what is needed now: per-instance hooks while a tap is joined, the global one while searching."""
        wanted = bool(self._taps)
        for module, hooked in list(self._known.items()):
            if wanted and hooked.handle is None:
                hooked.handle = module_hooks.forward_hook(module, self._called)
            elif not wanted:
                hooked.remove()
        every_call = bool(self._searching) or any(tap.fleeting for tap in self._taps)
        if every_call and self._global is None:
            self._global = module_hooks.global_forward_hook(self._any_call)
        elif not every_call and self._global is not None:
            self._global.remove()
            self._global = None

    def _any_call(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """hook(module, args, output) -> None, on every module call of the process while searching."""
        if not isinstance(module, _Loss) or module in self._known:
            return
        hooked = self._known[module] = _Hooked(module_hooks.forward_hook(module, self._called))
        finders = [weakref.ref(tap) for tap in self._taps if id(tap) in self._searching]
        weakref.finalize(module, self._collected, finders, hooked)
        self._called(module, args, output)  # its own hook joins the next call, not this one

    def _called(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """hook(module, args, output) -> None, on each call of a known loss module."""
        if isinstance(output, torch.Tensor) and _scalar(output) and output.requires_grad and torch.is_grad_enabled():
            for tap in self._taps:
                tap.module_loss(output)
            if len(self._taps) > 1 and not self._said_shared:
                self._said_shared = True
                log.warning("a %s's loss goes to every governed model with a loss rule active (%s): hookpolicy "
                            "cannot tell whose loss it is; return each model's loss from its forward to keep them "
                            "apart", type(module).__name__, ", ".join(tap.model for tap in self._taps))

    def _collected(self, finders: list["weakref.ref[LossTap]"], hooked: "_Hooked") -> None:
        """A loss module is gone: the taps that found it have a script that makes a new one per call.

        Its hook's handle is let go too, or `module_hooks` would keep its id (and the reduce
        filter) for ever, one id per criterion a script builds.
        """
        hooked.remove()
        fresh = [tap for tap in (ref() for ref in finders) if tap is not None and not tap.fleeting]
        for tap in fresh:
            tap.fleeting = True
        if any(tap in self._taps for tap in fresh):
            self._sync()


class _Hooked:
    """The handle of a known loss module's own hook, while it has one."""

    __slots__ = ("handle",)

    def __init__(self, handle: Optional[module_hooks.OwnHandle]) -> None:
        self.handle = handle

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


_MODULES = LossModules()
