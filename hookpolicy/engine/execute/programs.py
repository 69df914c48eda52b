"""Program execution: a rule's compiled program run on tensors, recorded into the step's ledger.

`Programs.execute` runs a rule's `actions.Program` on tensors a hook or the step handed
over: a statistics pass appends an `Entry` (device-side partials) to the ledger, a clip a
`ClipEntry` (its measured norms and what it clipped), every action the module it ran on;
a clip or scale returns replacement tensors (or changes gradients in place at `step`).
`run_step_rules` gathers the tensors of `step` rules (gradients, weights, the loss) and
executes them in order. Nothing here reads back from the device.

**Error containment** (`Faults`): a rule's fault is counted, said once, and switches the
rule off or halts.

A hook body that raises (`Faults.guarded`) and a sink that cannot write at the read-back
(handed over by the step cycle) are both a fault of their rule: `hookpolicy_hook_errors_total`
counts it, the first one is logged with its traceback, the rule is switched off after
`MAX_ERRORS` (`onError: continue`), and with `onError: halt` it becomes a `Halt` at once.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence, Union, cast

import torch

from ...errors import Halt
from ...export.metrics import HOOK_ERRORS
from ...export.store import ModelMetrics
from ...plan.planner import owner_of, param_in
from ...policy.expr import Past, Value
from ...policy.model import AFTER_UPDATE, LOSS, Clip, rule_name
from ...process import Once
from ..measure.actions import DeviceLimit, Limit, MutateOp, StatsOp, clip_norm, clip_unitwise, mutate
from ..measure.distributed import Shards, local_shards, shard_name, shard_partials, sum_over_groups, unit_shards
from ..measure.history import History, group_key
from .ledger import ClipEntry, Entry, Ledger, Ran
from ..measure.rulestate import MAX_ERRORS, RuleState
from ..measure.stats import RowPlan, host_partials, host_row, reads_at_once, row_plan, tensor_partials

__all__ = ["Faults", "Plans", "Programs", "measure_plans", "measures_only", "ran_labels"]

log = logging.getLogger("hookpolicy")


class Programs:
    """Executes the programs of one attachment's rules, recording into `ledger`; see the module docstring."""

    def __init__(
        self, rules: dict[tuple[str, str], RuleState], ledger: Ledger, faults: Faults, history: History,
    ) -> None:
        self.rules = rules
        self.history = history
        self._ledger = ledger
        self._faults = faults
        self.guarded = faults.guarded
        self.rules_changed()
        self._said_limits = Once()  # (rule key, action index): adaptive thresholds that are not positive

    def rules_changed(self) -> None:
        """Derive what execution needs from `rules` (again, after a rule joined on a rebind)."""
        # A step rule's count of finite elements waits for the readback (no pass over the
        # gradients in a normal step, see stats.resolve_counts) unless some step rule clips or
        # scales the gradients in between, which could change what the count would see.
        self._defer_step_counts = not any(
            not isinstance(op, StatsOp) for rs in self.rules.values() if rs.rule.trigger.at == "step" for op in rs.program
        )
        #: per step rule, where its parameters are and what a step that reads them all records (`_Gather`),
        #: found at its first run after a (re)bind
        self._gathers: dict[tuple[str, str], _Gather] = {}

    def run_step_rules(
        self, rules: Sequence[RuleState], loss: Optional[torch.Tensor] = None, left_out: frozenset[int] = frozenset(),
    ) -> None:
        """Run `step` rules on their parameters' gradients or weights (in place), in order.

        `loss` is the step's micro-batch losses (`loss.LossTap.take`), the tensor of the
        `target: loss` rules; when None (none seen) those rules evaluate nothing.
        `left_out`: ids of parameters another optimizer updates, not this step (`steps.Scopes`).
        """
        for rs in rules:
            if rs.rule.target in AFTER_UPDATE:
                continue  # measured after the update (`updates`)
            if rs.rule.target != LOSS:
                self.guarded(rs, self._run_step_rule, rs, left_out)
            elif loss is not None:
                self.guarded(rs, self.execute, rs, LOSS, [("", "")], [loss], False)

    def record_job_loss(
        self, rules: Sequence[RuleState], partials: Mapping[str, float], roots: int, own: Optional[torch.Tensor],
    ) -> None:
        """The job's loss (`agreement.Agreed.loss`: partials of every rank's roots, how many) as the entries of
        the loss rules `rules` (they only measure: `checks` refuses clip and scale on the loss).

        `own`: this rank's roots, for tensor files (named as this rank's shard of the job's).
        """
        for rs in rules:
            self.guarded(rs, self._record_job_loss, rs, partials, roots, own)

    def _record_job_loss(
        self, rs: RuleState, partials: Mapping[str, float], roots: int, own: Optional[torch.Tensor],
    ) -> None:
        for op, count_keys in zip(rs.program, rs.count_keys):
            if not isinstance(op, StatsOp):
                continue
            matrix = torch.tensor([[partials[kind] for kind in op.kinds]], dtype=torch.float64)
            copies = [] if own is None else [(index, "", shard_name(""), own.clone()) for index, _ in op.tensors]
            self._ledger.entries.append(Entry(rs, op, LOSS, [("", "")], [roots], matrix, copies))
            self._ledger.ran.update((key, "") for key in count_keys)

    def _run_step_rule(self, rs: RuleState, left_out: frozenset[int]) -> None:
        gather = self._gathers.get(rs.key)
        if gather is None or gather.rs is not rs:
            gather = self._gathers[rs.key] = _Gather(rs)
        # each parameter now (one may have been replaced): a registered one, else as `param_in` finds it
        params: list[Any] = [owner._parameters.get(name) for owner, name in gather.places]
        try:
            tensors = [param.grad for param in params] if gather.grad else [param.detach() for param in params]
        except AttributeError:  # not a registered parameter (a property, a wrapper's alias)
            params = [param_in(owner, name) for owner, name in gather.places]
            tensors = [param.grad for param in params] if gather.grad else [param.detach() for param in params]
        kept = [i for i, param in enumerate(params) if id(param) not in left_out] if left_out else None
        try:
            numels: Optional[list[int]] = list(map(_numel, tensors))
        except TypeError:  # a parameter without a gradient
            numels = None
        if kept is None and numels is not None and 0 not in numels:  # the usual step: every row
            self.execute(rs, rs.rule.target, gather.rows, tensors, inplace=True, defer=self._defer_step_counts,
                         weights=params if gather.unitwise else (), bound=gather, numels=numels)
            return
        rows: list[tuple[str, str]] = []
        present: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []  # AGC's: the weight of each gradient in `present`
        for i in range(len(params)) if kept is None else kept:
            t = tensors[i]
            if t is not None and t.numel() > 0:
                rows.append(gather.rows[i])
                present.append(t)
                if gather.unitwise:
                    weights.append(params[i])
        if present:
            self.execute(rs, rs.rule.target, rows, present, inplace=True, defer=self._defer_step_counts,
                         weights=weights)

    def execute(
        self, rs: RuleState, target: str, rows: list[tuple[str, str]], tensors: list[torch.Tensor], inplace: bool,
        defer: bool = False, weights: Sequence[torch.Tensor] = (), references: Optional[torch.Tensor] = None,
        step: Optional[int] = None, bound: Optional[_Gather] = None, numels: Optional[list[int]] = None,
    ) -> Optional[list[torch.Tensor]]:
        """Run a rule's program on tensors; returns replacements when a mutation applied.

        `references` (`target: update`): per tensor, the sum of squares of its parameter
        before the update (of the local shard, for a DTensor), which `update_ratio` divides
        by. `step` stamps entries that measure an update already applied (`Entry.step`).
        `bound`: a step rule's `_Gather` when `rows` are all of its rows (its modules and the
        labels each pass counts, found once); `numels`: the tensors' element counts, when known.
        """
        changed = False
        modules = {module for module, _ in rows} if bound is None else bound.modules
        ran = self._ledger.ran
        for at, (op, count_keys) in enumerate(zip(rs.program, rs.count_keys)):
            if isinstance(op, StatsOp):
                sharded = local_shards(tensors)
                copies = _copies(op, rows, tensors, sharded) if op.tensors else []
                on_host = sharded is None and reads_at_once(tensors)  # CPU: read in the hook (stats, the rule per device)
                deferred = defer and "finite" in op.kinds and sharded is None and not on_host
                matrix: Union[torch.Tensor, list[list[float]]]
                if sharded is not None:
                    matrix = shard_partials(sharded[0], op.kinds, references)
                elif on_host:
                    matrix = host_partials(tensors, op.kinds, references)
                elif deferred:
                    matrix = tensor_partials(tensors, op.kinds, defer_counts=True)
                elif references is not None:
                    matrix = tensor_partials(tensors, op.kinds, references=references)
                else:
                    matrix = tensor_partials(tensors, op.kinds)
                sizes = list(map(_numel, tensors)) if numels is None else numels
                self._ledger.entries.append(Entry(rs, op, target, rows, sizes, matrix, copies,
                                         list(tensors) if deferred else None,
                                         None if sharded is None else sharded[1], step))
                ran.update(bound.ran[at] if bound is not None else
                           [(key, module) for key in count_keys for module in modules])
            elif op.unitwise:
                ran.update((count_keys[0], module) for module in modules)
                counts = self._clip_units(rs, op, rows, tensors, list(weights))
                # what it clipped (audit: would have) goes to the read-back; AGC measures no group norm
                report = torch.stack([torch.full_like(counts, math.nan), counts, torch.zeros_like(counts)], dim=1)
                self._ledger.entries.append(ClipEntry(rs, op.index, list(rows), report))
            else:
                ran.update((count_keys[0], module) for module in modules)
                action = op.action
                if isinstance(action, Clip) and action.max_norm is not None:
                    tensors, clipped = self._clip(rs, op.index, action, rows, tensors, inplace)
                    changed |= clipped
                elif rs.enforce:
                    tensors = mutate(action, list(tensors), _groups(rows, getattr(action, "per", "tensor")), inplace)
                    changed = True
        return tensors if changed else None

    def measure(
        self, rs: RuleState, target: str, rows: list[tuple[str, str]], t: torch.Tensor, ran: Sequence[Ran],
        plans: Plans,
    ) -> None:
        """`execute` of a program that only measures (`measures_only`) on one plain tensor (no DTensor) of a hook,
        contained and timed as `Faults.guarded` does (a hook calls it directly: one call less per hook).

        What `execute` would record, without what cannot happen here: no shards, no
        replacement, no deferred count (a hook's tensor is gone by the read-back). `rows` is
        the tensor's one row, `ran` the `hookpolicy_actions_total` labels one execution counts
        (`ran_labels`), `plans` the program's passes with their row plans (`measure_plans`):
        on CPU a pass the row buffer serves is read in one call (`stats.host_row`). A tensor
        that requires grad is read through `detach()`: the same values, without entering `no_grad`.
        """
        start = time.perf_counter()
        try:
            if t.requires_grad:
                t = t.detach()
            tensors = [t]
            numels = [t.numel()]
            on_host = reads_at_once(tensors)  # CPU: read in the hook (stats, the rule per device)
            entries = self._ledger.entries
            for op, plan in plans:
                row = host_row(t, plan) if on_host and plan is not None else None
                matrix = ([row] if row is not None else host_partials(tensors, op.kinds) if on_host
                          else tensor_partials(tensors, op.kinds))
                copies = _copies(op, rows, tensors, None) if op.tensors else []
                entries.append(Entry(rs, op, target, rows, numels, matrix, copies))
            self._ledger.ran.update(ran)
        except Exception as exc:  # noqa: BLE001 - containment is the point
            self._faults.fail(rs, exc)
        finally:
            self._ledger.seconds[rs.key] += time.perf_counter() - start

    def _clip_units(
        self, rs: RuleState, op: MutateOp, rows: list[tuple[str, str]], grads: list[torch.Tensor],
        weights: list[torch.Tensor],
    ) -> torch.Tensor:
        """AGC on a step rule's gradients (in place when enforced); per tensor, the units it clipped.

        On DTensors it works on the local shards, and the counts are those of the full
        tensors, the same on every rank (see `distributed.unit_shards`).
        """
        clip = cast(Clip, op.action)
        assert clip.unitwise_ratio is not None  # op.unitwise
        flat = next((rows[k] for k, w in enumerate(weights) if getattr(w, "_fsdp_flattened", False)), None)
        if flat is not None:  # FSDP1 marks the parameters it flattened (torch/distributed/fsdp/_flat_param.py)
            raise ValueError(
                f"{flat[0] or '<root>'}.{flat[1]} is flattened by FSDP1 (FullyShardedDataParallel): its gradient "
                "is a 1-D slice of a flat buffer whose units (rows) cannot be told apart, so AGC is not applied; "
                "FSDP2 (fully_shard) is supported")
        units = unit_shards(grads, weights)
        if units is None:
            return clip_unitwise(grads, weights, clip.unitwise_ratio, clip.eps, rs.enforce)
        counts = clip_unitwise(units.grads, units.weights, clip.unitwise_ratio, clip.eps, rs.enforce,
                               units.split, sum_over_groups)
        return torch.cat(sum_over_groups(list(torch.split(counts, 1)), units.apart))

    def _clip(
        self, rs: RuleState, index: int, action: Clip, rows: list[tuple[str, str]], tensors: list[torch.Tensor],
        inplace: bool,
    ) -> tuple[list[torch.Tensor], bool]:
        """A norm clip (in audit mode: its measurement only); what it did goes to the read-back as a `ClipEntry`."""
        groups = _groups(rows, action.per)
        keys = [group_key(*rows[group[0]], action.per) for group in groups]
        limits = self._limits(rs, index, action, keys)
        new, report = clip_norm(list(tensors), limits, action.norm_type, groups, inplace, apply=rs.enforce)
        self._ledger.entries.append(ClipEntry(rs, index, keys, report))
        applied = rs.enforce and any(limit is not None for limit in limits)
        return (new, True) if applied else (tensors, False)

    def _limits(self, rs: RuleState, index: int, action: Clip, keys: list[tuple[str, str]]) -> list[Limit]:
        """Each group's max_norm now: the number, or the expression evaluated on its norm's history.

        A group whose series has fewer than `warmup` values, or whose threshold is NaN (no
        history yet) or not positive, is not clipped this time (a threshold <= 0 is said once).
        A threshold that reads the current norm, or a clip with `when`, is a `DeviceLimit`:
        evaluated on the device once the group's norm is known (`device_limit`).
        """
        if not action.remembers:
            return [action.max_norm if isinstance(action.max_norm, float) else None] * len(keys)
        expression = action.max_norm
        tracked = self.history.tracking(rs.key, index, ("norm",), action.calls, action.warmup)
        limits: list[Limit] = []
        for module, tensor in keys:
            if not tracked.ready(module, tensor):
                limits.append(None)
                continue
            if action.on_device:
                limits.append(device_limit(action, tracked.past(module, tensor)))
                continue
            assert isinstance(expression, Value)  # remembers, not on the device: a max_norm expression
            limit = tracked.threshold(expression, module, tensor)
            if limit <= 0 and self._said_limits((rs.key, index)):
                log.warning("%s/%s: max_norm %s is %g at step %d for %s, which clips nothing; a threshold that is "
                            "not positive never clips (said once)", *rs.key, expression, limit, self._faults.step(),
                            module or "<root>")
            limits.append(limit if limit > 0 else None)  # NaN > 0 is False: no history, no clip
        return limits


