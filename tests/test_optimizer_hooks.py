"""The one owner of the global optimizer step hooks: subscriber order and the removal rule.

The reference for "when" is PyTorch itself: a per-optimizer pre/post hook the test
registers with `optimizer.register_step_pre_hook`, which PyTorch calls after the global
pre-hooks and before the global post-hooks.
"""

from __future__ import annotations

import gc
import weakref
from typing import Callable, Optional

import torch
import torch.optim.optimizer as torch_optimizer

from hookpolicy.engine.hooks import optimizer_hooks


class Recorder:
    """A subscriber that appends `(name, event)` to a shared log and may run a callback."""

    def __init__(self, name: str, log: list[tuple[str, str]], on_before: Optional[Callable[[], None]] = None) -> None:
        self.name, self.log, self.on_before = name, log, on_before

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.append((self.name, "before"))
        if self.on_before is not None:
            self.on_before()

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.append((self.name, "after"))


def global_counts() -> tuple[int, int]:
    return len(torch_optimizer._global_optimizer_pre_hooks), len(torch_optimizer._global_optimizer_post_hooks)


def stepping_optimizer(log: list[tuple[str, str]]) -> torch.optim.Optimizer:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    opt = torch.optim.SGD([param], lr=0.1)
    opt.register_step_pre_hook(lambda *a: log.append(("torch", "pre")))
    opt.register_step_post_hook(lambda *a: log.append(("torch", "post")))
    return opt


def test_subscribers_are_called_by_priority_then_subscription_order() -> None:
    baseline = global_counts()
    log: list[tuple[str, str]] = []
    opt = stepping_optimizer(log)
    late = optimizer_hooks.subscribe(Recorder("tracking", log), optimizer_hooks.STEP_TRACKING)
    second = optimizer_hooks.subscribe(Recorder("tracking2", log), optimizer_hooks.STEP_TRACKING)
    early = optimizer_hooks.subscribe(Recorder("discovery", log), optimizer_hooks.DISCOVERY)
    assert global_counts() == (baseline[0] + 1, baseline[1] + 1)  # one pair, however many subscribers
    try:
        opt.step()
    finally:
        for s in (late, second, early):
            s.remove()
    assert log == [
        ("discovery", "before"), ("tracking", "before"), ("tracking2", "before"), ("torch", "pre"),
        ("torch", "post"), ("discovery", "after"), ("tracking", "after"), ("tracking2", "after"),
    ]
    assert global_counts() == baseline


def test_a_subscriber_removed_during_a_step_is_not_called_again() -> None:
    baseline = global_counts()
    log: list[tuple[str, str]] = []
    opt = stepping_optimizer(log)
    holder: dict[str, optimizer_hooks.Subscription] = {}
    first = optimizer_hooks.subscribe(
        Recorder("first", log, on_before=lambda: (holder["second"].remove(), holder["first"].remove())),
        optimizer_hooks.DISCOVERY,
    )
    holder["first"] = first
    holder["second"] = optimizer_hooks.subscribe(Recorder("second", log), optimizer_hooks.STEP_TRACKING)
    opt.step()  # must not raise "OrderedDict mutated during iteration"
    assert log == [("first", "before"), ("torch", "pre"), ("torch", "post")]
    # Removed inside the step, the global hooks stayed (calling nobody) ...
    assert global_counts() == (baseline[0] + 1, baseline[1] + 1)
    log.clear()
    opt.step()
    assert log == [("torch", "pre"), ("torch", "post")]
    # ... until the next subscribe or remove outside a step.
    first.remove()
    assert global_counts() == baseline


def test_taking_the_hooks_off_keeps_no_caller_alive() -> None:
    """The last `remove()` walks every thread's frames and must leave no reference cycle behind.

    `sys._current_frames()` includes the walking frame itself. Kept, it made a cycle that
    held every frame of the caller's stack, with the script's locals (its model, its
    optimizer), until the next full garbage collection; `apply`'s discovery, which looks
    for optimizers on the heap, then refused to govern a later model trained by hand
    because a dead optimizer "existed". With the collector off, what is freed here is
    freed by reference counting alone.
    """
    class Local:
        pass

    def detach() -> "weakref.ref[Local]":
        local = Local()  # a local of the script's frame, like its optimizer
        baseline = global_counts()
        subscription = optimizer_hooks.subscribe(Recorder("tracking", []), optimizer_hooks.STEP_TRACKING)
        assert global_counts() == (baseline[0] + 1, baseline[1] + 1)
        subscription.remove()
        assert global_counts() == baseline  # the hooks came off: the frames were walked
        return weakref.ref(local)

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        assert detach()() is None
    finally:
        if was_enabled:
            gc.enable()
