"""The flight recorder: a bounded host ring of each `capture.keep`'s last steps, and the dumps alerts write of it.

The read-back finishes a capture's statistics once per step on the host (`readback`); for a
capture with `keep` it hands each group's values to `Recorder.keep`, which copies them into
a float64 array of the step (8 bytes a value: no second pass over the tensors, no transfer,
nothing in a hook). A ring holds at most `keep.steps` steps and at most its share of the
policy's `spec.limits.maxRingBytes` (split evenly among the policy's rings): past either,
the oldest steps go, said once when the bytes are what binds.

When an alert of a rule that a `keep.dump` names (`alerts: [policy/rule]`) fired at a decided
step S (`Recorder.alerted`), the steps S - before .. S + after of that ring become one
JSON-lines file, written once the ring holds step S + after (or at detach, with what it
holds, unless a hot reload carries it over: below): a `{"event": "dump"}` header, the alert records of S, then one record per step and
group in exactly the capture log's format (`export/sinks.py`, `readback._report_pass`), so
`hookpolicy report` and `replay` read a dump as they read a log. Each rank dumps its own
ring, all at the same step: the alerts that fired are the step's agreed ones
(`StepReport.fired`; the dumped rules' alerts are in `policy.model.listened`), so an alert
of one rank dumps every rank's ring, and only that rank's file holds its record. The files a policy writes per rank are bounded by `spec.limits.maxDumps` and their
bytes by `maxDumpBytes`: a dump past either is not written (never a partial file), said
once, and the count of those not written is said at detach.

A hot reload (`apply/reload.py`) carries the recorder over for what it left alone
(`Recorder.hold` before the old attachment's detach, `Recorder.held` and `adopt` after): the
ring of each capture of a rule that is unchanged but for its place in the file goes on in the
new attachment (same steps, the model's step numbers, re-bounded by the new policy's share of
`maxRingBytes`), a dump of such a rule still waiting for its `after` steps is completed there
(not written at detach), and the dumps a policy of the same name wrote count against its limits.
A changed or removed rule's ring is not carried, and its waiting dump is written at the old
attachment's detach with what its ring holds.
"""

from __future__ import annotations

import json
import logging
import os
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ...export.sinks import DUMP_EVENT, file_name, safe_path, write_whole
from ...plan.planner import Binding
from ...policy.model import Capture, Keep, Policy, RuleKey, rule_name
from ...process import Once
from ..measure.history import groups_on
from ..measure.rulestate import RuleState
from .alerts import json_number

__all__ = ["Carried", "DUMP_EVENT", "Recorder", "Ring", "VALUE_BYTES", "bounds", "dump_name"]

log = logging.getLogger("hookpolicy")

#: What one kept value costs: a float64.
VALUE_BYTES = 8

#: (rule key, action index): one ring per capture with `keep`
RingKey = tuple[RuleKey, int]


@dataclass
class _Step:
    """One step of a ring: its time, its groups and their values, groups x stats, row by row.

    A step whose groups are the step before's, in the same order (every step of a model that did not
    change), shares that step's list of names (`shared`) instead of holding one of its own."""

    step: int
    time: float
    names: list[tuple[str, str]]
    values: array  # type: ignore[type-arg]
    shared: bool = False
    count: int = 0

    @property
    def groups(self) -> list[tuple[str, str]]:
        return self.names[:self.count] if self.shared else self.names

    @property
    def bytes(self) -> int:
        """The bytes this step holds: its values, and one reference per group unless its names are shared."""
        return VALUE_BYTES * len(self.values) + (0 if self.shared else VALUE_BYTES * len(self.names))

    def add(self, group: tuple[str, str]) -> None:
        if self.shared and self.count < len(self.names) and self.names[self.count] == group:
            self.count += 1
            return
        if self.shared:  # the groups differ from the step before's from here on: a list of its own
            self.names, self.shared = self.names[:self.count], False
        self.names.append(group)
        self.count += 1


