"""hookpolicy's start-up hook for `hookpolicy apply`; inert unless HOOKPOLICY_BOOTSTRAP is set.

`hookpolicy apply` puts this folder first on PYTHONPATH, so every Python process of the
COMMAND (the script, a launcher such as torchrun, its workers) imports this module at
start-up, as `site` does with any `sitecustomize`. It must cost (close to) nothing:

- it imports neither torch nor hookpolicy (importing torch takes over a second);
- it puts a one-shot finder on `sys.meta_path` that notices when the process imports
  `torch` and, right after torch has finished importing, calls
  `hookpolicy.apply.child.bootstrap()`, which loads the policies and starts watching for
  models; a process that never imports torch never loads hookpolicy at all;
- it then runs the `sitecustomize` this one shadows (the next one on `sys.path`, e.g. a
  distribution's), so installing hookpolicy's hook takes nothing away.

The one environment variable it reads is spelled out here rather than imported from
`hookpolicy.environment`: importing anything of hookpolicy at start-up would cost every
Python process of the COMMAND, and fail in a Python without hookpolicy before it could
say so clearly (`tests/test_environment.py` keeps the two spellings equal).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
#: = hookpolicy.environment.ENV_BOOTSTRAP
_ENV_BOOTSTRAP = "HOOKPOLICY_BOOTSTRAP"


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of `torch` to run hookpolicy after it."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None,
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot: later finders answer from here on
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec: Optional[importlib.machinery.ModuleSpec] = (
                find(fullname, path, target) if find is not None else None
            )
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterTorch(spec.loader)
                return spec
        return None


class _AfterTorch(importlib.abc.Loader):
    """Delegates to torch's own loader, then starts hookpolicy and steps out of the way."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first: torch and importlib.resources look at it.
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        _start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _start() -> None:
    try:
        from hookpolicy.apply.child import bootstrap
    except ImportError as exc:
        sys.stderr.write(
            f"hookpolicy: error: {sys.executable} cannot import hookpolicy ({exc}); install "
            "hookpolicy in the Python that runs the training, or name that Python in COMMAND\n"
        )
        raise SystemExit(1) from None
    bootstrap()


def _chain() -> None:
    """Run the `sitecustomize` this module shadows, if there is one."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # the name is theirs, as it would be without hookpolicy
    spec.loader.exec_module(module)


if os.environ.get(_ENV_BOOTSTRAP):
    if "torch" in sys.modules:
        _start()
    else:
        sys.meta_path.insert(0, _TorchImportHook())
_chain()
