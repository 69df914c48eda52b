"""The child side of `hookpolicy apply`: what every governed Python process of COMMAND runs.

`bootstrap()` runs right after a process that is to be governed has imported torch
(`_bootstrap/sitecustomize.py` arranges it and decides which processes are). It marks the
environment its own children inherit (HOOKPOLICY_PARENT: a helper it starts by exec with
the same rank is not governed), makes a child it forks inert (see `_Session.forked`), reads what `apply` asked for from the environment (`environment.ChildConfig`), loads
the policies named by HOOKPOLICY_POLICIES, and starts a `_Session`: a `Discovery` that
attaches them to each model the script trains, the metrics endpoint (at the first governed
model), the reload watcher, the signal handlers (SIGTERM unwinds like Ctrl-C; SIGHUP
reloads) and the halt line left for the parent, which exits 3 with it.

Reload (`--watch`, SIGHUP, or the run folder's `reload` file): see `reload`.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Optional

import torch
from prometheus_client import CollectorRegistry

from ..api import PolicySet
from ..say import LOGGER, say
from .discovery import Discovery
from ..environment import ENV_LOCAL_RANK, ENV_PARENT, ChildConfig, rank_identity, run_id
from ..errors import Halt, PolicyError
from ..export.exporter import metrics_url, serve
from ..export.collector import store_for
from ..export.push import push_final
from ..export.textfile import write_final
from ..export.webconfig import WebConfig, WebConfigError, load_web_config
from ..export.sinks import output_root
from ..export.summary import summary_lines
from ..policy.sources import load_sources
from . import lifetime
from .reload import Reloader, fingerprint
from ..engine.runtime import Attached
from ..plan.matcher import model_class

__all__ = ["Reloader", "bootstrap"]


class _Session:
    """Everything `bootstrap` sets up in one process, torn down once at exit."""

    def __init__(self, config: ChildConfig, policies: PolicySet, files: tuple[Any, ...]) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.discovery = Discovery(
            policies, registry=self.registry, rank=config.rank, audit=config.audit, strict=config.strict,
            on_govern=self._governed,
            on_halt=self._record_halt,
        )
        self.reloader = Reloader(config, self.discovery.swaps, registry=self.registry, files=files)
        self._started = False
        self._metrics: Optional[str] = None  # the URL this process serves its metrics on
        self._no_metrics = "no --metrics-port"  # why it serves none, for the run summary
        self._previous_excepthook = sys.excepthook

    def start(self) -> None:
        _warnings_as_hookpolicy_lines()
        self.discovery.install()
        sys.excepthook = self._excepthook
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _exit_on_signal)
                lifetime.end_if_stuck(_exit_on_signal)
            if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
                signal.signal(signal.SIGHUP, lambda signum, frame: self.reloader.request())

    def close(self) -> None:
        """At exit (normal, Ctrl-C, SIGTERM, halt): push the final series (`--push-gateway`), write them for
        node_exporter (`--textfile-dir`), detach
        everything, which flushes the logs; say the summary."""
        self.reloader.stop()
        if self._started and self.config.push_gateway is not None:
            said = push_final(self.registry, self.config.push_gateway, job=self.config.push_job,
                              rank=self.discovery.rank, run=run_id(os.environ))
            say(said)
        if self._started and self.config.textfile_dir is not None:
            say(write_final(self.registry, self.config.textfile_dir, rank=self.discovery.rank, run=run_id(os.environ)))
        self.discovery.remove()
        if self._started and self.discovery.rank == 0:
            self._summary()

    def _summary(self) -> None:
        """The run summary (`export.summary`) of rank 0: the other ranks' counts are in their own metrics."""
        try:
            policies = self.discovery.swaps.current()[0].policies
            for line in summary_lines(store_for(self.registry, self.discovery.rank), policies, metrics=self._metrics,
                                      root=output_root(), no_metrics=self._no_metrics):
                say(line)
        except Exception as exc:  # noqa: BLE001 - a summary must not turn a clean exit into a traceback
            say(f"no run summary: {type(exc).__name__}: {exc}")

    def forked(self) -> None:
        """In a child forked from this process (`os.fork`, a fork DataLoader worker): be inert.

        The child is not governed: it discovers no model, flushes nothing at its exit (the
        parent's pending step is the parent's to write), and dies of SIGTERM as it would
        without hookpolicy. The exporter closes its listening socket by itself
        (`exporter.py`); the reload watcher's thread did not survive the fork.
        """
        atexit.unregister(self.close)
        self.discovery.forget()
        if signal.getsignal(signal.SIGTERM) is _exit_on_signal:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _governed(self, module: torch.nn.Module, attached: Attached) -> None:
        bindings = len(attached.plan.bindings)
        names = ", ".join(p.name for p in attached.policies)
        say(f"governing {attached.store.model} (rank {attached.rank}, pid {os.getpid()}): "
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
            # LOCAL_RANK, else the rank (the process group's: a torch.multiprocessing.spawn
            # rank has neither variable), so that each rank of a node has a port of its own
            local = self.config.local_rank if ENV_LOCAL_RANK in os.environ else attached.rank
            port = self.config.metrics_port + local
            web = None if self.config.web_config is None else self._web_config(attached.rank)
            exporter = None
            if self.config.web_config is not None and web is None:
                self._no_metrics = f"--web-config {self.config.web_config} could not be loaded"
            else:
                exporter = serve(self.registry, port, self.config.metrics_addr, rank=attached.rank, web=web)
                if exporter is None:
                    self._no_metrics = f"--metrics-port {self.config.metrics_port}: port {port} could not be bound"
            if exporter is not None:
                # Said once bound, by the rank that serves: a line before the bind would
                # promise a port that may then be taken.
                self._metrics = metrics_url(self.config.metrics_addr, port, tls=web is not None and web.tls is not None)
                secured = "" if web is None else f" ({web.describe()}, {self.config.web_config})"
                say(f"rank {attached.rank}: metrics on {self._metrics}{secured}")
                lifetime.release_when_orphaned(exporter, f"rank {attached.rank}'s metrics port {port}")
        self.reloader.start()

    def _web_config(self, rank: int) -> Optional[WebConfig]:
        """The `--web-config` to serve with; None (said) when it no longer loads.

        `apply` checked the file before starting COMMAND; one changed since is said, and
        the endpoint is not served at all rather than served open.
        """
        try:
            return load_web_config(str(self.config.web_config))
        except WebConfigError as exc:
            say(f"rank {rank}: not serving metrics: --web-config {self.config.web_config} no longer secures the "
                f"endpoint ({'; '.join(str(p) for p in exc.problems)}); training continues without metrics")
            return None

    def _excepthook(
        self, kind: type[BaseException], value: BaseException, tb: Optional[TracebackType],
    ) -> None:
        if not isinstance(value, Halt):
            self._previous_excepthook(kind, value, tb)
            return
        if not self._record_halt(value):
            say(value.line())

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
    """SIGTERM: unwind like Ctrl-C does, so `finally` blocks and atexit (hook removal) run.

    When the main thread cannot run this (it waits in a collective), `lifetime` ends the
    process instead. Inside `torch.save`, unwinding would let the zip writer's `__exit__`
    finish a checkpoint whose records stop half-way: a valid zip that does not load, which
    resume logic trusting "a valid zip" would pick. There the signal does what it does
    without hookpolicy: the process dies at once, and the file is plainly truncated.
    """
    if _inside(frame, _SAVING):
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    lifetime.unwinding.set()
    _expect_workers_to_die()
    raise SystemExit(128 + signum)


def _expect_workers_to_die() -> None:
    """The DataLoader workers got the same SIGTERM (`apply` signals the whole group): no error.

    PyTorch's SIGCHLD handler raises "DataLoader worker ... is killed by signal" when a
    worker dies of a signal; raised while the script unwinds, it printed a 21-line
    traceback from `DataLoader.__del__` on every SIGTERM (without hookpolicy the process
    died at once and printed nothing). Only PyTorch's handler is replaced, and by a Python
    handler that does nothing, not by SIG_DFL: a SIGCHLD that arrived while PyTorch's was in
    place and that Python has not run yet would find no Python handler and print "OSError:
    Signal 17 ignored due to race condition" (2 runs in 3 with `forkserver` workers, whose
    server also dies of the SIGTERM).
    """
    handler = signal.getsignal(signal.SIGCHLD)
    if getattr(handler, "__module__", None) == _DATALOADER_SIGNALS:
        signal.signal(signal.SIGCHLD, _no_error)


def _no_error(signum: int, frame: Optional[FrameType]) -> None:
    """SIGCHLD while the script unwinds: a worker died of the same signal, as expected."""


#: The module of PyTorch's SIGCHLD handler for DataLoader workers.
_DATALOADER_SIGNALS = "torch.utils.data._utils.signal_handling"


#: The file whose functions write checkpoints (`torch.save` and the zip writer it uses).
_SAVING = os.path.normcase(os.path.abspath(torch.serialization.__file__))


def _inside(frame: Optional[FrameType], filename: str) -> bool:
    """Whether a function of `filename` is on the stack from `frame` outwards."""
    while frame is not None:
        if os.path.normcase(os.path.abspath(frame.f_code.co_filename)) == filename:
            return True
        frame = frame.f_back
    return False


_SESSION: Optional[_Session] = None


def _warnings_as_hookpolicy_lines() -> None:
    """Keep hookpolicy's lines to the one `hookpolicy:` channel of `say.py` in a governed process.

    `say`'s handler already prints every record of the `hookpolicy` logger; not propagating
    them means a script that configures logging (`basicConfig`) does not print them twice.
    """
    LOGGER.propagate = False


def bootstrap(*call: Any) -> None:
    """Start governing this process (called once, right after it imported torch).

    `call` is `(module, args)` when it starts inside a module call (a rank of
    `torch.multiprocessing.spawn`, see `_bootstrap/sitecustomize.py`): discovery sees that
    call as its own, so the model's first step is governed.

    A policy that no longer validates (changed since `apply` checked it) stops the
    process with status 1 and the problems on stderr: nothing runs ungoverned.
    """
    global _SESSION
    if _SESSION is not None:
        return
    config = ChildConfig.from_env(os.environ)
    if not config.sources:
        return
    os.environ[ENV_PARENT] = rank_identity(os.environ)
    files = fingerprint(config.sources)
    try:
        policies = PolicySet(load_sources(list(config.sources)))
    except PolicyError as exc:
        for problem in exc.problems:
            say(str(problem))
        raise SystemExit(1) from None
    _SESSION = _Session(config, policies, files)
    os.register_at_fork(after_in_child=_forked)
    _SESSION.start()
    if call:
        _SESSION.discovery.call(*call)


def _forked() -> None:
    if _SESSION is not None:
        _SESSION.forked()