class Ring:
    """The last `keep.steps` steps of one capture's statistics, within `budget` bytes."""

    def __init__(self, rs: RuleState, index: int, action: Capture, budget: int) -> None:
        assert action.keep is not None
        self.rule, self.index, self.action, self.keep = rs, index, action, action.keep
        self.budget = budget
        self.steps: deque[_Step] = deque()
        self.bytes = 0
        self.target = rs.rule.target
        self._said = Once()

    def add(self, step: int, time: float, group: tuple[str, str], stats: Mapping[str, float]) -> None:
        """Copy one group's statistics of `step` into the ring (a new step starts a new entry)."""
        last = self.steps[-1] if self.steps else None
        if last is None or last.step != step:
            last = _Step(step, time, [], array("d")) if last is None else _Step(step, time, last.names, array("d"),
                                                                                shared=True)
            self.steps.append(last)
        before = last.bytes
        last.add(group)
        last.values.extend(stats[s] for s in self.action.stats)
        self.bytes += last.bytes - before
        self._bound()

    def _bound(self) -> None:
        """Drop the oldest steps past `keep.steps` or past the byte budget (said once when the bytes bind)."""
        while len(self.steps) > self.keep.steps:
            self._drop()
        if self.bytes > self.budget and self._said():
            log.warning("hookpolicy: %s: action %d keeps fewer than keep.steps=%d steps: %d bytes a step, and its "
                        "ring may hold %d bytes (its share of spec.limits.maxRingBytes=%d); the oldest steps go "
                        "first", rule_name(self.rule.key), self.index, self.keep.steps, self.steps[-1].bytes,
                        self.budget, self.rule.policy.max_ring_bytes)
        while self.bytes > self.budget and self.steps:
            self._drop()

    def _drop(self) -> None:
        gone = self.steps.popleft()
        self.bytes -= gone.bytes
        if self.steps and self.steps[0].shared and self.steps[0].names is gone.names:
            first = self.steps[0]  # it now owns the list it shared
            self.bytes -= first.bytes
            first.shared = False
            self.bytes += first.bytes

    def continues(self, old: "Ring") -> None:
        """Take over the steps of `old`, the ring of the same capture before a hot reload, and bound them by this
        ring's budget (said once when the bytes bind, unless `old` said it already within as large a budget)."""
        self.steps, self.bytes = old.steps, old.bytes
        if old.budget <= self.budget:
            self._said = old._said
        self._bound()

    def window(self, first: int, last: int) -> list[_Step]:
        return [s for s in self.steps if first <= s.step <= last]

    @property
    def newest(self) -> Optional[int]:
        return self.steps[-1].step if self.steps else None


@dataclass
class _Pending:
    """A dump waiting for its last step: the ring, the alert's step, the rules that fired there, their records."""

    ring: Ring
    step: int
    fired: tuple[str, ...]
    alerts: list[dict[str, Any]] = field(default_factory=list)
    #: held at a hot reload, but its rule is not in the new attachment: written at the next flush as it is
    orphan: bool = False

    @property
    def first(self) -> int:
        assert self.ring.keep.dump is not None
        return self.step - self.ring.keep.dump.before

    @property
    def last(self) -> int:
        assert self.ring.keep.dump is not None
        return self.step + self.ring.keep.dump.after


@dataclass
class _Spent:
    """What one policy's dumps took on this rank, and how many were not written."""

    files: int = 0
    bytes: int = 0
    refused: int = 0


@dataclass
class Carried:
    """What a hot reload takes from one attachment's recorder to the next (`Recorder.held`, `Recorder.adopt`)."""

    rings: dict[RingKey, Ring] = field(default_factory=dict)
    pending: list[_Pending] = field(default_factory=list)
    spent: dict[str, _Spent] = field(default_factory=dict)


#: a write of a sink of a rule, contained (`Writers.sink`): False when it failed
Write = Callable[[RuleState, Callable[[], object]], bool]


