"""The one place hookpolicy scans the Python heap (`gc.get_objects()`).

A heap scan costs milliseconds per million objects, so it is only done where nothing
cheaper can answer, and never per step: step tracking asks once whether any optimizer
holds a model's parameters (optimizer steps or manual SGD), and `apply`'s discovery asks
which optimizers exist when it meets a candidate model, and which modules own parameters
an optimizer steps that nobody governs; `wrappers.wrappers_around` asks, for a governed
model in a process group and only when nothing inside it shows, whether a DDP or FSDP wrapper
holds it (for `wrappers.data_parallel` and `replicas`; a wrapper found is kept, weakly, so
the next question about that model needs no scan); `schedulers`, once when its first watcher comes (the first update of a model
with snapshots for `then: rewind`), asks which LR schedulers and GradScalers were made before
its constructors were watched.

Types are tested with `issubclass(type(o), ...)`, never `isinstance`: `isinstance` reads
`__class__`, which a lazy proxy on the heap may compute (an import, a download).
"""

from __future__ import annotations

import gc
from typing import Any

import torch

__all__ = ["live_modules", "live_of", "live_optimizers"]



def live_optimizers(collect: bool = False) -> list[torch.optim.Optimizer]:
    """Every `torch.optim.Optimizer` alive in the process.

    The heap also holds garbage: an optimizer in a reference cycle nothing reaches any
    more stays there until the cyclic collector runs, which depends on how much was
    allocated since. `collect` runs a full collection first, so that only optimizers
    something still holds are listed (a full collection costs more than the scan: only
    where a found optimizer would change a decision).
    """
    if collect:
        gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]


def live_modules() -> list[torch.nn.Module]:
    """Every `torch.nn.Module` alive in the process."""
    return live_of(torch.nn.Module)


def live_of(*kinds: type) -> list[Any]:
    """Every object of one of `kinds` (subclasses included) alive in the process, in one scan: the LR
    schedulers and GradScalers made before `schedulers` watched their constructors."""
    return [o for o in gc.get_objects() if issubclass(type(o), kinds)]
