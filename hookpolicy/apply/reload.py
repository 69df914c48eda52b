"""The reload protocol of `hookpolicy apply`, all of it: when, what is valid, where it goes in.

1. When. `Reloader` looks every HOOKPOLICY_WATCH_INTERVAL seconds, on a background
   thread: with `--watch` a change of a policy file's content or of a folder's listing
   (a dangling link or other unreadable entry included) reloads; a SIGHUP to the process,
   or a bump of the run folder's `reload` file (what the parent does on its SIGHUP),
   always does. A reload that failed is tried again, after one interval and then twice as
   long each time up to RETRY_MAX_SECONDS, until one succeeds or the files change (which
   reloads at once): a look between two steps of a ConfigMap update (the kubelet swaps
   `..data` first and removes a removed key's link after) or a validation cut short must
   not leave the job on the old policies until the next edit.
2. What is valid. Every source is loaded and validated, all or nothing. An invalid set is
   reported on stderr and the old one stays. The outcome is the value of
   `hookpolicy_config_last_reload_successful` (`MetricsStore.config_loaded`, the gauge's
   one writer: this module reports outcomes, an attach only makes the gauge exist).
3. Where it goes in. A valid set that differs from the running one becomes the next
   generation in `Swaps`. Each governed model swaps at its first module call after a
   step boundary, never between the micro-batches of one step: the boundary is noticed
   at an optimizer step's end (`Swaps.step_ended`, which `Discovery` calls before the
   step counters move) or at a call, then the model's step counter must move on. A
   model whose new attach fails keeps its previous policies, and says so. A data-parallel
   model (DDP, FSDP) swaps only to a version every rank of its process group has, at the
   same step on every rank: its step agreement carries this rank's newest version (`Vote`,
   `Swaps.agreed`), and nothing else differs.

`Discovery` holds the `Swaps`, governs new models with `Swaps.current()`, and calls
`step_ended` and `at_call` from its hooks; it knows nothing else of reloading.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
import weakref
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import torch
from prometheus_client import CollectorRegistry

from ..api import PolicySet
from ..engine.runtime import Attached
from ..environment import ChildConfig
from ..errors import PolicyError
from ..export.collector import store_for
from ..policy.loader import MAX_BYTES
from ..policy.model import Policy
from ..policy.sources import expand_sources
from ..process import start_thread
from ..say import say
from .validate import load_elsewhere

__all__ = ["Governed", "Swaps", "Vote", "Reloader", "RETRY_MAX_SECONDS", "content", "fingerprint"]

#: attach(policies, model, start_step, generation) -> the new attachment (raises when it cannot).
Attach = Callable[[PolicySet, torch.nn.Module, int, int], Attached]


class Governed:
    """One governed model: its attachment and the policy generation it runs.

    Both are held weakly: the script holds the model, and the model (through its own
    hooks) its attachment; once the script drops the model, nothing here keeps it alive.
    Read `model` and `attached` only while the model lives (`Discovery` forgets a dropped
    model before it looks at its governed models again).
    """

    def __init__(
        self, model: torch.nn.Module, attached: Attached, generation: int, swap_after: Optional[int] = None,
        agreed: Optional[tuple[int, PolicySet]] = None, replicated: bool = False,
    ) -> None:
        self._model = weakref.ref(model)
        self._attached = weakref.ref(attached)
        self.generation = generation
        #: a newer generation waits for a step beyond this one
        self.swap_after = swap_after
        #: (generation, policies) every rank of the process group agreed on, swapped in after `swap_after`
        self.agreed = agreed
        #: a data-parallel model (DDP, FSDP): its swaps wait for every rank (`Vote`)
        self.replicated = replicated

    @property
    def dropped(self) -> bool:
        """Whether the script dropped the model (it is garbage)."""
        return self._model() is None

    @property
    def model(self) -> torch.nn.Module:
        return _alive(self._model)

    @property
    def attached(self) -> Attached:
        return _alive(self._attached)

    @attached.setter
    def attached(self, attached: Attached) -> None:
        self._attached = weakref.ref(attached)


_T = TypeVar("_T")


def _alive(ref: "weakref.ref[_T]") -> _T:
    value = ref()
    if value is None:
        raise ReferenceError("a governed model was read after the script dropped it")
    return value


def content(policies: Sequence[Policy]) -> int:
    """A 62-bit digest of a policy set: each policy's name and revision (the hash of its file), in order.

    Equal on two ranks exactly when they read the same files; never 0 (0 is "no vote").
    """
    text = "\n".join(f"{p.name}\0{p.revision}" for p in policies)
    return (int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2) or 1


class Swaps:
    """The policies of this process: the newest generation, and the swap still pending.

    `request` may come from any thread (the reloader's); everything else runs on the
    training thread. `next` is read without the lock on the hot path: a stale read only
    delays a swap to the next call.

    A data-parallel model (`Governed.replicated`) swaps only to a version every rank of the
    process group has: its step agreement (`engine/decide/agreement.py`) carries this rank's newest
    version (`wanted`), and `agreed` learns, at the same step on every rank, whether all
    ranks want the same one. If they do, every rank swaps to it at its next step boundary;
    if not (a rank has not seen the new files yet, or could not load them), no rank does,
    and the job stays on the version it runs. Any other model swaps at its own next step
    boundary, as a process without a group does.
    """

    def __init__(self, policies: PolicySet, *, rank: int) -> None:
        self.rank = rank
        self.next: Optional[tuple[int, PolicySet]] = None
        self._lock = threading.Lock()
        self._policies = policies
        self._generation = 0
        #: what every rank agreed on last (the start's policies until a first agreed swap)
        self._running = (0, policies)
        #: digest -> (generation, policies) of every version this rank was handed; newest last
        self._wanted = content(policies.policies)
        self._known: dict[int, tuple[int, PolicySet]] = {self._wanted: (0, policies)}
        self._said: set[int] = set()  # versions this rank said it waits for the other ranks to have

    def current(self, replicated: bool = False) -> tuple[PolicySet, int]:
        """What a model governed now runs: the newest policies, or for a data-parallel model the
        ones every rank agreed on last (a rank must not start it on a version the others lack)."""
        with self._lock:
            if replicated:
                return self._running[1], self._running[0]
            return self._policies, self._generation

    def request(self, policies: PolicySet) -> None:
        """Make `policies` the next generation, swapped in at each model's next step boundary."""
        with self._lock:
            self._generation += 1
            self.next = (self._generation, policies)
            self._policies = policies
            digest = self._wanted = content(policies.policies)
            self._known.pop(digest, None)
            self._known[digest] = (self._generation, policies)
            while len(self._known) > 64:  # versions no rank can still agree on: older than 64 reloads
                self._known.pop(next(iter(self._known)))

    def wanted(self) -> int:
        """The digest of this rank's newest version: its vote at each step agreement."""
        return self._wanted

    def agreed(self, governed: Governed, wanted: Optional[int], step: int, everyone: Iterable[Governed]) -> None:
        """The step agreement of `governed`'s model at `step`: every rank wants `wanted` (None: not the same).

        Called inside the optimizer step pre-hook, so it only notes the swap; the swap goes
        in at the model's first call after this step, which is the same on every rank.
        """
        running = content(governed.attached.policies)
        if wanted is None:
            with self._lock:
                mine, newest = self._wanted, self._policies
            if mine != running and mine not in self._said:
                self._said.add(mine)
                names = ", ".join(f"{p.name}@{p.revision[:12]}" for p in newest.policies)
                say(f"reload of {names} waits at step {step} of {governed.attached.store.model} (rank {self.rank}): "
                    "not every rank of the process group has it; the job keeps running its current policies")
            return
        with self._lock:
            known = self._known.get(wanted)
        if known is None:  # cannot be: this rank voted for it at this very step
            return
        if wanted == running:  # every rank wants what this one runs (a reverted file): nothing to swap
            governed.agreed = None
            governed.generation = known[0]
            self._settle(everyone)
            return
        governed.agreed = known
        governed.swap_after = step

    def outdated(self, governed: Iterable[Governed]) -> bool:
        """Whether some model still runs an older generation."""
        return any(g.generation != self._generation or g.agreed is not None for g in governed)

    def step_ended(self, governed: Iterable[Governed]) -> bool:
        """An optimizer step ends (before any step counter moves): True when a swap waits.

        Each model still on an older generation swaps at its first call once its step
        counter is past the step ending now (a data-parallel model: once every rank agreed).
        """
        waiting = False
        for g in governed:
            if g.agreed is not None:
                waiting = True
            elif self.next is not None and g.generation != self._generation and g.swap_after is None:
                g.swap_after = g.attached.step
                waiting = True
        return waiting

    def at_call(self, governed: Governed, everyone: Iterable[Governed], attach: Attach) -> None:
        """A call of `governed`'s model: swap the pending generation in if a step boundary passed."""
        step = governed.attached.step
        if governed.agreed is not None:
            if governed.swap_after is not None and step > governed.swap_after:
                self._swap(governed, everyone, attach, *governed.agreed)
            return
        if governed.replicated or governed.generation == self._generation:
            return
        if governed.swap_after is None:
            governed.swap_after = step  # first seen in this step: wait for the next one
        elif step > governed.swap_after:
            with self._lock:
                pending = self.next
            if pending is not None:
                self._swap(governed, everyone, attach, *pending)

    def _swap(
        self, governed: Governed, everyone: Iterable[Governed], attach: Attach, generation: int, policies: PolicySet,
    ) -> None:
        old = governed.attached
        step = old.step
        healing = old.healing_state()  # before remove(), which frees the snapshots
        old.hold_recorder(policies.policies)  # before remove(), which writes the waiting dumps
        with old.store.swapping():  # a scrape sees the old policies or the new, never neither
            old.remove()
            try:  # generation + 1: for a data-parallel model the same on every rank (agreed swaps only)
                governed.attached = attach(policies, governed.model, step, old.generation + 1)
                governed.attached.carry_history(old, healing)
            except Exception as exc:
                say(f"error: cannot attach the reloaded policies: {type(exc).__name__}: {exc}; "
                    "keeping the previous ones")
                governed.attached = attach(PolicySet(old.policies), governed.model, step, old.generation + 1)
                governed.attached.carry_history(old, healing)
            if governed.replicated:
                governed.attached.vote_on_reloads(Vote(self, governed, everyone))
        governed.generation = generation
        governed.swap_after = None
        if governed.agreed is not None:
            governed.agreed = None
            with self._lock:
                self._running = (generation, policies)
        names = ", ".join(f"{p.name}@{p.revision[:12]}" for p in policies.policies)
        say(f"reloaded policies at step {step} of {governed.attached.store.model} (rank {self.rank}): {names}")
        self._settle(everyone)

    def _settle(self, everyone: Iterable[Governed]) -> None:
        """No swap is pending once every model runs the newest generation."""
        with self._lock:
            if self.next is not None and all(g.generation == self.next[0] for g in everyone):
                self.next = None


class Vote:
    """A data-parallel model's part in its step agreement (`engine.agreement.Vote`): the
    version this rank wants, and what the ranks agreed on."""

    def __init__(self, swaps: Swaps, governed: Governed, everyone: Iterable[Governed]) -> None:
        self._swaps, self._governed, self._everyone = swaps, governed, everyone

    def wanted(self) -> int:
        return self._swaps.wanted()

    def agreed(self, wanted: Optional[int], step: int) -> None:
        self._swaps.agreed(self._governed, wanted, step, self._everyone)


class Reloader:
    """Re-reads the policy files off the training thread when they change or on request.

    With `watch`, a change of any policy file (or of a policy folder's listing) triggers a
    reload; `request()` (SIGHUP) and a bump of the run folder's `reload` file always do.
    """

    def __init__(
        self, config: ChildConfig, swaps: Swaps, *, registry: CollectorRegistry,
        files: Optional[tuple[Any, ...]] = None,
    ) -> None:
        self.config = config
        self.swaps = swaps
        self.registry = registry
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._requested = False
        self._files = files if files is not None else fingerprint(config.sources)
        #: after a failed reload: (when to try again, on time.monotonic(), the delay after that)
        self._retry: Optional[tuple[float, float]] = None
        self._said_problems: Optional[str] = None  # the failure last said, not repeated by a retry
        self._trigger = self._read_trigger()
        self._thread = start_thread("reload", self._loop)

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
        retry = self._retry is not None and (changed or time.monotonic() >= self._retry[0])
        if not requested and not (self.config.watch and changed) and not retry:
            return
        self.reload(explicit=requested)

    def reload(self, explicit: bool = False) -> None:
        """Load and validate every source; a valid, different set waits in `swaps`.

        A failure keeps the current policies, reads 0 on the reload gauge and is tried
        again (`check`) until a reload succeeds; a retry that fails the same way says nothing.
        """
        store = store_for(self.registry, self.config.rank)
        try:  # in a child process: parsing 1 MB here would hold the training thread's GIL for seconds
            policies = PolicySet(load_elsewhere(list(self.config.sources)))
        except PolicyError as exc:
            store.config_loaded(False)
            lines = "\n".join(str(p) for p in exc.problems)
            delay = self.config.interval if self._retry is None else min(2 * self._retry[1], RETRY_MAX_SECONDS)
            self._retry = (time.monotonic() + delay, delay)
            if lines != self._said_problems or explicit:
                self._said_problems = lines
                say(f"reload failed; keeping the current policies (tried again until it succeeds):\n{lines}")
            return
        if self._retry is not None:
            say("reload: the policy files load again")
        self._retry, self._said_problems = None, None
        store.config_loaded(True)
        current, _ = self.swaps.current()
        if [(p.name, p.revision) for p in policies.policies] == [(p.name, p.revision) for p in current.policies]:
            if explicit:
                say("reload: the policies are unchanged")
            return
        self.swaps.request(policies)


#: The longest wait between two tries of a reload that keeps failing (the first waits one
#: watch interval, each next one twice as long): each try starts a validating Python.
RETRY_MAX_SECONDS = 60.0

#: A file read at least this many seconds after it was last modified, and whose status is
#: the same since, is not read again: modification times can be too coarse to tell two
#: quick saves apart, never two saves this far apart.
SETTLED_SECONDS = 2.0

#: path -> (its status, the checksum of its bytes, when they were read); one per policy file.
_checksums: dict[str, tuple[tuple[int, ...], Optional[int], float]] = {}


def fingerprint(sources: Sequence[str]) -> tuple[Any, ...]:
    """What the policy files look like now: names, a checksum of each file's bytes, and the
    entries that are not files (a dangling link between the two steps of a ConfigMap update).

    Content, not modification times: those can be too coarse to tell two quick saves
    apart. But bounded, since this runs every watch interval inside the training
    process: a file is looked at (`stat`) before it is read; one larger than the loader's
    limit (MAX_BYTES), or not a regular file, is never read (its size and times stand for
    it, and loading it will refuse it); one unchanged for SETTLED_SECONDS is not read
    again. At most MAX_BYTES + 1 bytes of each file that changed are read per interval.
    """
    files, problems = expand_sources(list(sources))
    seen: list[Any] = [(p.file, p.message) for p in problems]
    for file in files:
        try:
            status = os.stat(file)
        except OSError:
            seen.append((file, None))
            continue
        key = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_mode)
        if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_BYTES:
            seen.append((file, key))
            continue
        known = _checksums.get(file)
        if known is not None and known[0] == key and status.st_mtime < known[2] - SETTLED_SECONDS:
            seen.append((file, known[1]))
            continue
        read_at = time.time()
        try:
            with open(file, "rb") as f:
                checksum: Optional[int] = zlib.crc32(f.read(MAX_BYTES + 1))
        except OSError:
            checksum = None
        _checksums[file] = (key, checksum, read_at)
        seen.append((file, checksum))
    return tuple(seen)


