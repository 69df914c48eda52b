"""The typed policy model: what a validated policy file means, with no YAML or torch in it.

Built by `policy/build.py` from a document that passed the schema and the semantic
checks, so every value here is already known to be valid. Everything is frozen: a
policy, once loaded, never changes; a reload builds a new one.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Mapping, Optional, Sequence, Union

from .expr import STATS, UPDATE_RATIO, Call, Condition, Value

__all__ = [
    "API_VERSION", "KIND", "HOOK_POINTS", "TARGETS", "PARAM_TARGETS", "AFTER_UPDATE", "UPDATE", "OPTIMIZER_STATE",
    "UPDATE_RATIO", "LOSS", "ACTIVATIONS", "STATS", "stats_of", "Mode", "OnError", "HookPoint",
    "TriggerPhase", "Per", "Ranks", "Adapters", "Severity", "Then", "HEALS", "DECIDES", "RuleKey", "AlertKey", "rule_name", "Match", "After", "Trigger", "Capture", "TensorFiles",
    "LogSink", "Board", "Keep", "Dump", "Clip", "Scale", "CoolDown", "Rewind", "SkipStep", "Alert", "Action", "Rule", "Snapshots", "Policy",
    "alert_keys", "listened", "woken_by",
]

API_VERSION = "hookpolicy/v1"
KIND = "HookPolicy"

Mode = Literal["enforce", "audit"]
OnError = Literal["continue", "halt"]
HookPoint = Literal["forward_pre", "forward", "backward", "step"]
TriggerPhase = Literal["train", "eval", "any"]
Per = Literal["tensor", "module", "rule"]
SeriesPer = Literal["job", "rank"]
Severity = Literal["info", "warning", "critical"]
Then = Literal["log", "skip_step", "cool_down", "rewind", "halt"]
#: the `then` values that heal a step (`engine/heal/healing.py`); each has a block of its own name
HEALS: tuple[Then, ...] = ("cool_down", "rewind")
#: the `then` values that decide a step: every rank takes them at the same step (`engine/decide/agreement.py`)
DECIDES: tuple[Then, ...] = ("skip_step", "halt", *HEALS)
#: a rule's key: (policy name, rule name), unique in an attachment; `rule_name` is its text form
RuleKey = tuple[str, str]
#: an alert's key: its rule's key and the index of the alert in the rule's actions (as `StepReport.heals` holds them)
AlertKey = tuple[RuleKey, int]
Adapters = Literal["all", "down", "up"]
#: whose values a rule's statistics are of in a process group: the job's (every rank's together) or this rank's
Ranks = Literal["job", "own"]


def rule_name(key: RuleKey) -> str:
    """A rule key's text form, `policy/rule`, as messages, logs and the loss tap name a rule."""
    return "/".join(key)


#: hook point -> its targets, the default first (spec section 3).
HOOK_POINTS: Mapping[str, tuple[str, ...]] = {
    "forward_pre": ("input",),
    "forward": ("output", "input"),
    "backward": ("grad_output", "grad_input"),
    "step": ("grad", "weight", "loss", "update", "optimizer_state"),
}
TARGETS: tuple[str, ...] = (
    "input", "output", "grad_output", "grad_input", "grad", "weight", "loss", "update", "optimizer_state",
)
#: targets that are (or belong to) a module's parameters (where `match.params` applies).
PARAM_TARGETS: frozenset[str] = frozenset({"grad", "weight", "update", "optimizer_state"})
#: the target that is the step's training loss (one value per micro-batch), not a module's tensor
LOSS = "loss"
#: a module's activations and their gradients (per rank in a data-parallel job; `ranks: job` reduces them)
ACTIVATIONS: tuple[str, ...] = ("input", "output", "grad_output", "grad_input")
#: the change the optimizer applied to each parameter at a step (`w_after - w_before`)
UPDATE = "update"
#: the optimizer's state tensors of each parameter (Adam's `exp_avg`, `exp_avg_sq`), by key
OPTIMIZER_STATE = "optimizer_state"
#: the targets known only once the optimizer applied the step: measured after the update, read
#: back with the next step's statistics; nothing can change them and a skip cannot undo them
AFTER_UPDATE: frozenset[str] = frozenset({UPDATE, OPTIMIZER_STATE})


def stats_of(target: str) -> tuple[str, ...]:
    """The statistics a rule on `target` may capture or name: `update_ratio` (the update's norm over
    its parameter's) only on `update`, every other on every target."""
    return STATS if target == UPDATE else tuple(s for s in STATS if s != UPDATE_RATIO)


