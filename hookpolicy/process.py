"""Everything hookpolicy changes in the process outside the models it governs: one list, one way back.

A governed model is the user's; the process around it is shared with the user's code,
PyTorch and every other library. What hookpolicy changes there, and who gives it back:

| change                                            | made by (the one owner)            | given back                                   |
|---------------------------------------------------|------------------------------------|----------------------------------------------|
| optimizer step pre/post hooks                     | `engine/hooks/optimizer_hooks.py`        | last `Subscription.remove()` outside a step  |
| the hook before every module call (forward pre)   | `engine/hooks/module_hooks.py` (`_CALLS`) | last remove() of a `global_forward_pre_hook` handle |
| the filter for torch.compile's global-hook warning| `engine/hooks/module_hooks.py` (`_CALLS`) | with the module call hook                    |
| module/parameter registration hooks               | `engine/hooks/module_hooks.py` (`_WATCH`) | last `Watching.remove()`                     |
| `torch.nn.Module.__reduce_ex__`                    | `engine/hooks/module_hooks.py`           | last `OwnHandle.remove()`                    |
| `torch.autograd.backward`, `GradScaler.scale`      | `engine/hooks/loss.py` (`_ROOTS`)        | last `LossTap.remove()`                      |
| `__init__` of `LRScheduler`, `GradScaler` and their subclasses; their `__init_subclass__` | `engine/hooks/schedulers.py` (`_MADE`) | last `Watch.remove()` (a snapshot's) |
| a handler on the `hookpolicy` logger (its level INFO if unset) | `say.py` (`HANDLER`), at `import hookpolicy` | never: the one channel of hookpolicy's lines; a user may remove it (`removeHandler(say.HANDLER)`) |
| a fork handler closing exporter sockets in a forked child | `export/exporter.py` (`_LISTENING`), at import | never: `os.register_at_fork` has no undo; it does nothing without an exporter |
| a hook before every module call, in a `multiprocessing` child of `apply` until its first call | `apply/_bootstrap/sitecustomize.py` (`_PENDING`) | at that first call |
| threads `hookpolicy-*`                            | `start_thread` (exporter, reload, lifetime) | their owner's shutdown/stop                  |
| what was said once                                | `Once`                             | never: "once" is per process or per owner    |
| SIGTERM/SIGHUP handlers, the signal wakeup fd     | `apply/child.py`, `apply/lifetime.py` (`apply` children only) | never: the process ends with them |
| the cyclic garbage collector, paused while a plan is built and its hooks installed | here (`collector_paused`) | at the end of the last one running (enabled again only if it was) |

hookpolicy's own process-wide state (module-level singletons; they change nothing outside
hookpolicy, and each is the one home of what it holds):

| singleton                     | module                      | holds                                                     |
|-------------------------------|-----------------------------|-----------------------------------------------------------|
| `_OWNER`                      | `engine/hooks/optimizer_hooks.py` | the optimizer step subscribers, in order                  |
| `_CALLS`, `_WATCH`            | `engine/hooks/module_hooks.py`    | module call subscribers; the modules watched for changes  |
| `_ours`, `_saved`, `_reducer` | `engine/hooks/module_hooks.py`    | ids of hookpolicy's module hooks; the previous reducer (as found; as called) |
| `_ROOTS`                      | `engine/hooks/loss.py`            | the loss taps joined, the scale of each GradScaler output |
| `_MADE`                       | `engine/hooks/schedulers.py`      | the LR schedulers and GradScalers made while watched (weakly) |
| `_ATTACHED`                   | `engine/runtime.py`         | the policies attached to each model (weak keys)           |
| `_AGREED`                     | `engine/decide/agreement.py`       | ranks agree at every step once they agreed at one         |
| `_CARRIED`                    | `engine/decide/agreement.py`       | per model, the `ranks: job` layout every rank announced   |
| `_DTENSOR`                    | `engine/measure/distributed.py`     | the DTensor class, once torch.distributed.tensor is in    |
| `_AROUND`                     | `engine/hooks/wrappers.py`  | per module, the DDP/FSDP wrappers found around it (weakly) |
| `_local`                      | `engine/measure/stats.py`           | per-thread scratch buffers                                |
| `_PARTS`                      | `engine/hooks/contain.py`           | every process-wide `Part` alive (weakly), for `switched_off()` |
| `_CHECKED_CLASSES`            | `engine/execute/executor.py`        | the `Once` of classes checked for their own reducer       |
| `_STORES`                     | `export/collector.py`       | per `CollectorRegistry` (weakly), its one `MetricsStore`   |
| `_LISTENING`                  | `export/exporter.py`        | the exporters whose socket may be open (weakly)           |
| `_checksums`                  | `apply/reload.py`           | per policy file, its status and checksum when last read   |
| `_SESSION`                    | `apply/child.py`            | the `apply` child's session                               |
| `_SHARED`, `_FILTERS`         | here                        | every `Shared` and `WarningFilter`, for `snapshot()`      |

Each change that several users share is a `Shared`: made when the first user comes,
undone when the last one leaves, so after the last `remove()` the process is as it was.
`snapshot()` reads all of it back from the process itself (the test suite's autouse
fixture compares it before and after every test).

This module imports nothing but the standard library: every stage may use it, and it
reads torch's global hook dicts only once torch has been imported by someone else.
"""

from __future__ import annotations

import gc
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

__all__ = ["THREAD_PREFIX", "Once", "Shared", "WarningFilter", "collector_paused", "snapshot", "start_thread"]

#: The name of every thread hookpolicy starts begins with this.
THREAD_PREFIX = "hookpolicy-"

#: every `Shared` and `WarningFilter` made, in the order made (module constants of their owners)
_SHARED: list["Shared"] = []
_FILTERS: list["WarningFilter"] = []