class Recorder:
    """Every ring of one attachment, its pending dumps and what they wrote."""

    def __init__(self, root: Path, rank: int, model: str, run: str, policies: Sequence[Policy],
                 wrote: Callable[[RuleKey, str, int], None] = lambda key, path, records: None) -> None:
        self.root, self.rank, self.model, self.run = root, rank, model, run
        self._wrote = wrote  # (rule, path relative to the output folder, records): for the run summary
        self.rings: dict[RingKey, Ring] = {}
        self._shares = {p.name: p.max_ring_bytes // max(1, sum(1 for r in p.rules for a in r.actions
                                                               if isinstance(a, Capture) and a.keep is not None))
                        for p in policies}
        self._policies = {p.name: p for p in policies}
        self._pending: list[_Pending] = []
        self._spent: dict[str, _Spent] = {}
        #: what a hot reload carries to the next attachment (`hold`): not written nor said at detach
        self._held_rules: set[RuleKey] = set()
        self._held_policies: set[str] = set()
        #: the dump files written, in order (for the run summary and the tests)
        self.written: list[Path] = []

    def keep(self, rs: RuleState, index: int, action: Capture, step: int, time: float, module: str, tensor: str,
             stats: Mapping[str, float]) -> None:
        """Copy one group's statistics of `step` into the ring of capture `index` of `rs`."""
        key = (rs.key, index)
        ring = self.rings.get(key)
        if ring is None or ring.rule is not rs:  # a new rule state of the same name: a ring of its own
            ring = self.rings[key] = Ring(rs, index, action, self._share(rs))
        ring.add(step, time, (module, tensor), stats)

    def alerted(self, step: int, fired: Iterable[str], records: Sequence[dict[str, Any]]) -> None:
        """The alerts of the rules `fired` (`policy/rule`) fired at the decided step `step` (this rank's records
        of them: `records`): every ring whose dump names one of them dumps around `step`, once per step."""
        names = set(fired)
        if not names:
            return
        for ring in self.rings.values():
            dump = ring.keep.dump
            if dump is None or ring.rule.off:
                continue
            hit = tuple(n for n in dump.alerts if n in names)
            if not hit or any(p.ring is ring and p.step == step for p in self._pending):
                continue
            mine = [r for r in records if f"{r.get('policy')}/{r.get('rule')}" in hit]
            self._pending.append(_Pending(ring, step, hit, mine))

    def flush(self, write: Write, step: Optional[int] = None) -> None:
        """Write the dumps whose last step the rings hold (decided at `step`); with `step` None (detach) every
        dump, with what its ring holds, but those a hot reload carries over (`hold`)."""
        waiting: list[_Pending] = []
        for pending in self._pending:
            newest = pending.ring.newest
            if step is None and pending.ring.rule.key in self._held_rules:
                waiting.append(pending)  # the next attachment completes it (`held`)
                continue
            if step is not None and not pending.orphan and (step < pending.last or newest is None
                                                            or newest < pending.last):
                waiting.append(pending)
                continue
            self._dump(pending, write)
        self._pending = waiting

    def _dump(self, pending: _Pending, write: Write) -> None:
        ring = pending.ring
        rs = ring.rule
        dump = ring.keep.dump
        assert dump is not None
        spent = self._spent.setdefault(rs.policy.name, _Spent())
        steps = ring.window(pending.first, pending.last)
        header = {"run": self.run, "time": steps[-1].time if steps else 0.0, "rank": self.rank, "model": self.model,
                  "event": DUMP_EVENT, "policy": rs.policy.name, "rule": rs.rule.name, "step": pending.step,
                  "before": dump.before, "after": dump.after, "alerts": list(pending.fired),
                  "first": steps[0].step if steps else None, "last": steps[-1].step if steps else None}
        lines = [header, *pending.alerts, *self._records(ring, steps)]
        data = "".join(json.dumps(r, allow_nan=True) + "\n" for r in lines).encode("utf-8")
        policy = rs.policy
        why = (f"spec.limits.maxDumps={policy.max_dumps} reached" if spent.files >= policy.max_dumps
               else f"spec.limits.maxDumpBytes={policy.max_dump_bytes} would be passed ({spent.bytes} bytes written, "
                    f"{len(data)} more)" if spent.bytes + len(data) > policy.max_dump_bytes else None)
        if why is not None:
            spent.refused += 1
            if spent.refused == 1:
                log.warning("hookpolicy: %s: the dump of step %d (alert of %s) is not written: %s on rank %d; "
                            "later dumps past it are not written either (their count is said at detach)",
                            rule_name(rs.key), pending.step, ", ".join(pending.fired), why, self.rank)
            return
        name = dump_name(rs.key, pending.step, self.rank)
        if write(rs, lambda: self.written.append(_write_new(safe_path(self.root, dump.dir), name, data))):
            spent.files += 1
            spent.bytes += len(data)
            self._wrote(rs.key, os.path.relpath(self.written[-1], self.root), len(lines) - 1)

    def _records(self, ring: Ring, steps: Sequence[_Step]) -> Iterable[dict[str, Any]]:
        """The capture log's records (`readback._report_pass`) of `steps`, group by group."""
        rs, stats = ring.rule, ring.action.stats
        width = len(stats)
        for entry in steps:
            for row, (module, tensor) in enumerate(entry.groups):
                values = entry.values[row * width:(row + 1) * width]
                yield {"run": self.run, "time": entry.time, "step": entry.step, "rank": self.rank,
                       "model": self.model, "policy": rs.policy.name, "rule": rs.rule.name, "module": module,
                       "target": ring.target, "tensor": tensor,
                       "stats": {s: json_number(v) for s, v in zip(stats, values)}}

    def close(self, write: Write) -> None:
        """At detach: write every pending dump with what its ring holds, and say the dumps the limits refused."""
        self.flush(write, None)
        for name, spent in self._spent.items():
            if spent.refused and name not in self._held_policies:  # a reload's next attachment says it
                log.warning("hookpolicy: policy %s: %d dump(s) not written on rank %d (spec.limits.maxDumps=%d, "
                            "maxDumpBytes; %d written, %d bytes)", name, spent.refused, self.rank,
                            self._policies[name].max_dumps, spent.files, spent.bytes)

    # -- a hot reload ------------------------------------------------------------------------------------------
    def hold(self, rules: Iterable[RuleKey], policies: Iterable[str]) -> None:
        """Before the detach of a hot reload: the rings and waiting dumps of `rules` (unchanged by the reload) and
        the dump counts of `policies` (names the new set keeps) stay for the next attachment (`held`): the detach
        neither writes those dumps nor says those counts. Every other waiting dump is written at detach."""
        self._held_rules, self._held_policies = set(rules), set(policies)

    def held(self) -> Carried:
        """Take out what `hold` kept (after the detach, whose last read-back may still have fed the rings)."""
        carried = Carried({k: r for k, r in self.rings.items() if k[0] in self._held_rules},
                          [p for p in self._pending if p.ring.rule.key in self._held_rules],
                          {n: s for n, s in self._spent.items() if n in self._held_policies})
        self.rings = {k: r for k, r in self.rings.items() if k not in carried.rings}
        taken = {id(p) for p in carried.pending}
        self._pending = [p for p in self._pending if id(p) not in taken]
        self._spent = {n: s for n, s in self._spent.items() if n not in carried.spent}
        self._held_rules, self._held_policies = set(), set()
        return carried

    def adopt(self, carried: Carried, rules: Mapping[RuleKey, RuleState], same: Iterable[RuleKey]) -> None:
        """After a hot reload: continue the `carried` rings of the rules in `same` (unchanged) with their new rule
        states `rules` (each ring re-bounded by the new policy's share), complete their waiting dumps, and count
        the carried dump counts against the new policies' limits. A carried dump whose rule has no ring here is
        written at the next step with what its old ring holds."""
        same = set(same)
        moved: dict[int, Ring] = {}
        for (key, index), old in carried.rings.items():
            rs = rules.get(key)
            action = rs.rule.actions[index] if rs is not None and index < len(rs.rule.actions) else None
            if rs is None or key not in same or not isinstance(action, Capture) or action.keep is None:
                continue
            ring = self.rings[(key, index)] = Ring(rs, index, action, self._share(rs))
            ring.continues(old)
            moved[id(old)] = ring
        for pending in carried.pending:
            now = moved.get(id(pending.ring))
            if now is None:
                pending.orphan = True
            else:
                pending.ring = now
            self._pending.append(pending)
        for name, spent in carried.spent.items():
            if name in self._policies:
                self._spent[name] = spent

    def _share(self, rs: RuleState) -> int:
        return self._shares.get(rs.policy.name, rs.policy.max_ring_bytes)