class _Gather:
    """Where a step rule's parameters are, and what a step that reads all of them records.

    Found once per (re)bind: a module replaced by assignment re-plans (`executor.Rebinding`),
    which finds them anew; each parameter itself is still looked up by name at each step.
    """

    def __init__(self, rs: RuleState) -> None:
        rows: list[tuple[str, str]] = []
        places: list[tuple[torch.nn.Module, str]] = []
        for b in rs.bindings:
            for pname, path in zip(b.params, b.paths()):
                rows.append((b.module, pname))
                places.append(owner_of(b.obj, path))
        self.rs = rs
        #: per parameter, in order: its row (module, name in the rule) and (the module holding it, its name there)
        self.rows, self.places = rows, places
        self.grad = rs.rule.target == "grad"
        self.unitwise = any(isinstance(op, MutateOp) and op.unitwise for op in rs.program)
        self.modules = {module for module, _ in rows}
        #: per op of the program, the `hookpolicy_actions_total` labels a statistics pass over every row counts
        self.ran: list[list[Ran]] = [[(key, module) for key in keys for module in self.modules]
                                     for keys in rs.count_keys]


_numel = torch.Tensor.numel


def measures_only(rs: RuleState) -> bool:
    """Whether a rule's program only measures (statistics passes: captures and alerts), so that no
    execution of it can change a tensor (`Programs.measure` may run it)."""
    return all(isinstance(op, StatsOp) for op in rs.program)


