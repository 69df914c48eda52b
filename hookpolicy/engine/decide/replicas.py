"""Which statistics are the same on every rank, so that a job exports them once (rank 0), not once per rank.

A 1,024-rank job whose every rank exports the same gradient norms pays for 1,024 copies of
each series in Prometheus. A capture with `series: job` (the default) is exported by rank 0
of the default process group alone when hookpolicy can be sure that every rank computes
the same value at the same step; everything else stays per rank (`series: rank` asks for
that explicitly). The values are still computed on every rank: alerts, clips and
`Attached.last_values()` are unchanged; only the Prometheus series are left to rank 0.

A loss rule's statistics are the job's when it sees the job's loss (`ranks: job`, the
default: every rank's roots reduced in the step's agreement, `agreement.job_loss_rule`),
and each rank's with `ranks: own`; so are an activation rule's with `ranks: job`
(`agreement.Layout`: every rank's partials merged in the same agreement). Any other rule's are the job's when all of these hold,
and per rank otherwise:

- a process group of more than one rank is up;
- the rule is a `step` rule on `grad`, `weight`, `update` or `optimizer_state`. Where no
  optimizer steps the model, the step is evaluated in an autograd callback that the step
  cycle queues behind the one DDP's reducer queues to finish its all-reduce
  (`cycle.StepCycle._grad_hook`), so it reads the averaged gradients too;
- every parameter the rule reads is either
  * a `DTensor` (FSDP2 `fully_shard`, HSDP) on a device mesh of the whole default group:
    its statistics are those of the full tensor (`distributed.reduce_shards` reduces the
    shards' partials over the mesh dimensions that shard it; a `Replicate` dimension holds
    the same data by DTensor's contract), the same on every rank; or
  * a parameter that a `DistributedDataParallel` inside the governed model (or, when none
    is, one alive around it: Lightning governs the module DDP wraps) all-reduces over the
    whole default group: not in its `parameters_to_ignore` (which also holds
    `delay_all_reduce_named_params`), with no communication hook registered from Python
    but torch's own all-reduce ones (a hook may do anything: `post_localSGD_hook` stops
    all-reducing). DDP's reducer finishes the all-reduce in an autograd engine callback
    (`Reducer::finalize_backward`), so `backward()` returns with every rank holding the
    average, before any optimizer step pre-hook (`torch/nn/parallel/distributed.py`).
    Weights: DDP broadcasts rank 0's at construction and every rank then applies the same
    update to the same gradient; so the update and the optimizer's state are the same too
    (`update`, `optimizer_state`; under FSDP2 theirs are the full tensors' too, `updates`). A step whose last forward through the wrapper ran with
    gradient sync off (inside `no_sync()`, so DDP all-reduced nothing) publishes no job
    series: rank 0's values would be its own, and are not shown as the job's.

hookpolicy cannot see what the training script does to the gradients between `backward()`
and `optimizer.step()`; a script that changes them differently on each rank makes them
differ, as it would make its replicas differ. FSDP1's flat parameters, a DDP over a
subgroup (2-D parallelism) and a model wrapped after it was governed keep their series per
rank, and rank 0 says so once when the process group is up.
"""

from __future__ import annotations

import enum
import logging
import sys
import weakref
from typing import Any, Optional

import torch

from ...plan.planner import param as find_param
from ...policy.model import LOSS, OPTIMIZER_STATE, UPDATE, Capture
from .agreement import job_loss_rule, reduced
from ...process import Once
from ..hooks import module_hooks
from ..hooks.wrappers import wrappers_around
from ..measure.rulestate import RuleState

__all__ = ["Export", "Replicas", "job_rank", "job_world"]

log = logging.getLogger("hookpolicy")

#: The targets whose statistics can be the same on every rank (at `step`).
_PARAMETERS = ("grad", "weight", UPDATE, OPTIMIZER_STATE)