@dataclass(frozen=True)
class Match:
    """Which modules a rule selects; see `plan/matcher.py` and `policy/patterns.py` for the pattern syntax."""

    modules: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    root: bool = False
    exclude: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    adapters: Optional[Adapters] = None
    #: `target: optimizer_state`: globs over the state keys (`exp_avg_sq`); () is every state
    #: tensor shaped like its parameter (the moments and buffers, not Adam's `step` counter)
    state: tuple[str, ...] = ()


@dataclass(frozen=True)
class After:
    """`trigger.after`: the rule sleeps until an alert of rule `rule` fires at a step's decision, and is
    then active on the `steps` steps after that step (`engine/execute/executor.py`, `HookInstaller.wake`)."""

    rule: RuleKey
    steps: int


def woken_by(alert: str, policy: str) -> RuleKey:
    """The rule `trigger.after.alert` names: `POLICY/RULE`, or `RULE` of `policy` (the rule's own)."""
    named, _, rule = alert.rpartition("/")
    return (named or policy, rule)


@dataclass(frozen=True)
class Trigger:
    """When a rule fires: hook point, step gating and phase."""

    at: HookPoint
    every: int = 1
    steps_from: int = 0
    steps_until: Optional[int] = None
    phase: TriggerPhase = "train"
    #: None: awake whenever `every` and `steps` say; else asleep but on the steps after an alert (`After`)
    after: Optional[After] = None

    def active_at(self, step: int) -> bool:
        """Whether `every` and `steps` let the rule run on `step` (a rule with `after` must also be awake;
        phase is checked by the hook itself)."""
        if step < self.steps_from or (self.steps_until is not None and step >= self.steps_until):
            return False
        return step % self.every == 0


@dataclass(frozen=True)
class TensorFiles:
    """`capture.tensors`: detached CPU copies written as `.pt` files under `dir`."""

    dir: str
    max_files: int = 1000
    max_bytes: int = 1 << 30


@dataclass(frozen=True)
class LogSink:
    """`capture.log`: JSON lines to `path`, or to stderr when `path` is None.

    A file is rotated (`path` -> `path.1` -> ... -> `path.<keep>`) before the next
    records would take it past `max_bytes`, so a log takes at most `(keep + 1) * max_bytes`.
    """

    path: Optional[str] = None
    max_bytes: int = 100 << 20
    keep: int = 1


@dataclass(frozen=True)
class Board:
    """`capture.tensorboard`: the statistics as TensorBoard scalars under `dir/rank<r>`.

    With `histograms`, also a histogram of the target's values per tensor, which costs a
    device copy of the target on every evaluated step (like `tensors`).
    """

    dir: str
    histograms: bool = False


@dataclass(frozen=True)
class Dump:
    """`capture.keep.dump`: when an alert of a rule in `alerts` (`policy/rule` names) fires at a decided step S,
    the ring's steps S - `before` .. S + `after` go to one JSON-lines file under `dir` (per rank)."""

    alerts: tuple[str, ...]
    before: int = 100
    after: int = 0
    dir: str = "dumps"


@dataclass(frozen=True)
class Keep:
    """`capture.keep`: the statistics of the last `steps` steps kept in a bounded host ring
    (`engine/decide/recorder.py`); `export`: published to Prometheus as well (else instead)."""

    steps: int
    export: bool = False
    dump: Optional[Dump] = None


@dataclass(frozen=True)
class Capture:
    stats: tuple[str, ...] = ()
    per: Per = "module"
    tensors: Optional[TensorFiles] = None
    log: Optional[LogSink] = None
    tensorboard: Optional[Board] = None
    #: `job`: a statistic that is the same on every rank (gradients after DDP's all-reduce,
    #: FSDP2's full tensors, the job's loss) is exported by rank 0 only (`engine/decide/replicas.py`); `rank`: every
    #: rank exports its own series, as for statistics that differ by rank
    series: SeriesPer = "job"
    #: the flight recorder's ring of this capture's statistics, and the alerts that dump it
    keep: Optional[Keep] = None

    @property
    def exports(self) -> bool:
        """Whether the statistics are published to Prometheus (`keep.export: false` keeps them in the ring instead)."""
        return self.keep is None or self.keep.export

    @property
    def copies(self) -> bool:
        """Whether the hook keeps a device copy of each tensor for the readback (files, histograms)."""
        return self.tensors is not None or (self.tensorboard is not None and self.tensorboard.histograms)