#: A program that only measures, as `Programs.measure` runs it: each pass with its `stats.row_plan`.
Plans = tuple[tuple[StatsOp, Optional[RowPlan]], ...]


def measure_plans(rs: RuleState) -> Plans:
    """The passes of a program that only measures (`measures_only`), each with its row plan, found once."""
    return tuple((op, row_plan(op.kinds)) for op in rs.program if isinstance(op, StatsOp))


def ran_labels(rs: RuleState, module: str) -> tuple[Ran, ...]:
    """What one execution of a statistics-only program on `module` adds to the ledger's `ran`."""
    return tuple((key, module) for keys in rs.count_keys for key in keys)


def device_limit(action: Clip, past: Past) -> DeviceLimit:
    """The threshold of a clip whose `max_norm` reads the current norm, or that has a `when`.

    Evaluated on the group's norm in float64 on its device (ZClip computes in Python
    floats), the history's functions being host floats: no read-back. A false `when`
    becomes +inf (the group is not clipped); a threshold that is NaN or not positive
    where `when` holds becomes NaN, which `actions.clip_norm` does not clip either and
    reports, so that the read-back says it.
    """
    threshold, when = action.max_norm, action.when

    def limit(norm: torch.Tensor) -> torch.Tensor:
        values = {"norm": norm.double()}
        bound = threshold.evaluate(cast(Mapping[str, float], values), past) if isinstance(threshold, Value) else threshold
        value = bound if isinstance(bound, torch.Tensor) else values["norm"].new_full((), float(cast(float, bound)))
        usable = value > 0
        value = torch.where(usable, value, math.nan)
        if when is None:
            return value
        holds = torch.ones_like(usable) & when.evaluate(cast(Mapping[str, float], values), past)
        return torch.where(holds, value, math.inf)

    return limit


