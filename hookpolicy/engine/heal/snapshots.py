"""In-memory snapshots of one governed model and what moves with it, for `then: rewind`.

A snapshot is taken at the end of a step (in the optimizer step post-hook, right after the
update), after every `every` updates, and holds:

- the model's parameters and buffers (each rank its own shards: a DTensor's local tensor);
- each optimizer's state (every tensor copied, every other value deep-copied) and its
  parameter groups' settings (`lr`, betas, ...: everything but `params`);
- every LR scheduler of those optimizers (`state_dict()`, deep-copied) and every
  GradScaler that stepped them (its scale and growth tracker), alive at the snapshot:
  `schedulers.alive()`, which knows each one from its construction (the one heap scan is
  at the first update, for those made before), so a scheduler made later (a cosine
  schedule replacing the warm-up's) is in the snapshots taken after it. A snapshot holds
  them weakly: one the script dropped is not kept alive, and a restore skips it.

Taken and restored at the same point of a step (the post-hook), so the script's code
after `optimizer.step()` (`scheduler.step()`, `scaler.update()`, `zero_grad()`) runs on
the restored state as it ran right after the snapshot was taken.

Memory: at most `keep` snapshots, in host memory, each the size of the model's parameters
and buffers plus the optimizer state (Adam: twice the parameters, and a step count); the
buffers are allocated once per slot and reused. On CUDA the copies go to pinned host
memory on a side stream, off the critical path: the next update waits for them on the
device (no host sync), and the forward and backward passes in between overlap them; a
model with buffers (BatchNorm's running statistics, which the next forward writes in
place) makes the current stream wait for them at once instead. On the CPU a copy is a
copy: the step pays for it (see docs/guardrails.md for the cost).

Not snapshotted: the data loader (the script's loop goes on with the next batch, which is
the point: the batches in between are dropped), the RNG states (dropout masks after a
rewind are the ones the next batch would have had), hookpolicy's own alert histories
(they keep the values of the dropped steps), and anything else the script keeps. With
several optimizers stepping the model in one step, no snapshot is taken (the first one's
post-hook ends the step, before the others updated): said once, and a rewind skips.
"""

from __future__ import annotations

import copy
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ...policy.model import Alert, Policy
from ...process import Once
from ..hooks import schedulers

__all__ = ["Snapshot", "Snapshots", "config", "describe", "model_bytes", "snapshots_of"]

log = logging.getLogger("hookpolicy")


def snapshots_of(model: torch.nn.Module, policies: Sequence[Policy], name: str) -> Optional["Snapshots"]:
    """The snapshots the enforced policies' rewind alerts need (said in one line); None if none."""
    wanted = config(policies)
    if wanted is None:
        return None
    said = describe(model, *wanted)
    if "more than" in said:
        log.warning("%s: %s", name, said)
    else:
        log.info("%s: %s", name, said)
    every, keep, budget = wanted
    return Snapshots(model, every, keep, name, budget)


def config(policies: Sequence[Policy]) -> Optional[tuple[int, int, int]]:
    """(every, keep, budget) of the snapshots that enforced rewind alerts need: the smallest `every`, the largest
    `keep`, the smallest `limits.maxSnapshotBytes` (by default a quarter of the host memory available now)."""
    wanting = [p for p in policies if p.snapshots is not None and p.mode == "enforce" and any(
        isinstance(a, Alert) and a.then == "rewind" for r in p.rules if r.mode == "enforce" for a in r.actions)]
    wanted = [p.snapshots for p in wanting if p.snapshots is not None]
    if not wanted:
        return None
    limits = [p.max_snapshot_bytes for p in wanting if p.max_snapshot_bytes is not None]
    budget = min(limits) if limits else default_budget()
    return min(s.every for s in wanted), max(s.keep for s in wanted), budget


