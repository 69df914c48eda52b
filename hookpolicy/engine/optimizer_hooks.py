"""The one owner of PyTorch's process-wide optimizer step hooks.

`torch.optim.optimizer.register_optimizer_step_pre_hook` / `..._post_hook` are global
state of the process. hookpolicy registers them here and nowhere else, and calls its
subscribers in an explicit order: by `priority` (lower first), then by subscription
order. The priorities in use:

- `DISCOVERY` (0): `hookpolicy apply`'s model discovery. It sees a step first, so that at
  a step's end it reads a governed model's step counter before step tracking moves it.
- `STEP_TRACKING` (10): each attached model's `StepTracker`, which runs the step rules
  and the read-back before the update and counts the step after it.

The subscriber contract, as a literal signature:

    subscriber.before_update(optimizer) -> None   # the step's gradients are final
    subscriber.after_update(optimizer) -> None    # the update happened (or was skipped)

`before_update` is called from the global pre-hook today (a step without a closure has
its gradients before `step()` is called). It is named for *when* a subscriber acts,
not for which PyTorch hook calls it, so the owner can later call it after the closure
of `optimizer.step(closure)` has run its backward, without a subscriber changing.
An exception from a subscriber propagates out of `optimizer.step()` (a `Halt` does so
on purpose); the subscribers after it are not called for that event.

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
import sys
import threading
from types import FrameType
from typing import Any, Optional, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["DISCOVERY", "STEP_TRACKING", "StepSubscriber", "Subscription", "subscribe"]

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

    def add(self, subscriber: StepSubscriber, priority: int) -> Subscription:
        subscription = Subscription(subscriber, priority, next(self._order))
        with self._lock:
            self._subscriptions = tuple(sorted((*self._subscriptions, subscription), key=lambda s: s.sort_key))
            if not self._handles:
                self._handles = [register_optimizer_step_pre_hook(self._pre),
                                 register_optimizer_step_post_hook(self._post)]
        return subscription

    def remove(self, subscription: Subscription) -> None:
        subscription.removed = True
        with self._lock:
            self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)
            if not self._subscriptions and self._handles and not _inside_optimizer_step():
                for handle in self._handles:
                    handle.remove()
                self._handles = []

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for subscription in self._subscriptions:
            if not subscription.removed:
                subscription.subscriber.before_update(optimizer)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for subscription in self._subscriptions:
            if not subscription.removed:
                subscription.subscriber.after_update(optimizer)


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


_OWNER = _Owner()
