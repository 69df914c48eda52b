"""hookpolicy: declarative YAML policies for PyTorch hooks.

    import hookpolicy
    policy = hookpolicy.load("policy.yaml")
    with policy.attach(model) as attached:
        ...  # train as usual

The names that need torch (`load`, `PolicySet`, `Attached`) are imported on first use,
so `hookpolicy check`, `hookpolicy --help` and the `apply` wrapper start without torch.
"""

from typing import TYPE_CHECKING, Any

from .errors import Halt, HookPolicyError, PolicyError, Problem
from .say import say as _say  # noqa: F401 - installs the one channel for hookpolicy's own lines

if TYPE_CHECKING:
    from .api import PolicySet, load
    from .engine.runtime import Attached

__version__ = "0.1.0"

__all__ = ["Attached", "Halt", "HookPolicyError", "PolicyError", "PolicySet", "Problem", "load", "__version__"]

_LAZY = {"load": "api", "PolicySet": "api", "Attached": "engine.runtime"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
