"""hookpolicy: declarative YAML policies for PyTorch hooks.

    import hookpolicy
    policy = hookpolicy.load("policy.yaml")
    with policy.attach(model) as attached:
        ...  # train as usual
"""

from .api import PolicySet, load
from .errors import Halt, HookPolicyError, PolicyError, Problem
from .runtime import Attached

__version__ = "0.1.0"

__all__ = ["Attached", "Halt", "HookPolicyError", "PolicyError", "PolicySet", "Problem", "load", "__version__"]
