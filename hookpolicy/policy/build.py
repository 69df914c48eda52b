"""Build the typed, frozen `model.Policy` of a document with no problem.

`build_policy` reports every problem of a file at once: the schema's (`schema.py`) and
the semantic ones (`checks.py`: a target that does not fit the trigger, a glob that does
not compile, an `if` that does not parse...). Only a document with no problem at all is
built, and the building then trusts its shape; a key the file leaves out gets the
default of its `model` dataclass.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from ..errors import PolicyError, Problem
from .checks import check_semantics
from .document import Document
from .expr import parse, parse_value
from .messages import CLIP_NAMES, expression_names, message_fields
from .model import (
    HOOK_POINTS, LOSS, Action, After, Alert, Board, Capture, Clip, CoolDown, Dump, Keep, LogSink, Match, Policy, Rewind,
    Rule, Scale, SkipStep, Snapshots, TensorFiles, Trigger, woken_by,
)
from .schema import validate

__all__ = ["MAX_PROBLEMS", "build_policy"]

#: at most this many problems of one file are reported.
MAX_PROBLEMS = 100


def build_policy(document: Document) -> Policy:
    """The Policy a document describes; raises PolicyError listing every problem."""
    problems = validate(document) + check_semantics(document)
    if problems:
        raise PolicyError(_capped(problems))
    return _policy(document)


def _capped(problems: list[Problem]) -> list[Problem]:
    """The first MAX_PROBLEMS problems and, when there were more, a line saying so."""
    ordered = sorted(problems)
    if len(ordered) <= MAX_PROBLEMS:
        return ordered
    first_left_out = ordered[MAX_PROBLEMS]
    more = len(ordered) - MAX_PROBLEMS
    note = Problem(
        first_left_out.file, first_left_out.line, first_left_out.column, first_left_out.path,
        f"... and {more} more problems",
    )
    return ordered[:MAX_PROBLEMS] + [note]


# --------------------------------------------------------------------------- building


def _policy(document: Document) -> Policy:
    metadata, spec = document.data["metadata"], document.data["spec"]
    mode = spec.get("mode", Policy.mode)
    return Policy(
        name=metadata["name"],
        source=document.file,
        revision=document.revision,
        rules=tuple(
            _rule(rule, index, mode, document.position(("spec", "rules", index, "match"), key=True), metadata["name"])
            for index, rule in enumerate(spec["rules"])
        ),
        mode=mode,
        on_error=spec.get("onError", Policy.on_error),
        max_series=int(spec.get("limits", {}).get("maxSeries", Policy.max_series)),
        max_job_series=None if "maxJobSeries" not in spec.get("limits", {}) else int(spec["limits"]["maxJobSeries"]),
        max_history_values=int(spec.get("limits", {}).get("maxHistoryValues", Policy.max_history_values)),
        max_snapshot_bytes=(int(spec["limits"]["maxSnapshotBytes"]) if "maxSnapshotBytes" in spec.get("limits", {})
                            else None),
        max_ring_bytes=int(spec.get("limits", {}).get("maxRingBytes", Policy.max_ring_bytes)),
        max_dumps=int(spec.get("limits", {}).get("maxDumps", Policy.max_dumps)),
        max_dump_bytes=int(spec.get("limits", {}).get("maxDumpBytes", Policy.max_dump_bytes)),
        snapshots=_snapshots(spec["snapshots"]) if "snapshots" in spec else None,
        labels=dict(metadata.get("labels", {})),
        annotations=dict(metadata.get("annotations", {})),
    )


def _rule(rule: dict[str, Any], index: int, mode: str, match_at: tuple[int, int], policy: str) -> Rule:
    trigger = rule["trigger"]
    at = trigger["at"]
    target = rule.get("target", HOOK_POINTS[at][0])
    return Rule(
        name=rule["name"],
        index=index,
        trigger=_trigger(trigger, policy),
        target=target,
        match=_match(rule["match"]),
        actions=tuple(_action(item, at, target) for item in rule["actions"]),
        mode=rule.get("mode", mode),
        priority=int(rule.get("priority", Rule.priority)),
        select=tuple(s if isinstance(s, str) else int(s) for s in rule.get("select", ())),
        ranks=rule.get("ranks", "job" if target == LOSS else "own"),
        match_at=match_at,
    )


def _trigger(trigger: dict[str, Any], policy: str) -> Trigger:
    steps = trigger.get("steps", {})
    until = steps.get("until")
    after = trigger.get("after")
    return Trigger(
        at=trigger["at"],
        every=int(trigger.get("every", Trigger.every)),
        steps_from=int(steps.get("from", Trigger.steps_from)),
        steps_until=None if until is None else int(until),
        phase=trigger.get("phase", Trigger.phase),
        after=None if after is None else After(woken_by(after["alert"], policy), int(after["steps"])),
    )



def _match(match: dict[str, Any]) -> Match:
    return Match(
        modules=tuple(match.get("modules", ())),
        types=tuple(match.get("types", ())),
        root=bool(match.get("root", False)),
        exclude=tuple(match.get("exclude", ())),
        params=tuple(match.get("params", ())),
        adapters=match.get("adapters"),
        state=tuple(match.get("state", ())),
    )


def _action(item: dict[str, Any], at: str, target: str) -> Action:
    ((kind, body),) = item.items()
    return _BUILDERS[kind](body, at, target)


def _capture(body: dict[str, Any], at: str, target: str) -> Capture:
    tensors, log, board = body.get("tensors"), body.get("log"), body.get("tensorboard")
    return Capture(
        stats=tuple(body.get("stats", ())),
        per=body.get("per", Capture.per),
        series=body.get("series", Capture.series),
        tensors=None if tensors is None else TensorFiles(
            dir=tensors["dir"],
            max_files=int(tensors.get("max_files", TensorFiles.max_files)),
            max_bytes=int(tensors.get("max_bytes", TensorFiles.max_bytes)),
        ),
        log=None if log is None else LogSink(
            path=log.get("path"), max_bytes=int(log.get("max_bytes", LogSink.max_bytes)),
            keep=int(log.get("keep", LogSink.keep)),
        ),
        tensorboard=None if board is None else Board(dir=board["dir"], histograms=bool(board.get("histograms", Board.histograms))),
        keep=None if "keep" not in body else _keep(body["keep"]),
    )


def _keep(body: dict[str, Any]) -> Keep:
    dump = body.get("dump")
    return Keep(
        steps=int(body["steps"]), export=bool(body.get("export", Keep.export)),
        dump=None if dump is None else Dump(
            alerts=tuple(dict.fromkeys(dump["alerts"])), before=int(dump.get("before", Dump.before)),
            after=int(dump.get("after", Dump.after)), dir=dump.get("dir", Dump.dir),
        ),
    )


def _clip(body: dict[str, Any], at: str, target: str) -> Clip:
    if "unitwise_ratio" in body:
        return Clip(unitwise_ratio=float(body["unitwise_ratio"]), eps=float(body.get("eps", Clip.eps)))
    if "max_norm" in body:
        norm_type = body.get("norm_type", Clip.norm_type)
        threshold = body["max_norm"]
        return Clip(
            max_norm=parse_value(threshold, CLIP_NAMES) if isinstance(threshold, str) else float(threshold),
            norm_type=math.inf if norm_type == "inf" else float(norm_type),
            per=body.get("per", "rule" if at == "step" else Clip.per),  # a step clip defaults to the whole rule
            warmup=int(body.get("warmup", Clip.warmup)),
            when=parse(body["when"], CLIP_NAMES) if "when" in body else None,
        )
    low, high = body.get("min"), body.get("max")
    return Clip(min=None if low is None else float(low), max=None if high is None else float(high))


def _scale(body: dict[str, Any], at: str, target: str) -> Scale:
    return Scale(factor=float(body["factor"]))


def _alert(body: dict[str, Any], at: str, target: str) -> Alert:
    names = expression_names(target)
    message = body.get("message")
    optional: dict[str, Any] = {} if message is None else {"message": message, "fields": message_fields(message, names)}
    return Alert(
        condition=parse(body["if"], names),
        source=body["if"],
        for_=int(body.get("for", Alert.for_)),
        severity=body.get("severity", Alert.severity),
        then=body.get("then", Alert.then),
        per=body.get("per", Alert.per),
        warmup=int(body.get("warmup", Alert.warmup)),
        cool_down=_cool_down(body["cool_down"]) if body.get("then") == "cool_down" else None,
        rewind=_rewind(body.get("rewind", {})) if body.get("then") == "rewind" else None,
        skip_step=_skip_step(body["skip_step"]) if body.get("then") == "skip_step" and "skip_step" in body else None,
        **optional,
    )


def _cool_down(body: dict[str, Any]) -> CoolDown:
    return CoolDown(factor=float(body["factor"]), steps=int(body["steps"]))


def _skip_step(body: dict[str, Any]) -> SkipStep:
    bound = body.get("max_in_a_row")
    return SkipStep(max_in_a_row=None if bound is None else int(bound))


def _rewind(body: dict[str, Any]) -> Rewind:
    return Rewind(back=int(body.get("back", Rewind.back)), max_rewinds=int(body.get("max_rewinds", Rewind.max_rewinds)))


def _snapshots(body: dict[str, Any]) -> Snapshots:
    return Snapshots(every=int(body["every"]), keep=int(body.get("keep", Snapshots.keep)))


#: action name -> how to build it; the one place that knows every action.
_BUILDERS: Mapping[str, Callable[[dict[str, Any], str, str], Action]] = {
    "capture": _capture, "clip": _clip, "scale": _scale, "alert": _alert,
}
