"""Named floating-point tensors inside the tuples, lists and dicts that modules take and return.

A module's output may be a tensor, a tuple `(logits, hidden)`, a dict `{"logits": ...}`
or any nesting of these. Every floating-point tensor in it is a target, named by its
path: `""` for a bare tensor, `"0"`, `"1"` for positions, `"logits"` for keys, `"1.0"`
for nesting. `select` keeps the tensors whose first path component is listed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import torch

__all__ = ["named_tensors", "replace_tensors", "selector"]

Selector = Callable[[str], bool]


def selector(select: Sequence[Union[int, str]]) -> Selector:
    """A predicate on tensor names keeping those whose first component is in `select`."""
    if not select:
        return lambda name: True
    wanted = frozenset(str(s) for s in select)
    return lambda name: name == "" or name.split(".", 1)[0] in wanted


def named_tensors(obj: Any, keep: Selector) -> list[tuple[str, torch.Tensor]]:
    """Every non-empty floating-point tensor in `obj` with its path name, in order."""
    return [(name, t) for name, t in _walk(obj, "") if keep(name)]


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() > 0:
            yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _walk(item, _join(prefix, str(i)))
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from _walk(item, _join(prefix, str(key)))


def _join(prefix: str, part: str) -> str:
    return f"{prefix}.{part}" if prefix else part


def replace_tensors(obj: Any, new: Mapping[str, torch.Tensor], prefix: str = "") -> Any:
    """A copy of `obj` with the tensors named in `new` swapped in; containers keep their type."""
    if isinstance(obj, torch.Tensor):
        return new.get(prefix, obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(replace_tensors(v, new, _join(prefix, str(i))) for i, v in enumerate(obj)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(replace_tensors(v, new, _join(prefix, str(i))) for i, v in enumerate(obj))
    if isinstance(obj, dict):
        out = obj.copy()
        for key, value in obj.items():
            out[key] = replace_tensors(value, new, _join(prefix, str(key)))
        return out
    return obj
