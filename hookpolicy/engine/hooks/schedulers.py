"""The LR schedulers and GradScalers alive in the process, known from their construction, not a heap scan.

A snapshot for `then: rewind` keeps the state of every LR scheduler and GradScaler that
goes with the model's optimizers (`snapshots`). PyTorch keeps no list of them, and a
scheduler leaves no mark on its optimizer that tells a second one from the first (read in
torch 2.13's `optim/lr_scheduler.py`): `LRScheduler.__init__` wraps `optimizer.step` only
if no scheduler wrapped it before (`_wrapped_by_lr_sched`), sets `initial_lr` with
`setdefault`, and `ReduceLROnPlateau` does neither; a GradScaler knows an optimizer by its
`id` only while it steps it. The optimizer's reference count moves with every holder (the
script's variables, a framework's wrappers), so a warm-up scheduler replaced by a cosine
one while another holder let go would look like no change. Without a scan, the one sound
way to know them all is to see each one made:

while someone holds a `watch()`, the `__init__` of `LRScheduler`, of `GradScaler` and of
each subclass that defines its own notes the object it made (weakly: a dropped one leaves
the list and is not kept alive), and the two classes' `__init_subclass__` does the same
to the classes defined later. One heap scan (`heap.live_of`) when the first watcher
comes finds those made before; `alive()` is then exact at the cost of a list copy.

Not seen: an object made without its class's `__init__` (unpickled, deep-copied: its
optimizer is a copy too, unless the script then points it at a governed one), and, among
the classes defined while watched, one below a class whose own `__init_subclass__` does
not call its base's. `__new__` is not the place: once set on a class, CPython cannot take
it off again (the class keeps the slot that calls `__new__`, and `object.__new__` then
refuses the constructor's arguments), so the process could not be given back as it was.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from ... import process
from .contain import Part
from .heap import live_of

__all__ = ["Watch", "alive", "kinds", "watch"]


def kinds() -> tuple[type, type]:
    """The two classes whose objects (subclasses' included) are noted."""
    return (torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


class Watch:
    """One watcher's share of the wrapped constructors; `remove()` gives it back (safe twice)."""

    def __init__(self) -> None:
        self._held = True
        _MADE.acquire()

    def remove(self) -> None:
        if self._held:
            self._held = False
            _MADE.release()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def watch() -> Watch:
    """Note every LR scheduler and GradScaler from now on (and find those alive now) until `remove()`."""
    return Watch()


def alive() -> list[Any]:
    """Every LR scheduler and GradScaler alive in the process, while a `watch()` is held (else nothing)."""
    return _MADE.alive()


class _Made:
    """The one owner of the wrapped `__init__`s and `__init_subclass__`es, and of the objects they noted."""

    def __init__(self) -> None:
        self._alive: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        #: held while the wrappers go in or out and while one is added (a class defined on another thread is
        #: wrapped entirely before they go out, or not at all); an RLock: a finalizer the collector runs inside
        #: note() may make another scheduler
        self._lock = threading.RLock()
        self._on = False
        self._inits: list[tuple[type, Callable[..., None], Callable[..., None]]] = []  # (class, its __init__, ours)
        self._subclassing: list[tuple[type, Optional[Any], Any]] = []  # (root, its __init_subclass__, ours)
        self._shared = process.Shared("LRScheduler and GradScaler construction (then: rewind)",
                                      self._install, self._uninstall)

    def acquire(self) -> None:
        self._shared.acquire()

    def release(self) -> None:
        self._shared.release()

    def alive(self) -> list[Any]:
        with self._lock:
            return list(self._alive.values())

    def note(self, made: Any) -> None:
        with self._lock:
            if self._on:  # not through a wrapper another library wrapped again and left in place
                self._alive[id(made)] = made

    def _install(self) -> None:
        with self._lock:
            try:
                self._on = True
                for root in kinds():
                    self._hook_subclasses(root)
                    tree: list[type] = [root]
                    for cls in tree:  # grows while walked: each class's subclasses after it
                        tree += cls.__subclasses__()
                        self._wrap(cls)
                for made in live_of(*kinds()):  # those made before: the one heap scan, after the wrappers are in
                    self.note(made)
            except BaseException:  # every wrapper, or none (`_uninstall` takes out those put in)
                self._uninstall()
                raise

    def _uninstall(self) -> None:
        with self._lock:
            self._on = False
            for root, theirs, ours in self._subclassing:
                if root.__dict__.get("__init_subclass__") is ours:
                    if theirs is None:
                        delattr(root, "__init_subclass__")
                    else:
                        setattr(root, "__init_subclass__", theirs)
            for cls, init, wrapped in self._inits:
                if cls.__dict__.get("__init__") is wrapped:  # one another library wrapped again stays, calling through
                    setattr(cls, "__init__", init)
            self._subclassing.clear()
            self._inits.clear()
            self._alive.clear()

    def _wrap(self, cls: type) -> None:
        """`cls.__init__`, if `cls` defines its own, noting the object it made once it is made."""
        with self._lock:
            init = cls.__dict__.get("__init__")
            if not self._on or not callable(init) or any(c is cls for c, _, _ in self._inits):
                return
            self._inits.append((cls, init, self._noting(init)))
            setattr(cls, "__init__", self._inits[-1][2])

    def _noting(self, init: Callable[..., None]) -> Callable[..., None]:
        """`init`, then the object it made noted (functools.wraps: the class's signature stays its own)."""
        note = self.note

        @functools.wraps(init)
        def __init__(made: Any, *args: Any, **kwargs: Any) -> None:
            init(made, *args, **kwargs)
            if _PART.off:
                return
            try:
                note(made)
            except Exception as exc:  # noqa: BLE001 - hookpolicy's part: the object is made as the script made it
                _PART.failed(exc)
        return __init__

    def _hook_subclasses(self, root: type) -> None:
        """`root.__init_subclass__` wraps each class defined below `root` from now on (after its own, if any)."""
        theirs = root.__dict__.get("__init_subclass__")
        wrap = self._wrap

        def __init_subclass__(cls: type, /, **kwargs: Any) -> None:
            if theirs is not None:
                theirs.__get__(None, cls)(**kwargs)
            else:
                super(root, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]
            if _PART.off:
                return
            try:
                wrap(cls)
            except Exception as exc:  # noqa: BLE001 - hookpolicy's part: the class is defined as without it
                _PART.failed(exc)

        ours: Any = classmethod(__init_subclass__)
        self._subclassing.append((root, theirs, ours))
        setattr(root, "__init_subclass__", ours)


#: the wrappers' own part (noting an object made, wrapping a class defined): said once, off after 3 faults
_PART = Part("the note of LR schedulers and GradScalers being made (then: rewind)")
_MADE = _Made()