def job_rank() -> Optional[int]:
    """This process's rank in a default process group of more than one rank; None without one."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_rank()


def job_world() -> int:
    """The ranks of the job: the default process group's size, 1 without one."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Export(enum.Enum):
    """Whose a capture's series are at a step, and whether this rank exports them (`Replicas.exported`)."""

    RANK = "this rank's own, exported here"
    JOB = "the job's, exported here (rank 0)"
    BY_RANK_0 = "the job's, exported by rank 0 (dropped here)"
    NOT_NOW = "the job's, exported by no rank at this step"


class Replicas:
    """Which capture series of one attachment this rank exports; see the module docstring.

    A rule's answer is kept until its bindings change (a rebind gives it a new list).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        # Weakly: the read-back holds `exported`, and a dropped model's read-back stays with
        # the process until its leftovers are removed (`cycle.Leftovers`).
        self._model = weakref.ref(model)
        self._known: dict[tuple[str, str], tuple[int, Optional[str]]] = {}  # rule -> (id of its bindings, why per rank)
        #: the forward pre-hooks that watch each DDP wrapper's gradient sync (removed with the cycle's)
        self.handles: list[Any] = []
        self._wrappers: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
        self._said = Once()
        self._around: "Optional[weakref.WeakSet[torch.nn.parallel.DistributedDataParallel]]" = None

    def exported(self, rs: RuleState, action: Capture) -> Export:
        """Whose the series of `action` (a capture of `rs`) are at this step, and whether this rank exports them.

        `BY_RANK_0`: this rank drops any it exported before. `NOT_NOW`: rank 0 at a step
        DDP did not all-reduce (the series keep their last value of a step it did).
        """
        rank = job_rank()
        if rank is None or action.series == "rank" or self.per_rank(rs) is not None:
            return Export.RANK
        if rank != 0:
            return Export.BY_RANK_0
        # the job's loss and `ranks: job` activations are merged in the agreement whatever DDP's sync
        if rs.rule.target not in _PARAMETERS or all(self._wrappers.values()):
            return Export.JOB
        if self._said("unsynced"):
            log.warning("%s/%s: a step ran with DDP's gradient sync off (no_sync): its gradients are each rank's "
                        "own, so rank 0 publishes no series of the job's at such a step (said once)", *rs.key)
        return Export.NOT_NOW

    def per_rank(self, rs: RuleState) -> Optional[str]:
        """Why `rs`'s statistics may differ by rank; None when they are the same on every rank (see the module docstring)."""
        if rs.rule.target == LOSS:
            return None if job_loss_rule(rs) else "ranks: own: each rank's own loss"
        if reduced(rs):  # ranks: job activations: every rank's merged in the agreement (`agreement.Layout`)
            return None
        if rs.rule.trigger.at != "step" or rs.rule.target not in _PARAMETERS:
            return f"target {rs.rule.target} at {rs.rule.trigger.at} is each rank's own"
        return self.watch(rs)

    def watch(self, rs: RuleState) -> Optional[str]:
        """Why the parameters of `rs` may differ by rank, kept until its bindings change; said once by rank 0.

        Called for every step rule when the attachment starts, so that the DDP wrappers'
        gradient sync is watched from the first forward.
        """
        known = self._known.get(rs.key)
        if known is not None and known[0] == id(rs.bindings):
            return known[1]
        why = self._classify(rs)
        self._known[rs.key] = (id(rs.bindings), why)
        if why is not None:
            self._say(rs, why)
        return why

    def _say(self, rs: RuleState, why: str) -> None:
        """Rank 0 says once per rule and reason why a rule's `series: job` captures stay per rank."""
        if job_rank() == 0 and any(isinstance(a, Capture) and a.series == "job" for a in rs.rule.actions) \
                and self._said((*rs.key, why)):
            log.info("%s/%s: its series stay per rank: %s", *rs.key, why)

    def start(self, rules: "dict[tuple[str, str], RuleState]") -> None:
        """In a process group: find the DDP wrappers and watch their gradient sync before the first step."""
        if job_rank() is None:
            return
        for rs in rules.values():
            if rs.rule.trigger.at == "step" and rs.rule.target in _PARAMETERS:
                self.watch(rs)

    def _classify(self, rs: RuleState) -> Optional[str]:
        import torch.distributed as dist
        world = dist.get_world_size()
        model = self._model()
        if model is None:
            return "the model is gone"
        reduced = self._reduced(model, world)
        for b in rs.bindings:
            for path in b.paths():
                p = find_param(b.obj, path)
                mesh = getattr(p, "device_mesh", None)
                if mesh is not None:
                    if mesh.size() != world:
                        return f"{b.module}.{path} is sharded over {mesh.size()} of the {world} ranks"
                    continue
                if not isinstance(reduced, set):
                    return reduced
                if id(p) not in reduced:
                    return f"{b.module}.{path} is not all-reduced by a DistributedDataParallel over every rank"
        return None

    def _reduced(self, model: torch.nn.Module, world: int) -> "set[int] | str":
        """Ids of the parameters DDP wrappers inside `model` all-reduce over all `world` ranks; else why none."""
        import torch.distributed as dist
        found: set[int] = set()
        why = "no DistributedDataParallel or FSDP2 in or around the governed model reduces its gradients"
        for ddp in self._wrappers_of(model):
            hooks = [h for h, _ in getattr(ddp, "_comm_hooks", ())]
            unknown = [h for h in hooks if h not in _exact_hooks()]
            if unknown:
                why = f"a DDP communication hook ({getattr(unknown[0], '__qualname__', unknown[0])}) may not all-reduce"
                continue
            if dist.get_world_size(ddp.process_group) != world:
                why = f"DistributedDataParallel all-reduces over {dist.get_world_size(ddp.process_group)} of {world} ranks"
                continue
            ignored = getattr(ddp, "parameters_to_ignore", None)
            if ignored is None:
                why = "hookpolicy cannot tell which parameters DistributedDataParallel all-reduces"
                continue
            found.update(id(p) for name, p in ddp.module.named_parameters() if name not in ignored)
            if ddp not in self._wrappers:
                self._wrappers[ddp] = bool(getattr(ddp, "require_backward_grad_sync", True))
                self.handles.append(module_hooks.forward_pre_hook(ddp, _SyncWatch(self._wrappers)))
        return found if found else why


    def _wrappers_of(self, model: torch.nn.Module) -> list[torch.nn.parallel.DistributedDataParallel]:
        """The DDP wrappers inside `model`, else those alive around it (a framework may govern the module
        a wrapper holds, as Lightning does: `wrappers.wrappers_around`, which `data_parallel` asks too)."""
        ddp_type = torch.nn.parallel.DistributedDataParallel
        inside = [m for m in model.modules() if isinstance(m, ddp_type)]
        if inside:
            return inside
        if self._around is None:
            self._around = weakref.WeakSet(m for m in wrappers_around(model) if isinstance(m, ddp_type))
        return list(self._around)


class _SyncWatch:
    """A DDP wrapper's forward pre-hook: whether its gradients will be all-reduced (DDP decides at forward)."""

    def __init__(self, wrappers: "weakref.WeakKeyDictionary[torch.nn.Module, bool]") -> None:
        self._wrappers = wrappers

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._wrappers[module] = bool(getattr(module, "require_backward_grad_sync", True))


def _exact_hooks() -> frozenset[Any]:
    """torch's own DDP communication hooks that all-reduce every bucket (each rank gets the same result)."""
    hooks: list[Any] = []
    default = sys.modules.get("torch.distributed.algorithms.ddp_comm_hooks.default_hooks")
    mixed = sys.modules.get("torch.distributed.algorithms.ddp_comm_hooks.mixed_precision_hooks")
    if default is not None:
        hooks += [getattr(default, n, None) for n in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook")]
    if mixed is not None:
        hooks.append(getattr(mixed, "_reducer_allreduce_and_upcast_hook", None))
    return frozenset(h for h in hooks if h is not None)
