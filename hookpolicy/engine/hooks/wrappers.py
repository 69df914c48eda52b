"""Data parallelism around a governed model: the one place hookpolicy looks for DDP and FSDP wrappers.

`data_parallel` says whether every rank of a process group holds a model and steps it
together (a wrapper in it or around it, or DTensor parameters); `wrappers_around` finds the
wrappers alive that hold it, by a heap scan (`heap`) kept weakly (`_AROUND`), since a
framework may govern, and call, the module inside a wrapper (Lightning's strategies).
"""

from __future__ import annotations

import sys
import weakref

import torch

from .heap import live_modules

__all__ = ["data_parallel", "wrappers_around"]


def data_parallel(module: torch.nn.Module) -> bool:
    """Whether every rank of a process group holds this model and steps it together: DDP, FSDP
    (either) in it or around it, or parameters that are DTensors. Its policy swaps wait for every
    rank (`reload`); without it, the job's loss is said to be taken on trust (`cycle`).

    A wrapper *around* the model is one that is alive and holds it (`wrappers_around`, only
    when nothing in the model shows): a framework may govern, and call, the module inside a
    DDP wrapper (Lightning's strategies wrap the LightningModule and call its training_step).
    """
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if any(isinstance(m, _wrapper_kinds()) for m in module.modules()):
        return True
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if isinstance(dtensor, type) and any(isinstance(p, dtensor) for p in module.parameters()):
        return True
    return bool(wrappers_around(module))


#: per module, the DDP and FSDP wrappers found alive around it (both weakly): asked again, the
#: heap is scanned again only while none of them is alive and still holds it
_AROUND: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[torch.nn.Module]]" = weakref.WeakKeyDictionary()


def wrappers_around(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The DDP and FSDP wrappers alive that hold `module`: the one place hookpolicy looks for them
    (`data_parallel`, `replicas`). Found by a heap scan, kept weakly: the next question about the
    same module scans again only if none found is still alive and holding it (none found is not
    kept: a wrapper made later is found then)."""
    kinds = _wrapper_kinds()
    known = [w for w in _AROUND.get(module, ()) if issubclass(type(w), kinds) and _holds(w, module)]
    if known:
        return known
    found = [m for m in live_modules() if issubclass(type(m), kinds) and _holds(m, module)]
    if found:
        _AROUND[module] = weakref.WeakSet(found)
    return found


def _holds(wrapper: torch.nn.Module, module: torch.nn.Module) -> bool:
    return any(inner is module for inner in wrapper.modules())


def _wrapper_kinds() -> tuple[type, ...]:
    """DistributedDataParallel, and FSDP2's FSDPModule and FSDP1 once `torch.distributed.fsdp` is imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return tuple(k for k in (torch.nn.parallel.DistributedDataParallel, getattr(fsdp, "FSDPModule", None),
                             getattr(fsdp, "FullyShardedDataParallel", None)) if isinstance(k, type))
