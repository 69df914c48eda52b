"""PyTorch's hook tables counted (0 once hookpolicy let go), the process-wide state
hookpolicy must give back, and a guard that no hook reads a tensor back to the host."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from torch import nn


def module_hook_count(model: nn.Module) -> int:
    """Every hook on every module of `model` (0 once hookpolicy let go of it)."""
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        + len(m._forward_hooks_always_called) + len(m._forward_hooks_with_kwargs)
        for m in model.modules()
    )


def global_hook_counts() -> tuple[int, ...]:
    """PyTorch's process-wide hooks: optimizer step pre/post, module forward pre/post, backward."""
    return (
        len(optimizer_hooks._global_optimizer_pre_hooks), len(optimizer_hooks._global_optimizer_post_hooks),
        len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks),
        len(module_hooks._global_backward_hooks), len(module_hooks._global_backward_pre_hooks),
    )


def process_wide_state() -> dict[str, object]:
    """Everything of the process hookpolicy may change while attached, and must give back.

    The one list is `hookpolicy.process.snapshot()`: PyTorch's process-wide hooks (call,
    registration, optimizer step), the users of each of hookpolicy's shared changes (step
    subscribers, module call hooks, `nn.Module.__reduce_ex__`), hookpolicy's entries in
    `warnings.filters` and its threads.
    """
    from hookpolicy import process

    return process.snapshot()


#: the Tensor methods that read a value back to the host (a host-device sync on CUDA)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, reading a tensor's value on the host raises, as no hookpolicy hook may do on CUDA.

    A hook that did would raise inside the hook, where onError contains it: a test using
    this also checks that no hook error was counted, or it could not fail. On CPU a read is
    no sync and the hooks read their statistics at once (`engine/measure/stats.py`, the rule per
    device), so inside, CPU tensors take CUDA's path: what is checked is the CUDA rule.
    """
    from hookpolicy.engine.measure import stats

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host sync inside a hook")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stats, "_READ_ON_CPU", False)
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, forbidden)
        yield
