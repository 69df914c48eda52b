"""The one owner of PyTorch's process-wide optimizer step hooks.

`torch.optim.optimizer.register_optimizer_step_pre_hook` / `..._post_hook` are global
state of the process. hookpolicy registers them here and nowhere else, and calls its
subscribers in an explicit order: by `priority` (lower first), then by subscription
order. The priorities in use:

- `DISCOVERY` (0): `hookpolicy apply`'s model discovery. It sees a step first, so that at
  a step's end it reads a governed model's step counter before step tracking moves it.
- `STEP_TRACKING` (10): each attached model's step cycle (`cycle.StepCycle`), which runs the step rules
  and the read-back before the update and counts the step after it.

The subscriber contract, as a literal signature:

    subscriber.before_update(optimizer) -> None   # the step's gradients are final
    subscriber.after_update(optimizer) -> None    # the update happened (or was skipped)

`before_update` is called when the gradients the optimizer will apply exist:

- `optimizer.step()` without a closure: from the global pre-hook (the script's backward
  passes are done before it calls `step()`);
- `optimizer.step(closure)` (Lightning's automatic optimization, LBFGS, any script that
  passes one): the closure zeroes the gradients and runs forward and backward *inside*
  `step()`, after every pre-hook. So the pre-hook hands `step()` a wrapped closure
  (PyTorch lets a pre-hook return new `(args, kwargs)`): it calls the script's closure,
  then `before_update`, and returns the closure's loss. What the subscribers do there
  (clip, scale, hide the gradients of a skipped step, raise a `Halt`) happens after the
  closure's backward and before the update.
- An optimizer that calls its closure several times in one `step()` (LBFGS with
  `max_iter > 1` or a line search) gets `before_update` after the **first** call only:
  the gradients at the point the step starts from, which decide its first direction and
  its convergence test. Hiding them (a skipped step) makes LBFGS see a zero gradient and
  return before it moves. Later evaluations inside the same step are not seen; this is
  reported once per optimizer class as a `hookpolicy:` warning.

A `Halt` from a subscriber propagates out of `optimizer.step()` (on purpose); the
subscribers after it are not called for that event. Any other exception is hookpolicy's own
fault, contained (`contain`): it goes to the subscriber's `fault(where, exc)` (the step
cycle's: its rules' containment, a `Halt` under `onError: halt`) or, for one without, is
said once; after `contain.MAX_FAULTS` faults the subscriber is not called again. The step
itself goes on as the script called it.

The one rule for unsubscribing: `Subscription.remove()` may be called at any time, from
any thread, also from inside a subscriber or any other optimizer hook; from that moment
the subscriber is not called again, not even later in the same step. PyTorch iterates its
global hook dicts while it calls them, so removing a handle from inside a step would raise
`OrderedDict mutated during iteration`: the global hooks are taken off when the last
subscriber leaves outside every optimizer step, else they stay (calling nobody) until the
next `subscribe` or `remove` outside one.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from types import FrameType
from typing import Any, Callable, Optional, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ... import process
from ...errors import Halt
from .contain import MAX_FAULTS, Part, fault_of

__all__ = ["DISCOVERY", "STEP_TRACKING", "StepSubscriber", "Subscription", "subscribe"]

log = logging.getLogger("hookpolicy")

#: `hookpolicy apply`'s discovery: called first.
DISCOVERY = 0
#: An attached model's step tracking (step rules, read-back, step count): called after discovery.
STEP_TRACKING = 10


class StepSubscriber(Protocol):
    """What the owner calls at every optimizer step of the process."""

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's gradients are final and the update has not happened yet."""

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        """The update happened (or a subscriber hid the gradients from it)."""


class Subscription:
    """The handle `subscribe` returns; `remove()` is safe to call twice and from inside a step."""

    def __init__(self, subscriber: StepSubscriber, priority: int, order: int) -> None:
        self.subscriber = subscriber
        self.sort_key = (priority, order)
        self.removed = False
        self.faults = 0

    def remove(self) -> None:
        _OWNER.remove(self)


def subscribe(subscriber: StepSubscriber, priority: int) -> Subscription:
    """Call `subscriber` at every optimizer step from now on, in `priority` order (lower first)."""
    return _OWNER.add(subscriber, priority)


