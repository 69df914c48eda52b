"""The garbage collector's share of an operation, told apart from the operation's own CPU time."""

from __future__ import annotations

import gc
import time

__all__ = ["Collector"]


class Collector:
    """CPU time (`time.thread_time`) and full collections of the garbage collector, from now to `close()`.

    A full collection walks every object of the process (a 10,001-module model is about
    344,000 of them, and an attached policy's runtime as many again) and comes when the
    objects that survived since the last one exceed a quarter of those it kept: an
    operation that makes many objects (a save, a copy) pays one now and then, so its
    timings are told apart from the collector's.
    """

    def __init__(self) -> None:
        self.spent = 0.0
        self.full = 0
        self._start = 0.0
        gc.callbacks.append(self._called)

    def _called(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
            return
        self.spent += time.thread_time() - self._start
        self.full += info["generation"] == 2

    def close(self) -> None:
        gc.callbacks.remove(self._called)
