"""A gradient hook on a tensor, registered as `Tensor.register_hook` does, without its handle.

hookpolicy registers a tensor hook on every governed output of every training forward
(`grad_output`: 17 a step on a 4-block GPT) and never removes one: the tensor and its
graph go at the end of the backward pass, and the hooks with them. `Tensor.register_hook`
(torch/_tensor.py) is Python: it checks for `__torch_function__`, makes the tensor's
`_backward_hooks` dict on first use (its setter installs the C++ pre-hook that calls the
dict's values, and `grad_fn._register_hook_dict` installs the same for a non-leaf tensor's
node), imports and builds a `RemovableHandle` (a weak reference, a class counter) and puts
the hook in the dict under the handle's id. `add` does the same steps without the handle.

The key is a new `object()`: never equal to a `RemovableHandle` id (an int), so a user's
own hooks on the same tensor, registered before or after, keep theirs and can remove
them; two of ours on one tensor are two entries, run in the order they were added, as
two `register_hook` calls would be. A tensor that `__torch_function__` applies to (a
subclass, an active mode) goes through `register_hook` itself, so the override sees it,
and so does a hook that Dynamo traces (`torch.compile`): it knows `register_hook`, while
writing `_backward_hooks` would break its graph there.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

__all__ = ["add"]

_overridden = torch._C._has_torch_function_unary
_compiling = torch.compiler.is_compiling


def add(t: torch.Tensor, hook: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
    """`t.register_hook(hook)` for a tensor that requires grad, the handle left out (see the module docstring)."""
    if _overridden(t) or _compiling():
        t.register_hook(hook)  # type: ignore[no-untyped-call]
        return
    hooks: Any = t._backward_hooks  # typed as keyed by int: a handle's id
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()  # the setter installs the tensor's pre-hook on this dict
        node = t.grad_fn
        if node is not None:
            node._register_hook_dict(t)
    hooks[object()] = hook