def default_budget() -> int:
    """A quarter of the host memory available now (`MemAvailable`; the free pages where /proc is not there)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 4
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (OSError, ValueError, AttributeError):
        return 1 << 62  # nothing to read the host's memory from: no budget


def describe(model: torch.nn.Module, every: int, keep: int, budget: int) -> str:
    """What the snapshots of `model` cost, in words, against their budget (at attach and in `explain`)."""
    size = model_bytes(model)
    said = (f"snapshots for then: rewind after every {every} steps, at most {keep} in host memory, each "
            f"{mib(size)} of parameters and buffers plus the optimizer state (Adam: 2 x {mib(size)} more): "
            f"{mib(keep * size * 3)} with Adam; budget {mib(budget)} (spec.limits.maxSnapshotBytes, by default a "
            f"quarter of the host memory available)")
    if size * 3 > budget:
        return said + ("; one snapshot with Adam is more than the budget: none will be taken, and a rewind skips "
                       "its step instead")
    if keep * size * 3 > budget:
        return said + (f"; {keep} with Adam are more than the budget: at most {budget // (size * 3)} will be kept")
    return said


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and buffers that one snapshot copies (this rank's shards)."""
    return sum(_local(t).nbytes for t in _model_tensors(model))


def mib(n: int) -> str:
    """Bytes in MiB (KiB below one MiB)."""
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


#: a tensor as a snapshot knows it: its name in the model (module path and name), shape, dtype
Identity = tuple[str, tuple[int, ...], torch.dtype]
#: an optimizer's parameter groups as a snapshot knows them: per group, each parameter's identity
Groups = list[list[Identity]]