@dataclass(frozen=True)
class Clip:
    """Norm clipping (`max_norm`, `norm_type`), value clamping (`min`/`max`), or adaptive
    gradient clipping (`unitwise_ratio`, `eps`: AGC, NFNets), exactly one of the three.

    AGC bounds each unit's gradient norm by `unitwise_ratio * max(unit's weight norm, eps)`,
    a unit being a slice along a parameter's first dimension (an output row or channel);
    it reads the weights, so it exists only at `step` on `target: grad`.

    `max_norm` is a number, or an expression over the clip's own norm series (`norm`): an
    adaptive threshold such as `ema(norm, 0.97) + 2.5 * ema_std(norm, 0.97)` (ZClip's
    percentile mode), evaluated on the host from the history before the norm is known; an
    expression that reads the current `norm` (ZClip's adaptive scaling, a threshold that
    falls as the spike grows) is evaluated on the device, on the group's norm. `when`, a
    condition over the same names, restricts the clip to the groups where it holds (on the
    device too). Such a clip does not clip a group until its series has `warmup` values.
    """

    max_norm: Optional[Union[float, Value]] = None
    norm_type: float = 2.0
    per: Per = "tensor"
    min: Optional[float] = None
    max: Optional[float] = None
    unitwise_ratio: Optional[float] = None
    eps: float = 1e-3
    warmup: int = 0
    when: Optional[Condition] = None

    @property
    def unitwise(self) -> bool:
        """Whether this is AGC (unit-wise, relative to the weights) rather than a norm or value clip."""
        return self.unitwise_ratio is not None

    @property
    def adaptive(self) -> Optional[Value]:
        """The `max_norm` expression, when it is one."""
        return self.max_norm if isinstance(self.max_norm, Value) else None

    @property
    def calls(self) -> frozenset[Call]:
        """The history functions the threshold and `when` call (over the series `norm`)."""
        calls = self.max_norm.calls if isinstance(self.max_norm, Value) else frozenset()
        return calls | (self.when.calls if self.when is not None else frozenset())

    @property
    def remembers(self) -> bool:
        """Whether the clip keeps its norm series (a `max_norm` expression or a `when`)."""
        return isinstance(self.max_norm, Value) or self.when is not None

    @property
    def on_device(self) -> bool:
        """Whether the threshold reads the current norm (or a `when` decides): evaluated on the device."""
        return self.when is not None or (isinstance(self.max_norm, Value) and bool(self.max_norm.reads()))


@dataclass(frozen=True)
class Scale:
    factor: float


@dataclass(frozen=True)
class CoolDown:
    """`then: cool_down`: every parameter group's lr times `factor` (0 < factor <= 1) for `steps` steps,
    counting the step the alert fires at; applied around each update, the LR scheduler's own value kept."""

    factor: float
    steps: int


@dataclass(frozen=True)
class Rewind:
    """`then: rewind`: go back to the newest snapshot at least `back` steps older than the rewinding
    step (the oldest kept if none is); after `max_rewinds` rewinds by this alert, halt instead."""

    back: int = 0
    max_rewinds: int = 3


@dataclass(frozen=True)
class SkipStep:
    """`then: skip_step` with `skip_step: {max_in_a_row: N}`: the alert skips at most N steps in a row.

    Past N its step is applied: the weights did not change over the N skipped steps and the
    condition still holds, so the weights (the update before the first skip), not the
    batches, made it, and only an update (or its rule's cool-down or rewind, when one acts
    at that step) can undo it. None: no bound (every firing skips)."""

    max_in_a_row: Optional[int] = None


@dataclass(frozen=True)
class Alert:
    condition: Condition
    source: str
    for_: int = 1
    severity: Severity = "warning"
    then: Then = "log"
    message: str = "{policy}/{rule}: {condition} in {module} at step {step}"
    per: Per = "module"
    #: evaluations skipped (the alert does not fire) until its series have this many values
    warmup: int = 0
    #: the message's fields that are expressions (`{zscore(loss, 100):.1f}`), parsed by the loader
    fields: tuple[tuple[str, Value], ...] = ()
    #: set exactly when `then` is `cool_down` / `rewind`
    cool_down: Optional[CoolDown] = None
    rewind: Optional[Rewind] = None
    #: with `then: skip_step`: its `skip_step` block (None: every firing skips)
    skip_step: Optional[SkipStep] = None

    @property
    def max_in_a_row(self) -> Optional[int]:
        """The most steps in a row this alert skips (`skip_step.max_in_a_row`); None: no bound."""
        return None if self.skip_step is None else self.skip_step.max_in_a_row

    @cached_property
    def stats(self) -> frozenset[str]:
        """The statistics the alert needs: its condition's and those its message names (computed once)."""
        try:
            named = {name for _, name, _, _ in string.Formatter().parse(self.message) if name}
        except ValueError:  # a malformed template; the loader never builds one
            named = set()
        from_fields = (s for _, value in self.fields for s in value.stats)
        return self.condition.stats | frozenset(s for s in STATS if s in named) | frozenset(from_fields)

    @cached_property
    def calls(self) -> frozenset[Call]:
        """The history functions its condition and message call."""
        return self.condition.calls.union(*(value.calls for _, value in self.fields))

    @cached_property
    def remembers(self) -> bool:
        """Whether the alert keeps a history of its statistics (it calls functions, or waits for a warmup)."""
        return bool(self.calls) or self.warmup > 0


