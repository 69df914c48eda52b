"""hookpolicy's start-up hook for `hookpolicy apply`; inert unless HOOKPOLICY_BOOTSTRAP is set.

`hookpolicy apply` puts this folder first on PYTHONPATH, so every Python process of the
COMMAND (the script, a launcher such as torchrun, its workers, their helpers) imports this
module at start-up, as `site` does with any `sitecustomize`. Only the training processes
are governed (`docs/reliability.md`, "Which processes are governed"):

- a process started by exec whose rank (RANK, LOCAL_RANK) is not that of the nearest
  process above it that imported torch under `apply` (HOOKPOLICY_PARENT, which that process
  sets): the COMMAND, and each rank a launcher starts (torchrun, Lightning, accelerate);
- a `multiprocessing` child only when `torch.multiprocessing.spawn` (or `start_processes`)
  started it: a rank of `mp.spawn`, decided at the child's first module call (`_start`);
- nothing else: a helper started by exec with the same rank (an evaluation or tokenizer
  child, `subprocess.Popen`), a DataLoader worker or any other `multiprocessing` child, and
  a forked child (`child.py` makes a fork inert) are not governed, and cost what this module
  costs: a helper by exec imports nothing more; a `multiprocessing` child holds one
  global forward pre-hook until its first module call, and imports hookpolicy only if it
  is a rank.

It must cost (close to) nothing:

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
#: = hookpolicy.environment.ENV_PARENT
_ENV_PARENT = "HOOKPOLICY_PARENT"
#: = hookpolicy.environment.ENV_RANK, ENV_LOCAL_RANK
_RANK_VARIABLES = ("RANK", "LOCAL_RANK")
#: The last argument of a `multiprocessing` child started by spawn (multiprocessing/spawn.py).
_MULTIPROCESSING_CHILD = "--multiprocessing-fork"
#: The module of the target `torch.multiprocessing.spawn` gives each rank (`_wrap`).
_TORCH_SPAWN = "torch.multiprocessing.spawn"


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


def _rank_identity() -> str:
    """= hookpolicy.environment.rank_identity(os.environ): what a helper shares with its parent."""
    return "/".join(os.environ.get(name, "") for name in _RANK_VARIABLES)


def _helper_by_exec() -> bool:
    """Started by exec from a process of the same rank that imported torch under `apply`."""
    return os.environ.get(_ENV_PARENT) == _rank_identity()


#: Read at start-up: spawn's `prepare()` replaces sys.argv with the parent's before the
#: child imports its main module (and torch with it).
_IS_MULTIPROCESSING_CHILD = getattr(sys, "argv", [])[-1:] == [_MULTIPROCESSING_CHILD]


_PENDING: Any = None  # the forward pre-hook that waits for a multiprocessing child's first module call


def _start() -> None:
    """torch is imported: start governing, or, in a `multiprocessing` child, wait for its target.

    A spawned child imports torch while it re-imports the main module, before it knows
    its target (what it was started to run). It is decided at its first module call,
    from inside the target: governed if `torch.multiprocessing.spawn` started it (a rank),
    left alone otherwise (a DataLoader worker, a Pool worker), the hook removed either way.
    This module holds its only process-wide hook outside `engine/hooks/module_hooks.py`: it
    must not import hookpolicy before the process is known to be governed.
    """
    global _PENDING
    if not _IS_MULTIPROCESSING_CHILD:
        _bootstrap()
        return
    from torch.nn.modules.module import register_module_forward_pre_hook

    _PENDING = register_module_forward_pre_hook(_first_call)


def _first_call(module: Any, args: Any) -> None:
    """hook(module, args) -> None: the first module call of a spawned child, once its target is known."""
    from multiprocessing import process

    current = process.current_process()
    if getattr(current, "_inheriting", False):  # still re-importing the main module
        return None
    _PENDING.remove()
    target = getattr(current, "_target", None)
    if getattr(target, "__module__", None) == _TORCH_SPAWN:
        _bootstrap(module, args)
    return None


def _bootstrap(*call: Any) -> None:
    """Govern this process; `call` is the module call under way, if any (it is governed too)."""
    try:
        from hookpolicy.apply.child import bootstrap
    except ImportError as exc:
        sys.stderr.write(
            f"hookpolicy: error: {sys.executable} cannot import hookpolicy ({exc}); install "
            "hookpolicy in the Python that runs the training, or name that Python in COMMAND\n"
        )
        raise SystemExit(1) from None
    bootstrap(*call)


def _chain() -> None:
    """Run the `sitecustomize` this module shadows, if there is one."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # the name is theirs, as it would be without hookpolicy
    spec.loader.exec_module(module)


if os.environ.get(_ENV_BOOTSTRAP) and (_IS_MULTIPROCESSING_CHILD or not _helper_by_exec()):
    if "torch" in sys.modules:
        _start()
    else:
        sys.meta_path.insert(0, _TorchImportHook())
_chain()
