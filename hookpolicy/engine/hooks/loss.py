"""`target: loss`: the loss a script backpropagates into the governed model, one value per backward root.

The loss is what reaches the weights: the tensor(s) on which the script runs backward
during the step, whatever it did after its criterion (a `/ accum`, a regulariser added,
a NaN multiplied in). Every `Tensor.backward(...)` and `torch.autograd.backward(...)` of
the process goes through `torch.autograd.backward` (`Tensor.backward` calls it by that
name), so while a loss rule is attached that one function is wrapped (`_Roots`, the one
owner of the patch, a `process.Shared`): for each call that is not nested in another
backward pass (reentrant activation checkpointing backpropagates inside one), the value
of each root is taken before the call, detached on its device (no graph kept, no host
sync), and after it the value goes to every governed model whose parameters that call
wrote (their post-accumulate-grad hooks fired, `steps.Scopes.touched`) or whose root
output it reached (the model's own backward marker, for stacks that write gradients
themselves). A backward call whose gradients go elsewhere (another model, a
discriminator's own pass) is not this model's loss.

The value of a root `r`: `r` itself for a scalar root with no explicit gradient (the
usual `loss.backward()`); `(r * g).sum()` when the call passes a gradient `g` (the scalar
whose gradient the call backpropagates); divided by a GradScaler's scale when the root
is `scaler.scale(loss)` (`torch.amp.GradScaler.scale` is wrapped by the same owner to
note the scale tensor it multiplied by; the scale is a power of two, so the division
gives the loss back exactly unless `loss * scale` overflowed).

At the step the values are stacked into one vector, the rule's tensor, one element per
root of the step: the optimizer applies the gradient of their **sum** (the gradients of
the step's backward calls accumulate), so `mean * numel` is the step's loss, `mean` the
average root (with `(loss / N).backward()` over N micro-batches: the average micro-batch
loss divided by N), `max` the worst root, `nonfinite` how many carried NaN or Inf and
`numel` how many roots the step had. Roots recorded after the step was evaluated (LBFGS's
later closure calls inside the same `step()`) belong to no step and are dropped.

`torch.autograd.grad` is not a root: it writes no `.grad` (the optimizer applies
`.grad`), and scripts call it for parts of a loss (a gradient penalty). A step on which a
loss rule is active and no root reached the model says so once (`LossTap.take`) and the
rule evaluates nothing: never a silent no-op.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch.amp.grad_scaler import GradScaler
from torch.autograd.graph import GradientEdge

from ... import process
from ...errors import Halt
from .contain import Part, fault_of

__all__ = ["LossTap", "Reached"]

log = logging.getLogger("hookpolicy")


class Reached(Protocol):
    """What tells a tap whether a backward call reached its model (`steps.Scopes`)."""

    touched: bool


class LossTap:
    """The backward roots that reached one governed model during the step; `take()` stacks them.

    `active` is set at each step boundary (`set_active`: a loss rule is evaluated on this
    step); while it is off no root is kept for this model.
    """

    def __init__(self, model: str, reached: Reached) -> None:
        self.model = model
        self._reached = reached
        self._values: list[torch.Tensor] = []
        self._pending: Optional[list[torch.Tensor]] = None  # the roots of the backward call in progress
        self._taken = False  # the step was evaluated: roots from here on belong to no step
        self.active = False
        self._joined = False
        self._said_none = process.Once()  # "no loss seen", said once per tap
        #: where a fault of hookpolicy's part of the patches goes: the loss rules' containment (`contain.Owner`)
        self.owner: object = None

    def set_active(self, active: bool) -> None:
        """At a step boundary (or a re-plan): whether a loss rule is evaluated on this step."""
        if self._taken:  # the step ended: what came after its evaluation is no step's
            self._taken = False
            self._values.clear()
        if active and not self._joined:
            _ROOTS.join(self)
            self._joined = True  # once joined: `remove()` leaves only what was joined
        self.active = active

    def fault(self, where: str, exc: Exception) -> None:
        """A fault of hookpolicy's part of a patch, done for this tap: its loss rules' (`contain.Owner`)."""
        fault_of(self.owner, where, exc, _PART)

    # -- called by the owner of the patch, around one backward call ------------------------
    def backward_starts(self, values: list[torch.Tensor]) -> None:
        self._pending = values
        self._reached.touched = False

    def backward_ends(self, completed: bool) -> None:
        if completed:
            self._settle()
        self._pending = None

    def _settle(self) -> None:
        """The backward call in progress reached the model: its roots are the step's."""
        if self._pending is not None and self._reached.touched:
            self._values.extend(self._pending)
            self._pending = None

    # -- the step --------------------------------------------------------------------------
    def clear(self) -> None:
        """A step no optimizer took (GradScaler found inf): its roots go with it."""
        self._values.clear()

    def take(self, step: int, rules: Sequence[str]) -> Optional[torch.Tensor]:
        """The step's roots as one vector, or None (said once) when none reached the model.

        `rules` names the loss rules evaluated on this step (`policy/rule`), for the line.
        A step evaluated when its backward pass ends (no optimizer) is evaluated inside
        that call: its roots count if the call has written the model by then.
        """
        self._settle()
        values, self._values = self._values, []
        self._taken = True
        vector = None
        if values:
            dtype = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
            vector = torch.stack([v.to(dtype) for v in values])
        if vector is None and rules:
            self.missing(step, rules)
        return vector

    def missing(self, step: int, rules: Sequence[str], job: bool = False) -> None:
        """Say (once per tap) that no loss was seen at `step` (on any rank of the process group: `job`)."""
        if not self._said_none():
            return
        where = "no rank of the process group saw one" if job else "no backward pass reached its parameters"
        log.warning("%s: no loss seen at step %d of %s: %s during the step. target: loss is the tensor the script "
                    "calls backward() on (loss.backward(), torch.autograd.backward); gradients computed with "
                    "torch.autograd.grad and assigned to .grad have no such root. Until one is seen the rule "
                    "evaluates nothing", ", ".join(rules), step, self.model, where)

    def remove(self) -> None:
        self.active = False
        self._values.clear()
        self._pending = None
        if self._joined:
            self._joined = False
            _ROOTS.leave(self)


