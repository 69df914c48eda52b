"""hookpolicy's part of each patch of torch, contained: the original runs untouched, a fault of ours never reaches the script.

Every place hookpolicy patches torch (`hookpolicy/process.py` lists them) calls the original
as it was called and keeps its own part apart from it. When that part raises, the fault
goes to its owner, the same containment as a hook body (`execute/programs.Faults`):

- an attachment's part (the step cycle behind the optimizer step hooks and the model's
  root hooks, a loss tap behind `torch.autograd.backward` and `GradScaler.scale`, the tree
  watch behind the registration hooks) implements `Owner.fault`: the fault is counted in
  `hookpolicy_hook_errors_total` for each rule it served, said once with its traceback, the
  rules are switched off after 3, and under `onError: halt` it is a `hookpolicy.Halt`,
  raised once the original call has returned;
- a process-wide part with no policy behind it (the scheduler constructors' note, the
  copy filter of `nn.Module.__reduce_ex__`, apply's discovery) is a `Part`: said once
  with its traceback, switched off after `MAX_FAULTS` (the patch then only calls through).

A `Halt` is no fault: it is how a rule stops the run, and it propagates.
"""

from __future__ import annotations

import logging
import threading
import traceback
import weakref
from typing import Callable, Iterable, Optional, Protocol

__all__ = ["MAX_FAULTS", "Owner", "Part", "each_contained", "fault_of", "switched_off"]

log = logging.getLogger("hookpolicy")

#: A part that raised this many times is switched off (the rules' `MAX_ERRORS` is the same 3).
MAX_FAULTS = 3


class Owner(Protocol):
    """What a patch hands a fault of hookpolicy's part done for this owner (its rules')."""

    def fault(self, where: str, exc: Exception) -> None:
        """Count, say once, switch off; raise `Halt` under `onError: halt`. `where` names the patched entry point."""


class Part:
    """One process-wide part of a patch: counted here, said once, switched off after `MAX_FAULTS`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.faults = 0
        self._lock = threading.Lock()
        _PARTS.add(self)

    @property
    def off(self) -> bool:
        return self.faults >= MAX_FAULTS

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.faults += 1
            faults = self.faults
        if faults == 1:
            log.error("hookpolicy: %s raised (hookpolicy's own fault; the call it wraps went on untouched; logged "
                      "once, switched off after %d):\n%s", self.name, MAX_FAULTS,
                      "".join(traceback.format_exception(exc)).rstrip())
        if faults == MAX_FAULTS:
            log.error("hookpolicy: %s switched off after %d faults: the patched call only calls through now",
                      self.name, MAX_FAULTS)


#: every `Part` alive (a subscriber's goes with its subscription)
_PARTS: "weakref.WeakSet[Part]" = weakref.WeakSet()


def switched_off() -> list[str]:
    """The names of the parts alive that are switched off: for the rest of the process, each patch calls through."""
    return sorted(part.name for part in list(_PARTS) if part.off)


def fault_of(owner: object, where: str, exc: Exception, part: Optional[Part] = None) -> None:
    """Hand `exc` to `owner.fault` if it has one, else to `part` (may raise `Halt`)."""
    fault = getattr(owner, "fault", None)
    if callable(fault):
        fault(where, exc)
    elif part is not None:
        part.failed(exc)


def each_contained(steps: Iterable[tuple[str, Callable[[], object]]]) -> None:
    """Run every `(what, step)` of a detach, each contained: a fault of one (hookpolicy's own) is said with its
    traceback, and the steps after it still run, so a detach takes out all it can and never raises. A `Halt` of a
    step that reads back is the caller's to turn into a line before it gets here."""
    for what, step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - hookpolicy's own fault: never out of a detach
            log.error("hookpolicy: %s raised while detaching (hookpolicy's own fault; the rest was taken off):\n%s",
                      what, "".join(traceback.format_exception(exc)).rstrip())