Action = Union[Capture, Clip, Scale, Alert]


@dataclass(frozen=True)
class Rule:
    name: str
    index: int
    trigger: Trigger
    target: str
    match: Match
    actions: tuple[Action, ...]
    mode: Mode = "enforce"
    priority: int = 50
    select: tuple[Union[int, str], ...] = ()
    #: in a process group, `job`: statistics of every rank's values together (reduced in the step's
    #: agreement: the loss, captures of activations), `own`: this rank's; default `job` for target: loss only
    ranks: Ranks = "own"
    #: (line, column) of the rule's `match` key in its file, for warnings about what it selected;
    #: where a rule is written is not what it means, so it takes no part in equality
    match_at: tuple[int, int] = field(default=(0, 0), compare=False)

    @property
    def stats(self) -> tuple[str, ...]:
        """Every statistic the rule's captures and alerts need, in a stable order."""
        wanted: set[str] = set()
        for action in self.actions:
            if isinstance(action, Capture):
                wanted.update(action.stats)
            elif isinstance(action, Alert):
                wanted.update(action.stats)
        return tuple(s for s in STATS if s in wanted)


@dataclass(frozen=True)
class Snapshots:
    """`spec.snapshots`: copies of the model and its optimizer state taken after every `every` updates,
    at most `keep` of them in host memory, for `then: rewind`."""

    every: int
    keep: int = 2


@dataclass(frozen=True)
class Policy:
    name: str
    source: str
    revision: str
    rules: tuple[Rule, ...]
    mode: Mode = "enforce"
    on_error: OnError = "continue"
    max_series: int = 10000
    #: the most statistic series the policy's job may export, all ranks together (a series
    #: every rank exports counts the world size); None: no job-wide cap
    max_job_series: Optional[int] = None
    #: the most history values (ring slots, two per ema) all the policy's history series may keep
    max_history_values: int = 1000000
    #: `spec.limits.maxSnapshotBytes`: the host memory the snapshots of one model may hold; None: a quarter of the
    #: host memory available at attach
    max_snapshot_bytes: Optional[int] = None
    #: `spec.limits.maxRingBytes`: the host memory all the policy's rings (`capture.keep`) may hold together
    max_ring_bytes: int = 256 << 20
    #: `spec.limits.maxDumps` / `maxDumpBytes`: the dump files (`keep.dump`) the policy writes per rank, and their bytes
    max_dumps: int = 10
    max_dump_bytes: int = 64 << 20
    #: what `then: rewind` goes back to; None: no snapshots (and no rewind alert)
    snapshots: Optional[Snapshots] = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


def alert_keys(policies: Sequence[Policy]) -> list[AlertKey]:
    """The key of every alert of `policies`, sorted: the same list on every rank holding the same rules."""
    return sorted(((policy.name, rule.name), index) for policy in policies for rule in policy.rules
                  for index, action in enumerate(rule.actions) if isinstance(action, Alert))


def listened(policies: Sequence[Policy]) -> frozenset[AlertKey]:
    """The alerts whose firing something acts on at later steps, on every rank alike: every alert of a
    rule that a `trigger.after` names, or that a flight recorder's `keep.dump.alerts` names (every rank
    dumps its ring at the same step). A step's agreement carries them (`engine/decide/agreement.py`)."""
    woken_by = {rule.trigger.after.rule for policy in policies for rule in policy.rules
                if rule.trigger.after is not None}
    dumped_by = {tuple(name.split("/", 1)) for policy in policies for rule in policy.rules for action in rule.actions
                 if isinstance(action, Capture) and action.keep is not None and action.keep.dump is not None
                 for name in action.keep.dump.alerts}
    return frozenset(key for key in alert_keys(policies) if key[0] in woken_by or key[0] in dumped_by)
