"""How a governed process ends: SIGTERM while the main thread is stuck, and a launcher that died.

**SIGTERM.** Without hookpolicy, SIGTERM kills a rank at once (its default action). Under
`apply` the rank unwinds instead, so that `finally` blocks and the exit handlers remove
the hooks and flush the logs (`child._exit_on_signal`). But Python runs a signal handler
only when the main thread is back in the interpreter, and a rank waiting in a collective
is not, until the collective ends: its peers, told to stop too, never complete it. torchrun
then waits its grace period (30 s) and kills the ranks with SIGKILL, and the job takes
30 s to end instead of a fraction of one. `end_if_stuck` keeps the unwinding where it
can happen and the default's speed where it cannot: the C side of Python's handler writes
the signal's number to a pipe (`signal.set_wakeup_fd`) on any thread; a watcher thread
reads it, and if the main thread has not started unwinding within UNWIND_GRACE seconds,
ends the process with 128 + SIGTERM, as the shell reports a death by SIGTERM. A script
that installed its own SIGTERM handler decides itself: the watcher then does nothing.

**The launcher's death.** A rank started by a launcher (torchrun) outlives it when the
launcher is killed with SIGKILL: it keeps its metrics port, a restarted job on that node
cannot bind it, and the dashboards show the orphan. `release_when_orphaned` watches the
parent process; once it is gone (the rank was re-parented), the metrics endpoint closes
and releases its port, and the rank says so. The training itself is left as it is.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable, Optional

from ..export.exporter import Exporter
from ..process import start_thread
from ..say import say

__all__ = ["UNWIND_GRACE", "ORPHAN_POLL", "end_if_stuck", "unwinding", "release_when_orphaned"]

#: Seconds the main thread has, after SIGTERM, to start unwinding before the process ends without it.
UNWIND_GRACE = 0.5
#: Seconds between two looks at whether the parent process is still there.
ORPHAN_POLL = 1.0

#: Set by the SIGTERM handler when it runs, i.e. when the main thread started unwinding.
unwinding = threading.Event()

Handler = Callable[[int, Optional[FrameType]], object]


def end_if_stuck(handler: Handler) -> bool:
    """Watch for SIGTERM while `handler` is this process's handler for it; False if it cannot watch.

    Call from the main thread, after installing `handler`. It cannot when the process
    already has a wakeup fd (an asyncio loop in the main thread): then a stuck main thread
    still waits for its launcher's SIGKILL, as before.
    """
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(read)
        os.close(write)
        return False
    if previous != -1:  # someone else's: leave it theirs
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return False
    os.register_at_fork(after_in_child=_forget_in_child)
    pid = os.getpid()
    start_thread("sigterm", lambda: _watch(read, handler, pid)).start()
    return True


def _forget_in_child() -> None:
    """A forked child shares the pipe: its signals must not wake the parent's watcher."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass


def _watch(read: int, handler: Handler, pid: int) -> None:
    while True:
        try:
            got = os.read(read, 64)
        except OSError:
            return
        if not got:
            return
        if signal.SIGTERM not in got or os.getpid() != pid or signal.getsignal(signal.SIGTERM) is not handler:
            continue
        if unwinding.wait(UNWIND_GRACE):
            return
        try:
            sys.stderr.write("hookpolicy: SIGTERM while the main thread waits outside Python (a collective?): "
                             "exiting now, without flushing\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(128 + signal.SIGTERM)


def release_when_orphaned(exporter: Exporter, what: str) -> threading.Thread:
    """Close `exporter` once the parent of this process has exited (it was re-parented); say `what` was released."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL)
        exporter.shutdown()
        exporter.server_close()
        say(f"the process that started this one (pid {parent}) is gone: {what} released")

    thread = start_thread("orphan", watch)
    thread.start()
    return thread