class _Roots:
    """The one owner of the wrapped `torch.autograd.backward` and `GradScaler.scale`, and of the taps they feed.

    The wrappers are put in place when the first tap joins and taken out when the last
    one leaves (`process.Shared`); one that another library wrapped again in the meantime
    is left where it is, calling straight through. `GradScaler.scale` is wrapped on
    `torch.amp.GradScaler` and on each subclass imported by then that defines its own
    (`ShardedGradScaler`).
    """

    def __init__(self) -> None:
        self._taps: tuple[LossTap, ...] = ()
        self._local = threading.local()  # depth: a call inside one of ours (a tensor subclass dispatching again)
        self._scaled: dict[int, tuple["weakref.ref[torch.Tensor]", torch.Tensor]] = {}
        self._backward: Optional[Callable[..., Any]] = None
        self._scales: list[tuple[type, Callable[..., Any], Callable[..., Any]]] = []  # (class, its scale, ours)
        self._shared = process.Shared("torch.autograd.backward and GradScaler.scale (target: loss)",
                                      self._install, self._uninstall)

    def join(self, tap: LossTap) -> None:
        self._shared.acquire()  # first: a tap is fed only once the patches are in
        self._taps = (*self._taps, tap)

    def leave(self, tap: LossTap) -> None:
        self._taps = tuple(t for t in self._taps if t is not tap)
        self._shared.release()

    def _install(self) -> None:
        """Both patches, or (where one fails) neither: a wrapper left in would be wrapped again by the next
        `_install`, and call itself."""
        try:
            self._backward = torch.autograd.backward
            setattr(torch.autograd, "backward", self._wrapped_backward)
            classes, found = [GradScaler], [GradScaler]
            while found:
                found = [sub for cls in found for sub in cls.__subclasses__()]
                classes += [cls for cls in found if "scale" in cls.__dict__]
            for cls in classes:
                self._scales.append((cls, cls.__dict__["scale"], self._scale_of(cls.__dict__["scale"])))
                setattr(cls, "scale", self._scales[-1][2])
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        if torch.autograd.backward == self._wrapped_backward:
            setattr(torch.autograd, "backward", self._backward)
        for cls, theirs, ours in self._scales:
            if cls.__dict__.get("scale") is ours:
                setattr(cls, "scale", theirs)
        self._scales.clear()
        self._scaled.clear()

    def _scale_of(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """A class's `scale(self, outputs)` that notes the scale tensor each returned tensor was multiplied by."""
        def scale(scaler: GradScaler, outputs: Any) -> Any:
            scaled = original(scaler, outputs)
            taps = self._active()
            if not taps:  # no loss rule is evaluated on this step: nothing to note
                return scaled
            try:  # a disabled scaler (nanoGPT's on a CPU or a bf16 GPU) has no _scale: it returned outputs as they are
                factor = getattr(scaler, "_scale", None)
                if getattr(scaler, "_enabled", False) and isinstance(factor, torch.Tensor):
                    for t in _tensors(scaled):
                        self._remember(t, factor)
            except Exception as exc:  # noqa: BLE001 - hookpolicy's part of the patch: contained
                self._failed(taps, "GradScaler.scale", exc)
            return scaled
        return scale

    # -- the wrappers ----------------------------------------------------------------------
    def _wrapped_backward(self, tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
        """torch.autograd.backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, ...).

        The original is called exactly as the script called it; what hookpolicy does around
        it (the roots' values before, the taps told after) is contained (`contain`): a
        fault of it goes to the taps' loss rules, and a `Halt` it makes is raised after the
        original returned.
        """
        original = self._backward
        assert original is not None
        depth = getattr(self._local, "depth", 0)
        taps: list[LossTap] = []
        halt: Optional[Halt] = None
        try:
            active = self._active()
            if active and not depth and torch._C._current_graph_task_id() == -1:
                taps = active
                values = self._values(tensors, kwargs.get("grad_variables", grad_tensors))
                for tap in taps:
                    tap.backward_starts(values)
        except Exception as exc:  # noqa: BLE001 - hookpolicy's part of the patch: contained
            halt = self._failed(taps, "torch.autograd.backward (before the call)", exc, hold=True)
            taps = []
        if not taps:
            result = original(tensors, grad_tensors, *args, **kwargs)
            if halt is not None:
                raise halt
            return result
        self._local.depth = depth + 1
        completed = False
        try:
            result = original(tensors, grad_tensors, *args, **kwargs)
            completed = True
        finally:
            self._local.depth = depth
            for tap in taps:
                try:
                    tap.backward_ends(completed)
                except Exception as exc:  # noqa: BLE001 - hookpolicy's part of the patch: contained
                    halt = halt or self._failed([tap], "torch.autograd.backward (after the call)", exc, hold=True)
        if halt is not None:
            raise halt
        return result

    def _active(self) -> list[LossTap]:
        return [tap for tap in self._taps if tap.active] if not _PART.off else []

    def _failed(self, taps: Sequence[LossTap], where: str, exc: Exception, hold: bool = False) -> Optional[Halt]:
        """Hand a fault of hookpolicy's part to each tap's loss rules (or `_PART`); a `Halt` is returned with `hold`."""
        if not taps:
            _PART.failed(exc)
        for tap in taps:
            try:
                tap.fault(where, exc)
            except Halt as halt:
                if not hold:
                    raise
                return halt
        return None

    def _remember(self, t: torch.Tensor, factor: torch.Tensor) -> None:
        if len(self._scaled) > 64:  # scaled outputs never backpropagated: forget the dead ones
            self._scaled = {k: v for k, v in self._scaled.items() if v[0]() is not None}
        self._scaled[id(t)] = (weakref.ref(t), factor)

    def _values(self, tensors: Any, grads: Any) -> list[torch.Tensor]:
        """Each root's value (see the module docstring), detached, on its device."""
        roots = (tensors,) if isinstance(tensors, (torch.Tensor, GradientEdge)) else tuple(tensors)
        if grads is None:
            grads = (None,) * len(roots)
        elif isinstance(grads, torch.Tensor):
            grads = (grads,)
        values = []
        for root, grad in zip(roots, tuple(grads)):
            if not isinstance(root, torch.Tensor) or not root.is_floating_point():
                continue  # a GradientEdge has no value
            value = root.detach()
            if isinstance(grad, torch.Tensor):
                value = (value * grad.detach()).sum()
            elif value.dim():
                if value.numel() != 1:
                    continue  # backward() itself refuses a non-scalar root without a gradient
                value = value.reshape(())
            scaled = self._scaled.pop(id(root), None) if self._scaled else None
            if scaled is not None and scaled[0]() is root:
                value = value / scaled[1].to(value.device)
            values.append(value)
        return values


def _tensors(scaled: Any) -> list[torch.Tensor]:
    """The tensors `GradScaler.scale` returned (a tensor, or a list or tuple of them; a lazy `map` is not looked at)."""
    items = [scaled] if isinstance(scaled, torch.Tensor) else list(scaled) if isinstance(scaled, (list, tuple)) else []
    return [t for t in items if isinstance(t, torch.Tensor)]


#: the patches' own part where no tap owns the fault
_PART = Part("the loss tap's part of torch.autograd.backward and GradScaler.scale (target: loss)")
_ROOTS = _Roots()