class Shared:
    """A process-wide change shared by its users: `make()` when the first comes, `undo()` when the last leaves.

    `acquire()` and `release()` pair up (a caller releases exactly what it acquired);
    both are thread-safe, and `make`/`undo` run under the lock, so a change is never made
    twice or undone while a user holds it.
    """

    def __init__(self, name: str, make: Callable[[], None], undo: Callable[[], None]) -> None:
        self.name = name
        self._make, self._undo = make, undo
        self._lock = threading.RLock()
        self.users = 0
        _SHARED.append(self)

    def acquire(self) -> None:
        with self._lock:
            if self.users == 0:
                self._make()
            self.users += 1

    def release(self) -> None:
        with self._lock:
            if self.users <= 0:
                raise RuntimeError(f"{self.name}: released more often than acquired")
            self.users -= 1
            if self.users == 0:
                self._undo()


class WarningFilter:
    """One `warnings.filterwarnings("ignore", ...)` entry, and taking exactly that entry out again.

    `warnings.filters` is the process's: a filter left behind would hide the warning from
    the user's code for the rest of the process. hookpolicy changes `warnings.filters`
    through this class only (a test keeps it so), which is how `snapshot()` tells its
    filters from those other libraries add when they are imported.
    """

    def __init__(self, message: str, category: type[Warning]) -> None:
        self.message, self.category = message, category
        self._entry: Optional[tuple[Any, ...]] = None
        _FILTERS.append(self)

    def matches(self, entry: tuple[Any, ...]) -> bool:
        """Whether `entry` of `warnings.filters` is this filter."""
        action, message, category = entry[:3]
        return action == "ignore" and category is self.category and getattr(message, "pattern", None) == self.message

    def install(self) -> None:
        warnings.filterwarnings("ignore", message=self.message, category=self.category)
        self._entry = warnings.filters[0]

    def remove(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None and entry in warnings.filters:
            warnings.filters.remove(entry)  # type: ignore[attr-defined]  # a list at run time
            warnings._filters_mutated()  # type: ignore[attr-defined]  # what filterwarnings does after a change


class Once:
    """What was said already: `once(key)` is True the first time for `key`, False after.

    Every "say this only once" of hookpolicy goes through one of these. `limit` bounds
    the keys kept where a caller does not choose them (an error's text): past it,
    nothing more is said. `forget(key)` lets `key` be said again (a condition that ended).
    """

    def __init__(self, limit: Optional[int] = None) -> None:
        self._keys: set[object] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def __call__(self, key: object = None) -> bool:
        with self._lock:
            if key in self._keys or (self._limit is not None and len(self._keys) >= self._limit):
                return False
            self._keys.add(key)
            return True

    def forget(self, key: object) -> None:
        with self._lock:
            self._keys.discard(key)


_COLLECTING = [False]  # whether the collector ran when the first pause began


def _pause_collector() -> None:
    _COLLECTING[0] = gc.isenabled()
    gc.disable()


def _resume_collector() -> None:
    if _COLLECTING[0]:
        gc.enable()


_PAUSED = Shared("the cyclic garbage collector paused", _pause_collector, _resume_collector)


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused inside (nested and threaded uses share one pause).

    Planning and installing on a large model make tens of thousands of objects, none of
    them garbage: each 700 allocations start a collection, and the older generations'
    ones walk the whole model (10,001 modules: about half of an attach's time). Reference
    counting still frees everything meanwhile; only cycles wait for the next collection.
    """
    _PAUSED.acquire()
    try:
        yield
    finally:
        _PAUSED.release()


def start_thread(name: str, target: Callable[[], None]) -> threading.Thread:
    """A daemon thread named `hookpolicy-<name>` running `target` (made, not started)."""
    return threading.Thread(target=target, name=THREAD_PREFIX + name, daemon=True)


def snapshot() -> dict[str, object]:
    """Everything of the process hookpolicy may change, read back from the process itself.

    Equal before an attach and after its last `remove()`: that is the promise.
    """
    state: dict[str, object] = {
        "users": {shared.name: shared.users for shared in _SHARED if shared.users},
        "warnings filters": [entry for entry in warnings.filters if any(f.matches(entry) for f in _FILTERS)],
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)),
        "garbage collector enabled": gc.isenabled(),
    }
    module = sys.modules.get("torch.nn.modules.module")
    if module is not None:
        state["nn.Module.__reduce_ex__"] = module.Module.__dict__.get("__reduce_ex__")
        state["module hooks"] = tuple(len(getattr(module, name)) for name in (
            "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
            "_global_backward_pre_hooks", "_global_backward_hooks",
            "_global_module_registration_hooks", "_global_parameter_registration_hooks",
            "_global_buffer_registration_hooks",
        ))
    for name, kind in (("torch.optim.lr_scheduler", "LRScheduler"), ("torch.amp.grad_scaler", "GradScaler")):
        found = sys.modules.get(name)
        if found is not None:
            cls = getattr(found, kind)
            state[f"{kind}.__init__, __init_subclass__"] = (cls.__dict__.get("__init__"),
                                                            cls.__dict__.get("__init_subclass__"))
    autograd = sys.modules.get("torch.autograd")
    if autograd is not None:  # the loss tap's patches
        state["torch.autograd.backward"] = autograd.backward
    scaler = sys.modules.get("torch.amp.grad_scaler")
    if scaler is not None:
        state["GradScaler.scale"] = scaler.GradScaler.__dict__.get("scale")
    optimizer = sys.modules.get("torch.optim.optimizer")
    if optimizer is not None:
        state["optimizer step hooks"] = (
            len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks),
        )
    return state
