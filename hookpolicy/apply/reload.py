"""The reload protocol of `hookpolicy apply`: when policies are re-read, and what a failure does.

`Reloader` re-reads and validates the policy files on a background thread: with `--watch`
when a file's content or a folder's listing changes, and always when asked (SIGHUP, or a
bump of the run folder's `reload` file). A valid new version goes to
`Discovery.request_swap`, which swaps it in between two steps; an invalid one is reported
on stderr and the old one stays.
"""

from __future__ import annotations

import sys
import threading
import zlib
from pathlib import Path
from typing import Any, Optional, Sequence

from ..api import PolicySet
from ..environment import ChildConfig
from ..errors import PolicyError
from ..export.metrics import store_for
from ..policy.sources import expand_sources, load_sources
from .discovery import RELOAD_GAUGE, Discovery, say

__all__ = ["Reloader", "fingerprint"]


class Reloader:
    """Re-reads the policy files off the training thread when they change or on request.

    With `watch`, a change of any policy file (or of a policy folder's listing) triggers a
    reload; `request()` (SIGHUP) and a bump of the run folder's `reload` file always do.
    """

    def __init__(
        self, config: ChildConfig, discovery: Discovery, *,
        files: Optional[tuple[Any, ...]] = None,
    ) -> None:
        self.config = config
        self.discovery = discovery
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._requested = False
        self._files = files if files is not None else fingerprint(config.sources)
        self._trigger = self._read_trigger()
        self._thread = threading.Thread(target=self._loop, name="hookpolicy-reload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def request(self) -> None:
        """Ask for a reload (from a signal handler or any thread)."""
        self._requested = True
        self._wake.set()

    def _read_trigger(self) -> Optional[str]:
        if self.config.run_dir is None:
            return None
        try:
            return Path(self.config.run_dir, "reload").read_text(encoding="utf-8")
        except OSError:
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check()
            except Exception as exc:  # the watcher must never take the training down
                say(f"error: policy reload failed: {type(exc).__name__}: {exc}")

    def check(self) -> None:
        """Reload if asked to or (with watch) if a file changed; report the outcome."""
        trigger = self._read_trigger()
        requested, self._requested = self._requested or trigger != self._trigger, False
        self._trigger = trigger
        files = fingerprint(self.config.sources)
        changed = files != self._files
        self._files = files
        if not requested and not (self.config.watch and changed):
            return
        self.reload(explicit=requested)

    def reload(self, explicit: bool = False) -> None:
        store = store_for(self.discovery.registry, self.discovery.rank)
        try:
            policies = PolicySet(load_sources(list(self.config.sources)))
        except PolicyError as exc:
            self.discovery.reload_ok = False
            store.set(RELOAD_GAUGE, (), 0.0)
            lines = "\n".join(str(p) for p in exc.problems)
            sys.stderr.write(f"hookpolicy: reload failed; keeping the current policies:\n{lines}\n")
            sys.stderr.flush()
            return
        self.discovery.reload_ok = True
        store.set(RELOAD_GAUGE, (), 1.0)
        current = [(p.name, p.revision) for p in self.discovery.policies.policies]
        if [(p.name, p.revision) for p in policies.policies] == current:
            if explicit:
                say("reload: the policies are unchanged")
            return
        self.discovery.request_swap(policies)


def fingerprint(sources: Sequence[str]) -> tuple[Any, ...]:
    """What the policy files look like now: names, and a checksum of each file's bytes.

    Content, not modification times: those can be too coarse to tell two quick saves apart.
    """
    files, _ = expand_sources(list(sources))
    seen: list[Any] = []
    for file in files:
        try:
            seen.append((file, zlib.crc32(Path(file).read_bytes())))
        except OSError:
            seen.append((file, None))
    return tuple(seen)


