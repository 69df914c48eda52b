"""The child side of `hookpolicy apply`: find the models a script trains and govern them.

`bootstrap()` runs in every Python process of an `apply` COMMAND right after that process
has imported torch (`_bootstrap/sitecustomize.py` arranges it). It loads the policies
named by HOOKPOLICY_POLICIES and lets `Discovery` attach them to each model the script
trains, without a line of the script changed:

1. A module called through `__call__` while grad mode is on, that has parameters
   requiring grad and is not inside an already governed model, is governed at that call,
   before its forward runs, so the first step is governed too. Modules called from its
   forward are inside it and are skipped with one dict lookup.
2. If optimizers exist at that moment, one of them must hold one of its parameters (a
   target network run with grad on but never stepped is left alone). With no optimizer
   yet (manual SGD, or an optimizer made after a first forward) the module is governed.
3. A candidate that contains governed models replaces them: they are detached and the
   bigger model is attached, keeping the step count.
4. At an optimizer's first step, parameters it holds that no governed model owns, or
   that are spread over several governed models (a script that calls `model.forward(x)`
   directly, so only the children were seen), are traced to the outermost module owning
   them (one scan of the heap), which is governed at the next module call; for the
   loose parameters, that first step is not governed.
5. The global forward pre-hook is removed once every parameter of every optimizer that
   stepped belongs to a governed model (it costs a little on every module call); it
   comes back when an optimizer steps parameters nobody governs, or to swap in a reloaded
   policy. Without optimizers (manual SGD) it stays.

Reload (`--watch`, SIGHUP): a background thread re-reads and validates changed policy
files off the training thread; a valid new version is swapped in at the first module
call of a governed model after a step boundary (noticed at an optimizer step's end, or
at a call, then waiting for the model's step counter to move), never between the
micro-batches of one step; an invalid one is reported on stderr and the old one stays.

The traps: hooks here are global state of the process (like every
`register_module_*` hook); PyTorch iterates the global optimizer hooks while it calls
them, so nothing in this module attaches or detaches from inside an optimizer hook.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from prometheus_client import CollectorRegistry
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .api import PolicySet
from .errors import Halt, PolicyError
from .exporter import serve
from .launch import (
    ENV_AUDIT, ENV_METRICS_ADDR, ENV_METRICS_PORT, ENV_POLICIES, ENV_RUN_DIR, ENV_WATCH,
    ENV_WATCH_INTERVAL,
)
from .loader import expand_sources, load_sources
from .metrics import store_for
from .runtime import Attached

__all__ = ["ChildConfig", "Discovery", "Reloader", "bootstrap"]

RELOAD_GAUGE = "hookpolicy_config_last_reload_successful"


def _say(message: str) -> None:
    sys.stderr.write(f"hookpolicy: {message}\n")
    sys.stderr.flush()


@dataclass(frozen=True)
class ChildConfig:
    """What `apply` asked of this process, read from the environment (see `hookpolicy.launch`)."""

    sources: tuple[str, ...]
    audit: bool = False
    watch: bool = False
    interval: float = 1.0
    metrics_port: Optional[int] = None
    metrics_addr: str = "127.0.0.1"
    run_dir: Optional[str] = None
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "ChildConfig":
        def number(name: str) -> Optional[int]:
            value = environ.get(name, "")
            return int(value) if value.strip().isdigit() else None

        try:
            interval = float(environ.get(ENV_WATCH_INTERVAL) or 1.0)
        except ValueError:
            interval = 1.0
        local_rank = number("LOCAL_RANK")
        rank = number("RANK")
        return cls(
            sources=tuple(s for s in environ.get(ENV_POLICIES, "").split(os.pathsep) if s),
            audit=bool(environ.get(ENV_AUDIT)),
            watch=bool(environ.get(ENV_WATCH)),
            interval=max(interval, 0.05),
            metrics_port=number(ENV_METRICS_PORT),
            metrics_addr=environ.get(ENV_METRICS_ADDR) or "127.0.0.1",
            run_dir=environ.get(ENV_RUN_DIR) or None,
            rank=rank if rank is not None else (local_rank or 0),
            local_rank=local_rank or 0,
        )


@dataclass
class _Governed:
    """One governed model: its attachment and the policy generation it runs."""

    model: torch.nn.Module
    attached: Attached
    generation: int
    swap_after: Optional[int] = None  # a newer generation waits for a step beyond this one


class Discovery:
    """Finds the models a script trains and keeps the policies attached to them.

    `install()` puts three process-wide hooks in place; `remove()` detaches everything
    and takes them off again (safe to call twice). See the module docstring for the rules.
    """

    def __init__(
        self, policies: PolicySet, *, registry: CollectorRegistry, rank: int, audit: bool = False,
        on_govern: Optional[Callable[[torch.nn.Module, Attached], None]] = None,
        on_halt: Optional[Callable[[Halt], object]] = None,
    ) -> None:
        self.policies = policies
        self._on_halt = on_halt
        self.registry = registry
        self.rank = rank
        self.audit = audit
        self.reload_ok = True
        self._on_govern = on_govern
        self._generation = 0
        self._swap_lock = threading.Lock()
        self._next: Optional[tuple[int, PolicySet]] = None
        self._roots: dict[int, _Governed] = {}
        self._inside: dict[int, int] = {}  # id of every module of a governed model -> id of its root
        self._covered: dict[int, int] = {}  # id of every parameter of a governed model -> id of its root
        self._plain: dict[int, "weakref.ref[torch.nn.Module]"] = {}  # modules without parameters
        self._rejected: dict[int, "weakref.ref[torch.nn.Module]"] = {}  # not stepped by any optimizer
        self._pending: list["weakref.ref[torch.nn.Module]"] = []  # found at a step, governed at the next call
        self._checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
        self._warned_orphans = False
        self._forward: Optional[RemovableHandle] = None
        self._step_handles: list[RemovableHandle] = []
        self._removed = False

    # -- public ------------------------------------------------------------------------
    @property
    def governed(self) -> list[_Governed]:
        return list(self._roots.values())

    @property
    def watching_calls(self) -> bool:
        """Whether the global forward pre-hook is installed (it is retired once discovery is done)."""
        return self._forward is not None

    def install(self) -> None:
        self._install_forward()
        self._step_handles = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]

    def remove(self) -> None:
        """Detach every governed model and take the global hooks off; safe to call twice."""
        if self._removed:
            return
        self._removed = True
        self._retire_forward()
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()
        for governed in list(self._roots.values()):
            governed.attached.remove()
        self._roots.clear()
        self._inside.clear()
        self._covered.clear()

    def request_swap(self, policies: PolicySet) -> None:
        """Swap `policies` in at each model's next step boundary; callable from any thread."""
        with self._swap_lock:
            self._generation += 1
            self._next = (self._generation, policies)
            self.policies = policies

    def govern(self, module: torch.nn.Module) -> Optional[Attached]:
        """Attach the policies to `module` now (replacing governed models it contains)."""
        modules = [id(m) for m in module.modules()]
        replaced = [self._roots[m] for m in modules if m in self._roots]
        step = max((g.attached.step for g in replaced), default=0)
        for governed in replaced:
            self._release(governed)
        with self._swap_lock:
            policies, generation = self.policies, self._generation
        try:
            attached = self._attach(policies, module, step)
        except Exception as exc:  # a guardrail that cannot attach must not stop training
            _say(f"error: cannot govern {type(module).__name__}: {type(exc).__name__}: {exc}")
            self._rejected[id(module)] = weakref.ref(module)
            return None
        root = id(module)
        self._roots[root] = _Governed(module, attached, generation)
        self._inside.update(dict.fromkeys(modules, root))
        self._covered.update(dict.fromkeys((id(p) for p in module.parameters()), root))
        if self._on_govern is not None:
            self._on_govern(module, attached)
        return attached

    # -- the global forward pre-hook ---------------------------------------------------
    def _on_call(self, module: torch.nn.Module, args: Any) -> None:
        """hook(module, args) -> None: called before every module call while installed."""
        root = self._inside.get(id(module))
        if root is not None:
            if self._next is not None:
                self._maybe_swap(self._roots[root])
            return None
        if self._pending:
            self._govern_pending()
            if id(module) in self._inside:
                return None
        if not torch.is_grad_enabled() or _known(self._plain, module) or _known(self._rejected, module):
            return None
        trainable = False
        has_params = False
        for p in module.parameters():
            has_params = True
            if p.requires_grad:
                trainable = True
                break
        if not has_params:
            self._plain[id(module)] = weakref.ref(module)
            return None
        if not trainable:
            return None
        if not self._stepped_or_no_optimizer(module):
            self._rejected[id(module)] = weakref.ref(module)
            return None
        self.govern(module)
        return None

    def _stepped_or_no_optimizer(self, module: torch.nn.Module) -> bool:
        optimizers = [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]
        if not optimizers:
            return True
        params = {id(p) for p in module.parameters()}
        return any(id(p) in params for o in optimizers for g in o.param_groups for p in g["params"])

    def _govern_pending(self) -> None:
        pending, self._pending = self._pending, []
        for ref in pending:
            module = ref()
            if module is not None and id(module) not in self._roots:
                self.govern(module)

    # -- the global optimizer hooks ----------------------------------------------------
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """hook(optimizer, args, kwargs) -> None: checks that one governed model owns what it steps.

        Parameters nobody governs, or parameters split over several governed models (a
        model whose `forward` was called directly, so its children looked like models),
        send us looking for the outermost module owning them, governed at the next call.
        """
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if self._checked.get(optimizer) == count:
            if self._forward is not None:
                self._maybe_retire_forward()
            return
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        loose = {p for p in params if p not in self._covered}
        roots = {self._covered[p] for p in params if p in self._covered}
        if not loose and len(roots) <= 1:
            self._checked[optimizer] = count
            self._maybe_retire_forward()
            return
        owners = _outermost_owners(params)
        owned = {id(p) for m in owners for p in m.parameters()}
        if loose - owned and not self._warned_orphans:
            self._warned_orphans = True
            _say(
                f"warning: {type(optimizer).__name__} steps {len(loose - owned)} parameter(s) that "
                "belong to no nn.Module; hookpolicy cannot govern them"
            )
        fresh = [
            m for m in owners if id(m) not in self._roots and (
                any(id(p) in loose for p in m.parameters())
                or len(roots & {id(sub) for sub in m.modules()}) > 1
            )
        ]
        if not fresh:
            self._checked[optimizer] = count
            return
        self._checked[optimizer] = -1  # look again at the next step
        self._pending.extend(weakref.ref(m) for m in fresh)
        self._install_forward()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """hook(optimizer, args, kwargs) -> None: a step ends; a pending reload may go in after it.

        Runs before the runtime's own post-hook, so `attached.step` is still the step ending.
        """
        if self._next is None:
            return
        for governed in self._roots.values():
            if governed.generation != self._generation and governed.swap_after is None:
                governed.swap_after = governed.attached.step
        self._install_forward()

    # -- hot-path bookkeeping ----------------------------------------------------------
    def _install_forward(self) -> None:
        if self._forward is None and not self._removed:
            self._forward = register_module_forward_pre_hook(self._on_call)

    def _retire_forward(self) -> None:
        if self._forward is not None:
            self._forward.remove()
            self._forward = None

    def _maybe_retire_forward(self) -> None:
        if self._forward is None or self._pending or not self._roots:
            return
        if any(g.generation != self._generation for g in self._roots.values()):
            return
        if all(count >= 0 for count in self._checked.values()):
            self._retire_forward()

    # -- attaching, detaching, swapping ------------------------------------------------
    def _attach(self, policies: PolicySet, module: torch.nn.Module, step: int) -> Attached:
        attached = policies.attach(module, registry=self.registry, rank=self.rank, audit=self.audit,
                                   start_step=step, on_halt=self._on_halt)
        if not self.reload_ok:
            attached.store.set(RELOAD_GAUGE, (), 0.0)
        return attached

    def _release(self, governed: _Governed) -> None:
        governed.attached.remove()
        root = id(governed.model)
        del self._roots[root]
        self._inside = {m: r for m, r in self._inside.items() if r != root}
        self._covered = {p: r for p, r in self._covered.items() if r != root}

    def _maybe_swap(self, governed: _Governed) -> None:
        """Swap a pending reload in at the first call after a step boundary, never mid-step."""
        if governed.generation == self._generation:
            return
        step = governed.attached.step
        if governed.swap_after is None:
            governed.swap_after = step  # first seen in this step: wait for the next one
        elif step > governed.swap_after:
            self._swap(governed)

    def _swap(self, governed: _Governed) -> None:
        with self._swap_lock:
            if self._next is None:
                return
            generation, policies = self._next
        old = governed.attached
        step = old.step
        old.remove()
        try:
            governed.attached = self._attach(policies, governed.model, step)
        except Exception as exc:
            _say(f"error: cannot attach the reloaded policies: {type(exc).__name__}: {exc}; "
                 "keeping the previous ones")
            governed.attached = self._attach(PolicySet(old.policies), governed.model, step)
        governed.generation = generation
        governed.swap_after = None
        names = ", ".join(f"{p.name}@{p.revision[:12]}" for p in policies.policies)
        _say(f"reloaded policies at step {step} of {type(governed.model).__name__} (rank {self.rank}): {names}")
        if all(g.generation == generation for g in self._roots.values()):
            with self._swap_lock:
                if self._next is not None and self._next[0] == generation:
                    self._next = None


def _known(cache: dict[int, "weakref.ref[torch.nn.Module]"], module: torch.nn.Module) -> bool:
    ref = cache.get(id(module))
    return ref is not None and ref() is module


def _outermost_owners(params: set[int]) -> list[torch.nn.Module]:
    """The modules no other module contains that own one of `params` (one scan of the heap)."""
    modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
    children = {id(c) for m in modules for c in m.children()}
    return [
        m for m in modules
        if id(m) not in children and any(id(p) in params for p in m.parameters())
    ]


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
                _say(f"error: policy reload failed: {type(exc).__name__}: {exc}")

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
                _say("reload: the policies are unchanged")
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
        _say(f"governing {type(module).__name__} (rank {self.config.rank}, pid {os.getpid()}): "
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