def dump_name(key: RuleKey, step: int, rank: int) -> str:
    """`recorder-layers.step00000042.rank0.jsonl`: the dump of rule `key`'s ring around `step` on `rank`."""
    return file_name(f"{key[0]}-{key[1]}.step{step:08d}.rank{rank}.jsonl")


def _write_new(folder: Path, name: str, data: bytes) -> Path:
    """Write `data` as a new file `name` in `folder` (numbered `.2`, `.3`, ... when taken: a second run into the
    same folder), through a temporary file: a dump is whole or absent."""
    folder.mkdir(parents=True, exist_ok=True)
    stem, suffix = os.path.splitext(name)
    final, n = safe_path(folder, name), 1
    while final.exists():
        n += 1
        final = safe_path(folder, file_name(f"{stem}.{n}{suffix}"))
    write_whole(final, data)
    return final


def bounds(policies: Sequence[Policy], bindings: Sequence[Binding]) -> tuple[list[str], list[str]]:
    """What `explain` says of the rings: per capture with `keep`, its memory (steps x groups x stats x 8 bytes,
    and 8 bytes per group name) against its share of `maxRingBytes`, a warning when it does not fit (also said
    at attach: the ring then keeps fewer steps), and one when a dump names a rule that none of `policies` has."""
    notes: list[str] = []
    warnings: list[str] = []
    names = {f"{p.name}/{r.name}" for p in policies for r in p.rules}
    for policy in policies:
        rings = [(rule, index, action) for rule in policy.rules for index, action in enumerate(rule.actions)
                 if isinstance(action, Capture) and action.keep is not None]
        share = policy.max_ring_bytes // max(1, len(rings))
        for rule, index, action in rings:
            keep: Keep = action.keep  # type: ignore[assignment]
            bound = [b for b in bindings if b.key == (policy.name, rule.name)]
            groups, at_least = groups_on(action.per, rule.target, bound) if bound else (0, False)
            each = groups * len(action.stats) * VALUE_BYTES
            named = groups * VALUE_BYTES  # one list of group names, shared by the steps with the same groups
            total = keep.steps * each + named
            fits = keep.steps if each == 0 else min(keep.steps, max(0, share - named) // each)
            dumps = "" if keep.dump is None else (
                f"; dumps {keep.dump.before} steps before and {keep.dump.after} after an alert of "
                f"{', '.join(keep.dump.alerts)} to {keep.dump.dir}/ (at most {policy.max_dumps} files, "
                f"{policy.max_dump_bytes} bytes)")
            notes.append(f"{rule_name((policy.name, rule.name))}: action {index} keeps a ring of {keep.steps} steps x "
                         f"{'at least ' if at_least else ''}{groups} group{'s' if groups != 1 else ''} (per: "
                         f"{action.per}) x {len(action.stats)} stats x {VALUE_BYTES} bytes + {VALUE_BYTES} bytes per group "
                         f"name = {total} bytes of "
                         f"{share} (its share of spec.limits.maxRingBytes={policy.max_ring_bytes}); "
                         f"{'exported too' if keep.export else 'not exported to Prometheus'}{dumps}")
            if fits < keep.steps:
                warnings.append(f"{rule_name((policy.name, rule.name))}: action {index}'s ring needs {total} bytes for "
                                f"keep.steps={keep.steps}, more than its {share} (spec.limits.maxRingBytes): it keeps "
                                f"only the last {fits} steps")
            for on in () if keep.dump is None else keep.dump.alerts:
                if on not in names:
                    warnings.append(f"{rule_name((policy.name, rule.name))}: keep.dump.alerts names {on}, a rule none of "
                                    f"the policies given has: its ring is never dumped unless a policy with that rule "
                                    "is attached with it")
    return notes, warnings
