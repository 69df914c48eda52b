"""Error containment: a rule's fault is counted, said once, and switches the rule off or halts.

A hook body that raises (`Faults.guarded`) and a sink that cannot write at the read-back
(handed over by the step cycle) are both a fault of their rule: `hookpolicy_hook_errors_total`
counts it, the first one is logged with its traceback, the rule is switched off after
`MAX_ERRORS` (`onError: continue`), and with `onError: halt` it becomes a `Halt` at once.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any, Callable

from ...errors import Halt
from ...export.metrics import HOOK_ERRORS, ModelMetrics
from .ledger import Ledger
from ..measure.rulestate import MAX_ERRORS, RuleState

__all__ = ["Faults"]

log = logging.getLogger("hookpolicy")


class Faults:
    """Contains the faults of one attachment's rules.

    `step()` is the step being evaluated (for messages and halts); `halting(halt)` tells
    the attachment's `on_halt` before a `Halt` propagates; `ledger` gets the time spent.
    """

    def __init__(
        self, store: ModelMetrics, step: Callable[[], int], halting: Callable[[Halt], Halt], ledger: Ledger,
    ) -> None:
        self._store = store
        self._step = step
        self.halting = halting
        self._ledger = ledger

    def step(self) -> int:
        return self._step()

    def guarded(self, rs: RuleState, fn: Any, *args: Any) -> Any:
        """Call a hook body, timing it into the ledger; an exception is contained per the policy's onError."""
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - containment is the point
            self.fail(rs, exc)
            return None
        finally:
            self._ledger.seconds[rs.key] += time.perf_counter() - start

    def fail(self, rs: RuleState, exc: BaseException) -> None:
        """Count an error of `rs`; raise `Halt` (onError: halt) or log it and maybe switch the rule off."""
        rs.errors += 1
        self._store.inc(HOOK_ERRORS, rs.key)
        step = self._step()
        if rs.policy.on_error == "halt":
            raise self.halting(
                Halt(rs.policy.name, rs.rule.name, step, f"hook error: {type(exc).__name__}: {exc}")
            ) from exc
        if rs.errors == 1 and isinstance(exc, OSError):  # a sink that cannot write: the message says it all
            log.error("hookpolicy: %s/%s raised at step %d: %s (logged once; the rule is switched off after %d errors)",
                      *rs.key, step, exc, MAX_ERRORS)
        elif rs.errors == 1:
            log.error(
                "hookpolicy: %s/%s raised at step %d (logged once; the rule is switched off after %d errors):\n%s",
                *rs.key, step, MAX_ERRORS, "".join(traceback.format_exception(exc)).rstrip(),
            )
        if rs.errors == MAX_ERRORS:
            self._store.switch_off(rs.key, f"after {MAX_ERRORS} errors")
            log.error("hookpolicy: %s/%s switched off after %d errors", *rs.key, MAX_ERRORS)
