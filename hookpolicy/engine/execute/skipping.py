"""Skipping a step: `skip_step` cannot stop `optimizer.step()` from running, so it hides the gradients.

`p.grad = None` makes every torch optimizer leave a parameter alone without touching its
state; `restore` puts the gradients back in the step post-hook.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["HiddenGrads"]


class HiddenGrads:
    """The gradients (and optimizer state) hidden from the optimizers of a skipped step, per optimizer."""

    def __init__(self) -> None:
        self._stash: dict[int, tuple[list[Optional[torch.Tensor]], dict[Any, dict[str, Any]]]] = {}

    def hide(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the step: no gradient for the optimizer, and its state as it is now restored afterwards.

        Every torch optimizer leaves a parameter without `.grad` alone, but not all of its
        bookkeeping: LBFGS counts the closure evaluation (`func_evals`) after the closure
        that hid them. A shallow copy of each parameter's state dict, taken only on a
        skipped step, puts such counters back; the state tensors are not touched.
        """
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = {p: dict(s) for p, s in optimizer.state.items()}
        self._stash[id(optimizer)] = ([p.grad for p in params], state)
        for p in params:
            p.grad = None

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """After the update: the gradients hidden from `optimizer` and its state as it was, back (if hidden)."""
        stash = self._stash.pop(id(optimizer), None)
        if stash is not None:
            grads, state = stash
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for p, grad in zip(params, grads):
                p.grad = grad
            for p in [p for p in optimizer.state if p not in state]:
                del optimizer.state[p]
            optimizer.state.update(state)