def _groups(rows: Sequence[tuple[str, str]], per: str) -> list[list[int]]:
    if per == "tensor":
        return [[i] for i in range(len(rows))]
    if per == "rule":
        return [list(range(len(rows)))]
    by_module: dict[str, list[int]] = {}
    for i, (module, _) in enumerate(rows):
        by_module.setdefault(module, []).append(i)
    return list(by_module.values())


def _copies(
    op: StatsOp, rows: list[tuple[str, str]], tensors: list[torch.Tensor],
    sharded: Optional[tuple[list[torch.Tensor], Shards]],
) -> list[tuple[int, str, str, torch.Tensor]]:
    """Detached copies for tensor files; of a DTensor, this rank's shard (the whole would take a collective)."""
    if sharded is None:
        return [(index, module, name, t.detach().clone())
                for index, _ in op.tensors for (module, name), t in zip(rows, tensors)]
    names = [shard_name(name) if groups else name for (_, name), groups in zip(rows, sharded[1].groups)]
    return [(index, module, names[i], sharded[0][i].detach().clone())
            for index, _ in op.tensors for i, (module, _) in enumerate(rows)]


class Faults:
    """Contains the faults of one attachment's rules.

    `step()` is the step being evaluated (for messages and halts); `halting(halt)` tells
    the attachment's `on_halt` before a `Halt` propagates; `ledger` gets the time spent.

    Under `onError: halt` the first fault stops the run. Alone, at once: the `Halt` is
    raised where the fault was. In a process group whose steps are agreed on
    (`agreed()`), a rank that halted alone would leave the others waiting in their next
    collective, so the fault's halt is kept (`pending`) and the step cycle puts it into
    the next step decision's agreement, which every rank takes at the same step.
    """

    def __init__(
        self, store: ModelMetrics, step: Callable[[], int], halting: Callable[[Halt], Halt], ledger: Ledger,
        agreed: Callable[[], bool] = lambda: False,
    ) -> None:
        self._store = store
        self._step = step
        self.halting = halting
        self._ledger = ledger
        self._agreed = agreed
        self._said_own = Once()  # a fault of hookpolicy's own part (`fail_all`): its traceback once
        #: the halt of a fault under `onError: halt` that waits for the next agreement (see above)
        self.pending: Optional[Halt] = None

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
            self._halt(Halt(rs.policy.name, rs.rule.name, step, f"hook error: {type(exc).__name__}: {exc}"), exc)
            return
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

    def _halt(self, halt: Halt, exc: BaseException) -> None:
        """Raise `halt` now, or, where the ranks agree on their steps, keep it for the next agreement (the first)."""
        if not self._agreed():
            raise self.halting(halt) from exc
        if self.pending is None:
            self.pending = halt
            log.error("hookpolicy: %s/%s raised at step %d under onError: halt (%s); every rank halts at the next "
                      "step decision", halt.policy, halt.rule, halt.step, halt.message)

    def take_pending(self, step: int) -> Optional[Halt]:
        """The kept halt, as a halt at `step` (the step decision that takes it), and forget it."""
        halt, self.pending = self.pending, None
        if halt is None or halt.step == step:
            return halt
        return Halt(halt.policy, halt.rule, step, f"{halt.message} (at step {halt.step})")

    def fail_all(self, rules: Sequence[RuleState], where: str, exc: BaseException) -> None:
        """A fault of hookpolicy's own part at `where` (a patch of torch, `hooks.contain`), done for `rules`.

        The same containment as a hook body's, for every rule in force among `rules` at
        once: each counts an error (`hookpolicy_hook_errors_total`) and is switched off after
        `MAX_ERRORS`; with `onError: halt` on any of them it is a `Halt` (that rule's); the
        traceback is said once per attachment.
        """
        live = [rs for rs in rules if not rs.off]
        if not live:
            return
        step = self._step()
        for rs in live:
            rs.errors += 1
            self._store.inc(HOOK_ERRORS, rs.key)
        halting = next((rs for rs in live if rs.policy.on_error == "halt"), None)
        if halting is not None:
            self._halt(Halt(halting.policy.name, halting.rule.name, step,
                            f"hookpolicy's own fault in {where}: {type(exc).__name__}: {exc}"), exc)
            return
        if self._said_own():
            log.error("hookpolicy: %s raised at step %d (hookpolicy's own fault, done for %s; the call it wraps went on "
                      "untouched; logged once; those rules are switched off after %d errors):\n%s", where, step,
                      ", ".join(rule_name(rs.key) for rs in live), MAX_ERRORS,
                      "".join(traceback.format_exception(exc)).rstrip())
        off = [rs for rs in live if rs.errors == MAX_ERRORS]
        for rs in off:
            self._store.switch_off(rs.key, f"after {MAX_ERRORS} errors")
        if off:
            log.error("hookpolicy: %s switched off after %d errors", ", ".join(rule_name(rs.key) for rs in off),
                      MAX_ERRORS)
