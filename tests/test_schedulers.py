"""`engine.hooks.schedulers`: every LR scheduler and GradScaler alive, known from their construction.

The reference is the heap itself (`gc.get_objects()` after a full collection): what
`alive()` lists is exactly what is alive there, made before the watch or after it, by
torch's classes or by a class defined while watched.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from hookpolicy.engine.hooks import schedulers
from helpers.models import tiny


def on_the_heap() -> set[int]:
    """The ids of the LR schedulers and GradScalers alive, from the heap."""
    gc.collect()
    return {id(o) for o in gc.get_objects() if issubclass(type(o), schedulers.kinds())}


def test_alive_is_what_the_heap_holds_made_before_and_after_the_watch() -> None:
    optimizer = torch.optim.SGD(tiny().parameters(), lr=0.1)
    before = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    with schedulers.watch():
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)  # never calls LRScheduler.__init__
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
        scaler = torch.amp.GradScaler("cpu")

        class Own(torch.optim.lr_scheduler.LRScheduler):  # defined while watched; no super().__init__
            def __init__(self, optimizer: torch.optim.Optimizer) -> None:
                self.optimizer = optimizer

            def get_lr(self) -> list[Any]:
                return [0.1]

        own = Own(optimizer)
        made = [before, plateau, cosine, scaler, own]
        heap = on_the_heap()  # first: its full collection frees what only a cycle held, before alive() is read
        assert {id(o) for o in schedulers.alive()} == heap >= {id(o) for o in made}
        del cosine, made
        heap = on_the_heap()
        assert {id(o) for o in schedulers.alive()} == heap  # the dropped one is gone
        assert not any(type(o) is torch.optim.lr_scheduler.CosineAnnealingLR for o in schedulers.alive())
    assert schedulers.alive() == []
    assert Own.__init__.__qualname__.endswith("Own.__init__") and not hasattr(Own.__init__, "__wrapped__")
    assert not hasattr(torch.optim.lr_scheduler.LambdaLR.__init__, "__wrapped__")

    class Later(torch.optim.lr_scheduler.LambdaLR):  # defined after the watch: torch's class as it was
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            super().__init__(optimizer, lambda step: 1.0)

    Later(optimizer)
    assert not hasattr(Later.__init__, "__wrapped__") and schedulers.alive() == []


def test_a_watched_constructor_keeps_its_signature() -> None:
    import inspect

    plain = inspect.signature(torch.optim.lr_scheduler.CosineAnnealingLR)
    with schedulers.watch():
        assert inspect.signature(torch.optim.lr_scheduler.CosineAnnealingLR) == plain
        assert hasattr(torch.optim.lr_scheduler.CosineAnnealingLR.__init__, "__wrapped__")