class _Owner:
    """The pair of global hooks and the ordered subscribers they call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._order = itertools.count()
        #: replaced, never mutated, so a step in progress iterates a stable tuple
        self._subscriptions: tuple[Subscription, ...] = ()
        self._handles: list[RemovableHandle] = []
        self._hooks = process.Shared("optimizer step hooks", self._register, self._unregister)

    def add(self, subscriber: StepSubscriber, priority: int) -> Subscription:
        subscription = Subscription(subscriber, priority, next(self._order))
        with self._lock:
            self._subscriptions = tuple(sorted((*self._subscriptions, subscription), key=lambda s: s.sort_key))
        self._hooks.acquire()
        return subscription

    def remove(self, subscription: Subscription) -> None:
        with self._lock:
            first = not subscription.removed
            subscription.removed = True
            self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)
        if first:
            self._hooks.release()
        elif self._hooks.users == 0:
            self._unregister()  # hooks left in by a remove() inside a step come off at a later one outside

    def _register(self) -> None:
        if not self._handles:  # else still in from a remove() inside a step
            self._handles.append(register_optimizer_step_pre_hook(self._pre))
            try:
                self._handles.append(register_optimizer_step_post_hook(self._post))
            except BaseException:  # both or neither
                self._unregister()
                raise

    def _unregister(self) -> None:
        if self._handles and not _inside_optimizer_step():
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Optional[tuple[Any, Any]]:
        """hook(optimizer, args, kwargs) -> None or (args, kwargs): `args[0]` is the optimizer itself."""
        try:
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
            if callable(closure):
                wrapped = _ClosureThenUpdate(self, optimizer, closure)
                if "closure" in kwargs:
                    return args, {**kwargs, "closure": wrapped}
                return (args[0], wrapped, *args[2:]), kwargs
        except Exception as exc:  # noqa: BLE001 - hookpolicy's part: the step goes on with the script's own arguments
            _PART.failed(exc)
            return None
        self.before_update(optimizer)
        return None

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        for subscription in self._subscriptions:
            if not subscription.removed:
                self._call(subscription, "before_update", optimizer)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        wrapped = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if isinstance(wrapped, _ClosureThenUpdate):
            try:
                wrapped.report()
            except Exception as exc:  # noqa: BLE001 - hookpolicy's part: contained
                _PART.failed(exc)
        for subscription in self._subscriptions:
            if not subscription.removed:
                self._call(subscription, "after_update", optimizer)

    def _call(self, subscription: Subscription, method: str, optimizer: torch.optim.Optimizer) -> None:
        """One subscriber's `method`, contained: a `Halt` propagates, any other fault goes to its `fault`."""
        if subscription.faults >= MAX_FAULTS:
            return
        try:
            getattr(subscription.subscriber, method)(optimizer)
        except Halt:
            raise
        except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: never out of optimizer.step()
            subscription.faults += 1
            fault_of(subscription.subscriber, f"the optimizer step {'pre' if method == 'before_update' else 'post'}"
                     f"-hook ({method})", exc, _PART)


class _ClosureThenUpdate:
    """The closure `step()` gets in place of the script's: the script's closure, then `before_update`."""

    _said = process.Once()  # (optimizer class, what): each said once per process

    def __init__(self, owner: _Owner, optimizer: torch.optim.Optimizer, closure: Callable[..., Any]) -> None:
        self.owner, self.optimizer, self.closure = owner, optimizer, closure
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loss = self.closure(*args, **kwargs)
        self.calls += 1
        if self.calls == 1:
            self.owner.before_update(self.optimizer)  # each subscriber contained
        return loss

    def report(self) -> None:
        """After the step: say once if the closure ran several times, or never (the step was not seen)."""
        name = type(self.optimizer).__name__
        what = min(self.calls, 2)
        if what == 1 or not self._said((name, what)):
            return
        if what == 0:
            log.warning("%s.step() did not call the closure it was given: its steps are not evaluated "
                        "(no statistics, clip, skip or halt)", name)
        else:
            log.warning("%s called its closure %d times in one step(): step rules act on the gradients of "
                        "the first call only (the point the step starts from); later evaluations are not "
                        "guarded (LBFGS: max_iter=1 and no line search evaluates once)", name, self.calls)


#: The code of the wrapper PyTorch puts around every `Optimizer.step`, which calls the hooks.
_STEP_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__


def _inside_optimizer_step() -> bool:
    """Whether some thread is inside an optimizer step (iterating the global hook dicts).

    The trap: `sys._current_frames()` holds this very frame (the calling thread's top
    one). A local of ours still naming it when we return (the dict, a loop variable)
    makes the frame refer to itself, and that cycle keeps every caller's frame and its
    locals (the script's model, optimizer, tensors) alive until the next full garbage
    collection; `apply`'s discovery then takes the dead optimizer for a live one. So the
    dict is emptied on the way out and the walk has its own frame.
    """
    frames = sys._current_frames()
    try:
        return any(_runs_a_step(top) for top in frames.values())
    finally:
        frames.clear()


def _runs_a_step(frame: Optional[FrameType]) -> bool:
    """Whether `frame` or one of its callers is PyTorch's wrapper around `Optimizer.step`."""
    while frame is not None:
        if frame.f_code is _STEP_WRAPPER:
            return True
        frame = frame.f_back
    return False


#: the owner's own part (the closure's wrapper): said once, off after 3 faults
_PART = Part("the optimizer step hooks' part (the closure's wrapper)")
_OWNER = _Owner()