@dataclass
class Snapshot:
    """The state after `step` updates (the step a restore resumes at), in host memory."""

    step: int
    model: list[torch.Tensor]
    #: per optimizer: {parameter index in its groups: {state key: copy}}, groups' settings
    optimizers: list[tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]]
    #: (the scheduler, weakly; its state_dict())
    schedulers: list[tuple["weakref.ref[Any]", dict[str, Any]]] = field(default_factory=list)
    #: (the GradScaler, weakly; its scale; its growth tracker)
    scalers: list[tuple["weakref.ref[Any]", torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: what `model` holds, in order: each tensor's name in the model (module path and name), shape, dtype
    names: list[Identity] = field(default_factory=list)
    #: per optimizer of `optimizers`: (the optimizer, weakly; its class; its groups' parameters, by identity)
    held: list[tuple["weakref.ref[torch.optim.Optimizer]", type, Groups]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        state = sum(v.nbytes for states, _ in self.optimizers for s in states.values() for v in s.values()
                    if isinstance(v, torch.Tensor))
        return sum(t.nbytes for t in self.model) + state


class Snapshots:
    """At most `keep` snapshots of `model`, one after every `every` updates; see the module docstring."""

    def __init__(self, model: torch.nn.Module, every: int, keep: int, name: str, budget: int = 1 << 62) -> None:
        self._model = weakref.ref(model)
        self.every, self.keep, self._name = every, keep, name
        #: the bytes all snapshots together may hold (`limits.maxSnapshotBytes`)
        self.budget = budget
        self._said_budget = Once()
        self._too_big = False  # the last snapshot due did not fit the budget
        self.kept: list[Snapshot] = []
        self._optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._several = False
        self._said_size = Once()
        self._pending: Optional[Any] = None  # a CUDA event: the copies of the last snapshot
        self._stream: Optional[Any] = None
        #: the watch on LR schedulers and GradScalers being made, from the first update on; the
        #: cycle removes it (with the model, or after it was dropped: it holds nothing of the model)
        self.handles: list[schedulers.Watch] = []
        self._watched = False

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """An update of `optimizer` is about to begin: note it; the snapshot's copies must be done by then."""
        if not self._watched:
            self._watched = True
            self.handles.append(schedulers.watch())
        if optimizer not in self._optimizers:
            self._optimizers.add(optimizer)  # the optimizers of this step (a script may make its optimizer again)
            if len(self._optimizers) > 1 and not self._several:
                self._several = True
                self.kept.clear()
                log.warning("%s: several optimizers step this model; snapshots for then: rewind cover one "
                            "optimizer's steps only: none is taken, and a rewind skips the step instead", self._name)
        self._wait()

    def missing(self) -> str:
        """Why there is no snapshot to go back to."""
        if self._several:
            return "several optimizers step this model"
        if self._too_big:
            return f"no snapshot fits spec.limits.maxSnapshotBytes ({mib(self.budget)})"
        return f"no snapshot yet: the first is taken after {self.every} steps"

    def pick(self, step: int, back: int) -> Optional[int]:
        """The step of the snapshot a rewind at `step` goes back to: the newest at least `back` older, else the oldest.

        A snapshot's `step` counts updates: the one taken after step `t` has `step == t + 1`
        and is `step - t` steps older than `step` (`back: 6` at step 25 takes the one taken
        after step 19, dropping the 6 steps 20..25).
        """
        if not self.kept:
            return None
        old_enough = [s.step for s in self.kept if step - (s.step - 1) >= back]
        return old_enough[-1] if old_enough else self.kept[0].step

    def take_if_due(self, step: int) -> None:
        """At the end of `step`: a snapshot if `step + 1` updates are a multiple of `every`."""
        stepping, self._optimizers = self._ordered(), weakref.WeakSet()
        if (step + 1) % self.every or self._several:
            return
        model = self._model()
        if model is None or not stepping:
            return
        need = model_bytes(model) + sum(_local(v).nbytes for o in stepping for state in o.state.values()
                                        for v in state.values() if isinstance(v, torch.Tensor))
        self._too_big = need > self.budget
        if self._too_big:
            self.kept = []
            if self._said_budget("none"):
                log.warning("%s: a snapshot for then: rewind needs %s, more than spec.limits.maxSnapshotBytes (%s): "
                            "none is taken, and a rewind skips its step instead (said once)", self._name, mib(need),
                            mib(self.budget))
            return
        fit = max(1, min(self.keep, self.budget // max(need, 1)))
        if fit < self.keep and self._said_budget("fewer"):
            log.warning("%s: %d snapshots for then: rewind of %s each are more than spec.limits.maxSnapshotBytes "
                        "(%s): %d are kept (said once)", self._name, self.keep, mib(need), mib(self.budget), fit)
        while len(self.kept) > fit:
            self.kept.pop(0)
        slot = self.kept.pop(0) if len(self.kept) == fit else None
        snapshot = self._take(model, step + 1, slot, stepping)
        self.kept.append(snapshot)
        if self._said_size():
            log.info("%s: first snapshot for then: rewind after step %d: %s (x %d kept at most); %d LR schedulers, "
                     "%d GradScalers with it", self._name, step, mib(snapshot.nbytes), self.keep,
                     len(snapshot.schedulers), len(snapshot.scalers))

    def release(self) -> None:
        """Drop every snapshot (at `remove()`: a handle kept after it holds no copy of the model)."""
        self.kept = []
        self._pending = None

    def changed(self, step: int) -> list[str]:
        """What no longer matches in the model since the snapshot taken after `step` updates (empty: it all does).

        A snapshot is put back as `nn.Module.load_state_dict` would, by name: each tensor
        of the model as it is now must be one the snapshot holds, of the same shape and
        dtype (a device move is fine: the values are copied to where the tensor is now).
        """
        snapshot = next(s for s in self.kept if s.step == step)
        model = self._model()
        if model is None:
            return ["the model is gone"]
        return _differences(snapshot.names, [name for name, _ in _identities(model)])

    def restore(self, step: int) -> tuple[int, list[str]]:
        """Put back the snapshot taken after `step` updates, what still matches; newer ones are dropped.

        Returns `step` and what was not put back, in words. The model is put back whole or
        not at all (`changed`: then nothing is written); each optimizer's state only into an
        optimizer of the same class with the same parameter groups (by name and shape), as
        `Optimizer.load_state_dict` requires; each LR scheduler only while its optimizer still
        steps the model; a GradScaler only while it is enabled.
        """
        snapshot = next(s for s in self.kept if s.step == step)
        self.kept = [s for s in self.kept if s.step <= step]
        model = self._model()
        self._wait()
        stepping = self._ordered()
        self._optimizers = weakref.WeakSet()
        refused = self.changed(step)
        if model is None or refused:
            return step, [f"the model changed since the snapshot ({'; '.join(refused[:6])}): nothing put back"]
        not_back: list[str] = []
        names = names_of(model)
        with torch.no_grad():
            for live, saved in zip(_model_tensors(model), snapshot.model):
                _local(live).copy_(saved, non_blocking=True)
            for optimizer in stepping:
                found = _saved_for(optimizer, snapshot, _groups(optimizer, names))
                if isinstance(found, str):
                    not_back.append(found)
                    continue
                _restore_optimizer(optimizer, *found)
        live_ids = {id(o) for o in stepping}
        for ref, state in snapshot.schedulers:
            scheduler = ref()
            if scheduler is None:
                continue
            if id(getattr(scheduler, "optimizer", None)) not in live_ids:
                not_back.append(f"{type(scheduler).__name__}: its optimizer no longer steps the model, state not "
                                "restored")
                continue
            scheduler.load_state_dict(copy.deepcopy(state))
        for ref, scale, tracker in snapshot.scalers:
            scaler = ref()
            now, growth = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
            if scaler is None or not isinstance(now, torch.Tensor) or not isinstance(growth, torch.Tensor):
                continue
            now.copy_(scale)
            growth.copy_(tracker)
        return step, not_back

    # -- taking one ----------------------------------------------------------------------------
    def _ordered(self) -> list[torch.optim.Optimizer]:
        return sorted(self._optimizers, key=id)

    def _take(self, model: torch.nn.Module, step: int,
              slot: Optional[Snapshot], optimizers: list[torch.optim.Optimizer]) -> Snapshot:
        side = self._side_stream(model)
        with torch.no_grad(), (torch.cuda.stream(side) if side is not None else _nothing()):
            tensors = [_local(t) for t in _model_tensors(model)]
            old = slot.model if slot is not None and _fits(slot.model, tensors) else None
            copies = [_host_copy(t, None if old is None else old[i]) for i, t in enumerate(tensors)]
            states = [_optimizer_copy(o, None if slot is None or len(slot.optimizers) <= i else slot.optimizers[i][0])
                      for i, o in enumerate(optimizers)]
        if side is not None:
            self._pending = (side.device, side.record_event())
            if any(True for _ in model.buffers()):
                # the next forward writes buffers in place (BatchNorm's running statistics, DDP's
                # broadcast of rank 0's): its stream waits for their copies now (on the device, no sync)
                self._wait()
        held = {id(o) for o in optimizers}
        scheduler, scaler = schedulers.kinds()
        found = schedulers.alive()  # no heap scan: known from their construction
        lrs = [(weakref.ref(s), copy.deepcopy(s.state_dict())) for s in found
               if issubclass(type(s), scheduler) and id(getattr(s, "optimizer", None)) in held]
        # a disabled GradScaler (nanoGPT's on a CPU or a bf16 GPU) never sets _scale: nothing of it to keep
        scales = [(weakref.ref(s), s._scale.clone(), s._growth_tracker.clone()) for s in found
                  if issubclass(type(s), scaler) and isinstance(getattr(s, "_scale", None), torch.Tensor)
                  and isinstance(getattr(s, "_growth_tracker", None), torch.Tensor)
                  and any(i in held for i in getattr(s, "_per_optimizer_states", ()))]
        names = _identities(model)
        held_by = [(weakref.ref(o), type(o), _groups(o, names_of(model))) for o in optimizers]
        return Snapshot(step, copies, states, lrs, scales, [name for name, _ in names], held_by)

    def _side_stream(self, model: torch.nn.Module) -> Optional[Any]:
        """A CUDA stream for the copies, waiting for the update that made them; None off CUDA."""
        device = next((t.device for t in model.parameters()), None)
        if device is None or device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._stream.wait_stream(torch.cuda.current_stream(device))
        return self._stream

    def _wait(self) -> None:
        """The current stream waits on the device for the last snapshot's copies (no host sync)."""
        if self._pending is not None:
            device, event = self._pending
            torch.cuda.current_stream(device).wait_event(event)
            self._pending = None


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, else the tensor's data."""
    to_local = getattr(t, "to_local", None)
    return to_local().detach() if callable(to_local) else t.detach()


def _fits(old: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> bool:
    return len(old) == len(new) and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(old, new))


def _host_copy(t: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
    """`t` copied to host memory (pinned, asynchronously, from CUDA), into `into` when it fits."""
    if into is None or into.shape != t.shape or into.dtype != t.dtype:
        into = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    into.copy_(t, non_blocking=t.is_cuda)
    return into


def _optimizer_copy(optimizer: torch.optim.Optimizer, old: Optional[dict[int, dict[str, Any]]]
                    ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The optimizer's state by parameter index (tensors copied to the host), and its groups' settings."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    states: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        state = optimizer.state.get(p)
        if state is None:
            continue
        reuse = {} if old is None else old.get(i, {})
        states[i] = {k: _host_copy(_local(v), reuse.get(k)) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in state.items()}
    groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]
    return states, groups


def _restore_optimizer(optimizer: torch.optim.Optimizer, states: dict[int, dict[str, Any]],
                       groups: list[dict[str, Any]]) -> None:
    """The state and groups' settings of `_optimizer_copy` back, tensors copied in place where they fit."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        saved = states.get(i)
        if saved is None:
            optimizer.state.pop(p, None)
            continue
        live = optimizer.state.setdefault(p, {})
        for k in [k for k in live if k not in saved]:
            del live[k]
        for k, v in saved.items():
            now = live.get(k)
            if isinstance(v, torch.Tensor):
                if isinstance(now, torch.Tensor) and _local(now).shape == v.shape and now.dtype == v.dtype:
                    _local(now).copy_(v, non_blocking=True)
                else:
                    live[k] = v.to(p.device if v.dim() else v.device, copy=True)
            else:
                live[k] = copy.deepcopy(v)
    for group, settings in zip(optimizer.param_groups, groups):
        for k, v in settings.items():
            group[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _identities(model: torch.nn.Module) -> list[tuple[Identity, torch.Tensor]]:
    """Each tensor a snapshot copies (`_model_tensors`' order), with its identity."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [((name, tuple(_local(t).shape), t.dtype), t) for name, t in named]


def names_of(model: torch.nn.Module) -> dict[int, Identity]:
    """id of each parameter of `model` -> its identity (for an optimizer's groups)."""
    return {id(t): identity for identity, t in _identities(model)}


def _groups(optimizer: torch.optim.Optimizer, names: dict[int, Identity]) -> Groups:
    """Each group's parameters by identity; one outside the model by its shape and dtype only."""
    return [[names.get(id(p), ("(not in the model)", tuple(_local(p).shape), p.dtype)) for p in group["params"]]
            for group in optimizer.param_groups]


def _differences(saved: Sequence[Identity], live: Sequence[Identity]) -> list[str]:
    """What differs between the identities a snapshot holds and the model's now, in words."""
    if list(saved) == list(live):
        return []
    before = {name: (shape, dtype) for name, shape, dtype in saved}
    now = {name: (shape, dtype) for name, shape, dtype in live}
    said: list[str] = []
    for name, (shape, dtype) in now.items():
        old = before.get(name)
        if old is None:
            said.append(f"{name} is new")
        elif old[0] != shape:
            said.append(f"{name} is {_dims(shape)} now, {_dims(old[0])} in the snapshot")
        elif old[1] != dtype:
            said.append(f"{name} is {str(dtype).removeprefix('torch.')} now, "
                        f"{str(old[1]).removeprefix('torch.')} in the snapshot")
    said += [f"{name} is gone" for name in before if name not in now]
    return said or ["its tensors are in another order"]


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(str(n) for n in shape) or "a scalar"


def _saved_for(optimizer: torch.optim.Optimizer, snapshot: Snapshot, groups: Groups
               ) -> "tuple[dict[int, dict[str, Any]], list[dict[str, Any]]] | str":
    """The saved state to put into `optimizer`: the same one's, else one of the same class over the same groups;
    else why none is (in words)."""
    entries = list(zip(snapshot.held, snapshot.optimizers))
    same = [saved for (ref, _, _), saved in entries if ref() is optimizer]
    alike = [saved for (_, cls, held), saved in entries if cls is type(optimizer) and held == groups]
    name = type(optimizer).__name__
    if same and any(held == groups for (ref, _, held), _ in entries if ref() is optimizer):
        return same[0]
    if alike:
        return alike[0]
    if same or any(cls is type(optimizer) for _, cls, _ in snapshot.held):
        return f"{name}'s state not restored: its parameter groups changed since the snapshot"
    was = ", ".join(sorted({cls.__name__ for _, cls, _ in snapshot.held})) or "no optimizer"
    return f"{name}'s state not restored: the snapshot holds the state of {was}, another class"
