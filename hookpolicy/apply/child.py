"""The child side of `hookpolicy apply`: what every Python process of COMMAND runs.

`bootstrap()` runs right after the process has imported torch (`_bootstrap/sitecustomize.py`
arranges it). It reads what `apply` asked for from the environment (`environment.ChildConfig`), loads
the policies named by HOOKPOLICY_POLICIES, and starts a `_Session`: a `Discovery` that
attaches them to each model the script trains, the metrics endpoint (at the first governed
model), the reload watcher, the signal handlers (SIGTERM unwinds like Ctrl-C; SIGHUP
reloads) and the halt line left for the parent, which exits 3 with it.

Reload (`--watch`, SIGHUP, or the run folder's `reload` file): `Reloader` re-reads and
validates changed policy files on a background thread; a valid new version goes to
`Discovery.request_swap`, which swaps it in between two steps; an invalid one is reported
on stderr and the old one stays.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import zlib
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Optional, Sequence

import torch
from prometheus_client import CollectorRegistry

from ..api import PolicySet
from .discovery import RELOAD_GAUGE, Discovery, say
from ..environment import ChildConfig
from ..errors import Halt, PolicyError
from ..export.exporter import serve
from ..policy.sources import expand_sources, load_sources
from ..export.metrics import store_for
from ..engine.runtime import Attached

__all__ = ["Reloader", "bootstrap"]


class Reloader:
    """Re-reads the policy files off the training thread when they change or on request.

    With `watch`, a change of any policy file (or of a policy folder's listing) triggers a
    reload; `request()` (SIGHUP) and a bump of the run folder's `reload` file always do.
    """

    def __init__(
        self, config: ChildConfig, discovery: Discovery, *,
        fingerprint: Optional[tuple[Any, ...]] = None,
    ) -> None:
        self.config = config
        self.discovery = discovery
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._requested = False
        self._files = fingerprint if fingerprint is not None else _fingerprint(config.sources)
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
        files = _fingerprint(self.config.sources)
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


def _fingerprint(sources: Sequence[str]) -> tuple[Any, ...]:
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


class _Session:
    """Everything `bootstrap` sets up in one process, torn down once at exit."""

    def __init__(self, config: ChildConfig, policies: PolicySet, fingerprint: tuple[Any, ...]) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.discovery = Discovery(
            policies, registry=self.registry, rank=config.rank, audit=config.audit, on_govern=self._governed,
            on_halt=self._record_halt,
        )
        self.reloader = Reloader(config, self.discovery, fingerprint=fingerprint)
        self._started = False
        self._previous_excepthook = sys.excepthook

    def start(self) -> None:
        self.discovery.install()
        sys.excepthook = self._excepthook
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _exit_on_signal)
            if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
                signal.signal(signal.SIGHUP, lambda signum, frame: self.reloader.request())

    def close(self) -> None:
        """At exit (normal, Ctrl-C, SIGTERM, halt): detach everything, which flushes the logs."""
        self.reloader.stop()
        self.discovery.remove()

    def _governed(self, module: torch.nn.Module, attached: Attached) -> None:
        bindings = len(attached.plan.bindings)
        names = ", ".join(p.name for p in attached.policies)
        say(f"governing {type(module).__name__} (rank {self.config.rank}, pid {os.getpid()}): "
             f"{bindings} binding(s) of {names}")
        if self._started:
            return
        self._started = True
        if self.config.run_dir is not None:
            try:
                Path(self.config.run_dir, f"governed-{os.getpid()}").touch()
            except OSError:
                pass
        if self.config.metrics_port is not None:
            serve(self.registry, self.config.metrics_port + self.config.local_rank,
                  self.config.metrics_addr, rank=self.config.rank)
        self.reloader.start()

    def _excepthook(
        self, kind: type[BaseException], value: BaseException, tb: Optional[TracebackType],
    ) -> None:
        if not isinstance(value, Halt):
            self._previous_excepthook(kind, value, tb)
            return
        if not self._record_halt(value):
            sys.stderr.write(value.line() + "\n")

    def _record_halt(self, halt: Halt) -> bool:
        """Leave the halt line for the parent, which exits 3 with it; False if it could not."""
        return self.config.run_dir is not None and _write_once(Path(self.config.run_dir, "halt"), halt.line())


def _write_once(path: Path, line: str) -> bool:
    """Write `line` to `path` unless another process did first; False if it could not write."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return True
    except OSError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(line + "\n")
    return True


def _exit_on_signal(signum: int, frame: Optional[FrameType]) -> None:
    """SIGTERM: unwind like Ctrl-C does, so `finally` blocks and atexit (hook removal) run."""
    raise SystemExit(128 + signum)


_SESSION: Optional[_Session] = None


def bootstrap() -> None:
    """Start governing this process (called once, right after it imported torch).

    A policy that no longer validates (changed since `apply` checked it) stops the
    process with status 1 and the problems on stderr: nothing runs ungoverned.
    """
    global _SESSION
    if _SESSION is not None:
        return
    config = ChildConfig.from_env(os.environ)
    if not config.sources:
        return
    fingerprint = _fingerprint(config.sources)
    try:
        policies = PolicySet(load_sources(list(config.sources)))
    except PolicyError as exc:
        sys.stderr.write("".join(f"{p}\n" for p in exc.problems))
        raise SystemExit(1) from None
    _SESSION = _Session(config, policies, fingerprint)
    _SESSION.start()
