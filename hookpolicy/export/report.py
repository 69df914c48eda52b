"""`hookpolicy report`: capture logs (JSON lines) -> one self-contained HTML page of plots.

For researchers who look at pictures, not at scrapes: per rule, target and statistic one
figure over steps with one line per module (and tensor, and rank), alert markers on the
statistic the alert's condition reads, skipped steps as dashed verticals (rewinds, cool-downs and
halts in styles of their own), and a summary
table per rule. Every figure puts its plot at the same pixels, so a step sits at the same
place in every figure; a statistic that never changes is one line of the table. The
figures are PNGs drawn with matplotlib (an optional extra, `hookpolicy[report]`) and
embedded as `data:` URIs, and the page forbids itself any network access (a
Content-Security-Policy of `default-src 'none'`), so it opens offline, from a mail or an
artefact store, exactly as written.

Input is what the sinks write: capture records and alert records (the alert file kept
beside each capture log, `alert_log_beside`, which a log named on the command line brings
along; a HOOKPOLICY_ALERT_LOG file; or a stderr saved from a run with `--log-format json`;
lines that are not records, such as `hookpolicy:` lines or a script's prints, are skipped
and counted). A log named `path` brings its rotated predecessors `path.1`, `path.2`, ...
along; logs of several ranks (one file each, or a shared one) are merged and told apart by
their `rank`. Every record carries the id of its run (`run`): a page shows one run, by
default the last, or several side by side.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

from .sinks import ALERT_LOG_EVENT, DUMP_EVENT, alert_log_beside

if TYPE_CHECKING:
    from ..policy.model import Policy

__all__ = ["ReportError", "Records", "Runs", "read_logs", "read_runs", "render_report", "replayed", "replayed_page", "MISSING_MATPLOTLIB",
           "PALETTE", "alert_log_beside"]

MISSING_MATPLOTLIB = (
    "hookpolicy report draws with matplotlib, which is not installed: "
    "pip install 'hookpolicy[report]' (or: pip install torch==2.13.0 matplotlib)"
)

#: A series: (policy, rule, target, stat, module, tensor, rank).
SeriesKey = tuple[str, str, str, str, str, str, int]

#: The run of records written before records carried one.
NO_RUN = ""


class ReportError(Exception):
    """A report cannot be made: no usable record, no such run, or matplotlib missing."""


@dataclass
class RuleSummary:
    """What the table says about one rule: what it bound, when it fired."""

    bindings: set[tuple[str, str]] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    targets: set[str] = field(default_factory=set)
    records: int = 0
    first_step: Optional[int] = None
    last_step: Optional[int] = None
    alerts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    first_alert: Optional[int] = None
    last_alert: Optional[int] = None
    skipped: set[int] = field(default_factory=set)

    def saw(self, step: int) -> None:
        self.records += 1
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.last_step = step if self.last_step is None else max(self.last_step, step)

    def fired(self, step: int, severity: str) -> None:
        self.alerts[severity] += 1
        self.first_alert = step if self.first_alert is None else min(self.first_alert, step)
        self.last_alert = step if self.last_alert is None else max(self.last_alert, step)


#: In a loss rule's condition `loss` is the `mean` statistic (policy-language.md, "target: loss").
_ALIASES = {"loss": {"loss": "mean"}}


def condition_reads(condition: str, target: str, stats: Iterable[str]) -> set[str]:
    """The statistics of `stats` that an alert's condition reads: names that are not called as a
    function (`max(l2_norm, 10)` reads `l2_norm`, not `max`), a target's aliases resolved."""
    aliases = _ALIASES.get(target, {})
    names = {aliases.get(n, n) for n in re.findall(r"\b([A-Za-z_]\w*)\b(?!\s*\()", condition)}
    return {s for s in stats if s in names}


@dataclass
class Records:
    """Every usable record of one run (or of logs without run ids), as series and per-rule summaries."""

    series: dict[SeriesKey, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    #: (policy, rule, module, tensor, rank) -> {step at which an alert of that rule fired there:
    #: the statistics its condition reads (every statistic of the record for a log without `condition`)}
    alerts: dict[tuple[str, str, str, str, int], dict[int, set[str]]] = field(
        default_factory=lambda: defaultdict(dict))
    #: module -> the order it first appeared in (the plan's order, which follows the model's)
    order: dict[str, int] = field(default_factory=dict)
    #: every alert: (policy, rule, step, severity)
    events: list[tuple[str, str, int, str]] = field(default_factory=list)
    #: rank -> steps an enforcing alert skipped
    skipped: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    #: the steps an alert rewound, set or extended a cool-down at, or halted at (`DECISIONS`; a rewind past its
    #: max_rewinds halts) -> rank -> steps
    decided: dict[str, dict[int, set[int]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    rules: dict[tuple[str, str], RuleSummary] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    ignored: int = 0
    #: the run's id (NO_RUN for records that carry none)
    run: str = NO_RUN
    #: the model the records name (its class: a message calls the root module by it), "" when none does
    model: str = ""
    #: whether this run's alert records were kept where the report read (an alert file said so, or one was read)
    alerts_known: bool = False
    #: the earliest and latest `time` of the run's records (Unix seconds), when they have one
    started: Optional[float] = None
    ended: Optional[float] = None
    #: the flight recorder's dumps read (their `{"event": "dump"}` headers): (rank, policy, rule, step, first, last, alerts)
    dumps: list[tuple[int, str, str, int, Optional[int], Optional[int], tuple[str, ...]]] = field(default_factory=list)
    _seen_alerts: set[str] = field(default_factory=set)

    def add(self, record: Any) -> bool:
        """Take one parsed line; False (and nothing kept) when it is not a hookpolicy record."""
        if record.get("event") == ALERT_LOG_EVENT:
            self.alerts_known = True
            return True
        if record.get("event") == DUMP_EVENT:
            return self._dump(record)
        try:
            policy, rule, module = str(record["policy"]), str(record["rule"]), str(record["module"])
            target, tensor = str(record["target"]), str(record.get("tensor", ""))
            step, rank = int(record["step"]), int(record.get("rank", 0))
            stats = record["stats"]
            if not isinstance(stats, dict):
                return False
            values = {str(k): float(v) for k, v in stats.items()}
        except (KeyError, TypeError, ValueError, OverflowError):
            return False
        if not self.model and isinstance(record.get("model"), str):
            self.model = record["model"]
        when = record.get("time")
        if isinstance(when, (int, float)) and math.isfinite(when):
            self.started = when if self.started is None else min(self.started, when)
            self.ended = when if self.ended is None else max(self.ended, when)
        summary = self.rules.setdefault((policy, rule), RuleSummary())
        summary.bindings.add((module, tensor))
        summary.ranks.add(rank)
        summary.targets.add(target)
        self.order.setdefault(module, len(self.order))
        if record.get("event") == "alert":
            self.alerts_known = True
            identity = json.dumps(record, sort_keys=True, default=str)
            if identity in self._seen_alerts:  # the same record from two files (beside the log, and stderr)
                return True
            self._seen_alerts.add(identity)
            severity = str(record.get("severity", "warning"))
            summary.fired(step, severity)
            self.events.append((policy, rule, step, severity))
            condition = record.get("condition")
            named = set(values) if not isinstance(condition, str) else condition_reads(condition, target, values)
            self.alerts[(policy, rule, module, tensor, rank)].setdefault(step, set()).update(named)
            outcome = record.get("outcome")  # absent in logs of older versions: then and mode tell
            if outcome == "step skipped" or (outcome is None and record.get("then") == "skip_step"
                                             and record.get("mode") == "enforce"):
                summary.skipped.add(step)
                self.skipped[rank].add(step)
            elif isinstance(outcome, str) and outcome.endswith("; halting)"):  # a rewind past its max_rewinds
                self.decided["halting"][rank].add(step)
            elif outcome in DECISIONS:
                self.decided[str(outcome)][rank].add(step)
            return True
        summary.saw(step)
        for stat, value in values.items():
            self.series[(policy, rule, target, stat, module, tensor, rank)][step] = value
        return True

    def _dump(self, record: dict[str, Any]) -> bool:
        """A dump's header: the event it was written for (its alert records follow it in the file)."""
        try:
            first, last = record.get("first"), record.get("last")
            self.dumps.append((int(record.get("rank", 0)), str(record["policy"]), str(record["rule"]),
                               int(record["step"]), None if first is None else int(first),
                               None if last is None else int(last), tuple(str(a) for a in record.get("alerts", ()))))
        except (KeyError, TypeError, ValueError, OverflowError):
            return False
        return True

    def marked(self) -> list[int]:
        """The steps a heatmap marks: every alert's (and every dump's event), when there are at most
        MAX_MARKED of them (more are the timeline's to show)."""
        steps = sorted({e[2] for e in self.events} | {d[3] for d in self.dumps})
        return steps if len(steps) <= MAX_MARKED else sorted({d[3] for d in self.dumps})


#: The most alert steps a heatmap marks with a line.
MAX_MARKED = 20


@dataclass
class Runs:
    """The runs found in the logs, in the order they were written (the last is the newest)."""

    runs: dict[str, Records]
    files: list[Path]
    ignored: int

    def pick(self, wanted: Sequence[str] = ()) -> list[Records]:
        """The runs named by `wanted` (ids, unique prefixes, `last`, or `all`), in the order given; the last run
        when nothing is named."""
        ids = list(self.runs)
        if not wanted:
            return [self.runs[ids[-1]]]
        out: list[Records] = []
        for name in wanted:
            if name == "all":
                out += [self.runs[i] for i in ids]
                continue
            if name == "last":
                out.append(self.runs[ids[-1]])
                continue
            matches = [i for i in ids if i == name] or [i for i in ids if i.startswith(name)]
            if len(matches) != 1:
                listing = ", ".join(_run_name(i) for i in ids)
                why = "no run" if not matches else "several runs"
                raise ReportError(f"{why} {name!r} in {', '.join(str(f) for f in self.files)} (runs: {listing})")
            out.append(self.runs[matches[0]])
        return list({id(r): r for r in out}.values())


def _run_name(run: str) -> str:
    return run or "(records without a run id)"


def log_files(paths: Iterable[str]) -> list[Path]:
    """The files to read: each path with its rotated predecessors, oldest first, once each; a capture
    log brings the alert file beside it (`alert_log_beside`) when there is one."""
    seen: set[Path] = set()
    out: list[Path] = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise ReportError(f"{name}: no such file")
        beside = alert_log_beside(path)
        for base in (path, *([beside] if beside.is_file() else [])):
            chain = [base]
            n = 1
            while Path(f"{base}.{n}").is_file():
                chain.append(Path(f"{base}.{n}"))
                n += 1
            for p in reversed(chain):
                resolved = p.resolve()
                if resolved not in seen:
                    seen.add(resolved)
                    out.append(p)
    return out


#: The longest line read as a record (a record is a few KiB); a longer one is skipped
#: unread, so a file without line breaks costs this much memory, not twice its size.
MAX_LINE_CHARS = 1 << 20


def _bounded_lines(f: Any) -> Iterator[str]:
    """The lines of `f`, each at most MAX_LINE_CHARS; a longer one comes out as "" (not a record)."""
    while True:
        line = f.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
            while line and not line.endswith("\n"):  # the rest of the long line, a chunk at a time
                line = f.readline(MAX_LINE_CHARS)
            yield "\x00"  # counted as a line that is not a record
            continue
        yield line


def read_runs(paths: Sequence[str]) -> Runs:
    """Parse every line of the logs, by run; a line that is not a record (or is cut short) is counted, not fatal.

    Runs are ordered by the time of their last record (the order the lines were read where records have no
    time): a run that appended to an old log is the last, whichever file it went on in."""
    files = log_files(paths)
    runs: dict[str, Records] = {}
    ignored = 0
    last_seen: dict[str, int] = {}
    n = 0
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in _bounded_lines(f):
                    try:
                        parsed = json.loads(line)
                    except (ValueError, RecursionError):  # not JSON; nested too deep for the parser
                        parsed = None
                    run = str(parsed.get("run") or NO_RUN) if isinstance(parsed, dict) else NO_RUN
                    records = runs.get(run) or Records(files=files, run=run)
                    if isinstance(parsed, dict) and records.add(parsed):
                        runs[run] = records
                        n += 1
                        last_seen[run] = n
                    else:
                        ignored += line.strip() != ""
        except OSError as exc:
            raise ReportError(f"{path}: {exc.strerror or exc}") from None
    useful = {run: r for run, r in runs.items() if r.rules}
    if not useful:
        names = ", ".join(str(p) for p in files)
        raise ReportError(f"no hookpolicy record in {names} (a capture's `log: {{path: ...}}` writes them)")
    ordered = sorted(useful, key=lambda run: (useful[run].ended is not None, useful[run].ended or 0.0,
                                             last_seen[run]))
    for run in ordered:
        useful[run].ignored = ignored
    return Runs({run: useful[run] for run in ordered}, files, ignored)


def read_logs(paths: Sequence[str], run: Optional[str] = None) -> Records:
    """The records of one run of the logs: `run` (an id or a unique prefix), by default the last."""
    return read_runs(paths).pick([run] if run else [])[0]


@dataclass(frozen=True)
class Figure:
    """One drawn figure: its title, its file name and the PNG."""

    title: str
    name: str
    png: bytes


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure as MplFigure
    except ImportError:
        raise ReportError(MISSING_MATPLOTLIB) from None
    return MplFigure


#: Up to this many series a figure draws lines (each its own colour of PALETTE); a
#: per-module statistic with more modules is drawn as a heatmap only.
MAX_LINES = 20

#: The line colours: tab10, then ten colours picked to sit at least as far from every other one (and from the
#: alert markers' pure red) in CIELAB as tab10's closest pair; tab20 pairs two shades of one hue.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#021bf9", "#ff00ff", "#0165fc", "#3c4d03", "#ff0789", "#9a6200", "#fe828c", "#910951", "#8fb67b", "#9932cc",
)
ALERT_COLOUR = "red"

# Every figure has the same width and puts its plot at the same place (inches), so one step
# is at the same pixel column in every figure of the page.
DPI = 100
WIDTH, LEFT, PLOT = 11.0, 2.2, 6.3
TOP, BOTTOM = 0.35, 0.55
LABEL_CHARS = 34  # module names longer than this are cut at the front to fit beside the plot

_STAT_WORDS = {
    "l2_norm": "L2 norm", "abs_max": "largest absolute value", "mean": "mean", "std": "standard deviation",
    "min": "minimum", "max": "maximum", "rms": "root mean square", "zero_fraction": "fraction of zeros",
    "nonfinite": "non-finite values (count)", "numel": "number of elements",
}
_TARGET_WORDS = {
    "grad": "gradient", "weight": "weight", "input": "input", "output": "output",
    "grad_output": "gradient of the output", "grad_input": "gradient of the input", "update": "update",
    "optimizer_state": "optimizer state",
}
_LOSS_WORDS = {
    "mean": "loss (mean of the step's backward roots)", "max": "largest backward root of the step",
    "min": "smallest backward root of the step", "numel": "number of backward roots of the step",
    "nonfinite": "non-finite backward roots of the step", "std": "standard deviation of the step's backward roots",
}


def describe(target: str, stat: str) -> str:
    """A statistic of a target in plain words: `loss (mean of the step's backward roots)`, `L2 norm of the gradient`."""
    if target == "loss":
        return _LOSS_WORDS.get(stat, f"{_STAT_WORDS.get(stat, stat)} of the step's backward roots")
    return f"{_STAT_WORDS.get(stat, stat)} of the {_TARGET_WORDS.get(target, target)}"


def _describe_all(target: str, stat: str) -> str:
    """`describe`, for a figure of statistics equal at every step (`mean = max`)."""
    first, *rest = stat.split(" = ")
    return describe(target, first) + "".join(f", equal to the {describe(target, s)} at every step" for s in rest)


def draw(records: Records, span: Optional[tuple[float, float]] = None) -> list[Figure]:
    """Every figure of the report, as PNG."""
    return [Figure(title, name, _png(fig)) for title, name, fig in figures(records, span)]


def _groups(records: Records) -> dict[tuple[str, str, str, str], list[SeriesKey]]:
    groups: dict[tuple[str, str, str, str], list[SeriesKey]] = defaultdict(list)
    for key in sorted(records.series, key=lambda k: (k[:4], records.order.get(k[4], 0), k[4:])):
        groups[key[:4]].append(key)
    return groups


def _constant(records: Records, keys: list[SeriesKey]) -> Optional[dict[SeriesKey, float]]:
    """Each series' one value when every series of a statistic holds one value at every step, else None."""
    out: dict[SeriesKey, float] = {}
    for key in keys:
        values = {v if math.isfinite(v) else repr(v) for v in records.series[key].values()}
        if len(values) != 1:
            return None
        (value,) = values
        out[key] = float(value)
    return out


def constants(records: Records) -> list[str]:
    """The statistics that never changed, one line each: `non-finite values (count) of the gradient: 0 on all
    24 modules at every step (0-199)` (drawn, they would be flat lines)."""
    lines = []
    several_ranks = len({key[6] for key in records.series}) > 1
    for (policy, rule, target, stat), keys in _groups(records).items():
        values = _constant(records, keys)
        if values is None:
            continue
        steps = [s for key in keys for s in records.series[key]]
        when = f"in every record (steps {_span(min(steps), max(steps))})"
        what = f"{policy}/{rule}: {describe(target, stat)}"
        distinct = set(map(repr, values.values()))
        modules = {key[4:6] for key in keys}
        if len(distinct) == 1:
            value = _number(next(iter(values.values())))
            if len(keys) == 1:
                lines.append(f"{what}: {value} {when} ({_series_label(keys[0], several_ranks, target)})")
            else:
                ranks = len({key[6] for key in keys})
                where = _plural(len(modules), "module") if "" not in {m for m, _ in modules} else _plural(len(keys), "series")
                lines.append(f"{what}: {value} on all {where}" + (f" of {ranks} ranks" if ranks > 1 else "")
                             + f" {when}")
        else:
            each = [f"{_series_label(key, several_ranks, target)} {_number(v)}" for key, v in values.items()]
            shown = ", ".join(each[:8]) + (f", ... ({len(each)} in all)" if len(each) > 8 else "")
            lines.append(f"{what}: {when} the same, per module: {shown}")
    return lines


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _number(value: float) -> str:
    return f"{value:g}" if math.isfinite(value) else str(value)


def figures(records: Records, span: Optional[tuple[float, float]] = None) -> list[tuple[str, str, Any]]:
    """(title, file name, matplotlib figure) for each figure of the report, in page order.

    Per (policy, rule, target, statistic) that changes: a line per module/tensor/rank
    (distinct colours, legend beside the plot in the model's order, the alert entry last)
    and, for a per-module statistic that varies, a heatmap of the modules (the model's
    order) over steps; first, the alert timeline. Every figure has the same step axis at
    the same pixels (`span`: by default the run's steps). Statistics of a rule equal at every
    point (a loss's mean and max with one micro-batch a step) are drawn once. A statistic
    that never changes is no figure: `constants` says it in one line.
    """
    mpl_figure = _matplotlib()
    groups = {group: keys for group, keys in _groups(records).items() if _constant(records, keys) is None}
    several_ranks = len({key[6] for key in records.series}) > 1
    span = span or step_span([records])
    out: list[tuple[str, str, Any]] = []
    for (policy, rule, target, stat), keys in _distinct(groups, records).items():
        name = _file_name(policy, rule, target, stat.replace(" = ", "="))
        title = f"{policy}/{rule}: {_describe_all(target, stat)}"
        modules = list(dict.fromkeys(key[4] for key in keys))
        if len(keys) <= MAX_LINES:
            out.append((title, name, _lines(records, keys, title, target, stat, span, several_ranks, mpl_figure)))
        values = {v for key in keys for v in records.series[key].values() if math.isfinite(v)}
        if len(modules) > 1 and len(values) > 1:
            out.append((f"{title}, per layer", name.replace(".png", "-layers.png"),
                        _heatmap(records, keys, f"{title}, per layer", target, stat, span, several_ranks,
                                 mpl_figure)))
    if records.events:
        out.insert(0, ("alerts and skipped steps", "alerts.png", _timeline(records, mpl_figure, span)))
    return out


def step_span(runs: Sequence[Records]) -> tuple[float, float]:
    """The step axis every figure shares: from the first to the last step any record of the runs has."""
    steps = [s for records in runs for points in records.series.values() for s in points]
    steps += [e[2] for records in runs for e in records.events]
    lo, hi = (min(steps), max(steps)) if steps else (0, 1)
    pad = max(0.5, (hi - lo) * 0.01)
    return lo - pad, hi + pad


def _distinct(groups: dict[tuple[str, str, str, str], list[SeriesKey]],
              records: Records) -> dict[tuple[str, str, str, str], list[SeriesKey]]:
    """The groups without repeats: a statistic whose every series equals another statistic's of the
    same rule and target is folded into that one's figure (titled `mean = max`)."""
    out: dict[tuple[str, str, str, str], list[SeriesKey]] = {}
    fingerprints: dict[tuple[Any, ...], tuple[str, str, str, str]] = {}
    for group, keys in groups.items():
        policy, rule, target, stat = group
        shape = (policy, rule, target, tuple(
            (key[4:], tuple(sorted((s, v if math.isfinite(v) else repr(v)) for s, v in records.series[key].items())))
            for key in keys))
        same = fingerprints.get(shape)
        if same is None:
            fingerprints[shape] = group
            out[group] = keys
        else:
            kept = out.pop(same)
            merged = (same[0], same[1], same[2], f"{same[3]} = {stat}")
            fingerprints[shape] = merged
            out[merged] = kept
    return out


def _whole(target: str) -> str:
    """What a series without a module (a `per: rule` capture, the loss) stands for."""
    return "the step's loss" if target == "loss" else "all the rule's modules together"


def _series_label(key: SeriesKey, several_ranks: bool, target: str = "") -> str:
    module, tensor, rank = key[4], key[5], key[6]
    return (module or _whole(target or key[2])) + (f"[{tensor}]" if tensor else "") + (
        f", rank {rank}" if several_ranks else "")


def _fit(label: str) -> str:
    return label if len(label) <= LABEL_CHARS else "…" + label[-(LABEL_CHARS - 1):]


def _alerted(records: Records, key: SeriesKey, stat: str) -> set[int]:
    """The steps at which an alert of the series' rule fired there on a condition reading `stat` (the figure's
    statistic: `mean = max` for statistics equal at every step)."""
    policy, rule, _, _, module, tensor, rank = key
    fired = records.alerts.get((policy, rule, module, tensor, rank), {})
    return {step for step, stats in fired.items() if any(s in stats for s in stat.split(" = "))}


def _figure(mpl_figure: Any, height: float) -> tuple[Any, Any]:
    """A figure of the page's width whose plot sits at the page's fixed place; returns (figure, axes)."""
    fig = mpl_figure(figsize=(WIDTH, height), dpi=DPI)
    ax = fig.add_axes((LEFT / WIDTH, BOTTOM / height, PLOT / WIDTH, (height - TOP - BOTTOM) / height))
    return fig, ax


def _legend(fig: Any, ax: Any, handles: list[Any], height: float) -> None:
    """The legend beside the plot, at its top, in the order given."""
    x = (LEFT + PLOT + 0.15) / WIDTH
    fig.legend(handles=handles, labels=[h.get_label() for h in handles], loc="upper left",
               bbox_to_anchor=(x, 1 - TOP / height), fontsize=7, frameon=False, borderaxespad=0)


def _lines(records: Records, keys: list[SeriesKey], title: str, target: str, stat: str,
           span: tuple[float, float], several_ranks: bool, mpl_figure: Any) -> Any:
    height = max(3.6, TOP + BOTTOM + 0.17 * (len(keys) + 2))
    fig, ax = _figure(mpl_figure, height)
    ranks = {key[6] for key in keys}
    handles: list[Any] = []
    skipped = _decisions(ax, records, ranks)
    finite: list[float] = []
    alerts: list[Any] = []
    for n, key in enumerate(keys):
        points = sorted(records.series[key].items())
        steps = [s for s, _ in points]
        values = [v if math.isfinite(v) else math.nan for _, v in points]
        finite += [v for v in values if math.isfinite(v)]
        (line,) = ax.plot(steps, values, color=PALETTE[n % len(PALETTE)], linewidth=1.3,
                          label=_fit(_series_label(key, several_ranks, target)),
                          marker="." if len(steps) < 30 else None)
        handles.append(line)
        fired = _alerted(records, key, stat)
        marked = [(s, v) for s, v in zip(steps, values) if s in fired and math.isfinite(v)]
        if marked:
            alerts.append(ax.scatter([s for s, _ in marked], [v for _, v in marked], marker="x", s=60,
                                     color=ALERT_COLOUR, zorder=5, label="alert"))
    if _decades(finite):
        ax.set_yscale("log")
    ax.set_xlim(*span)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel(_STAT_WORDS.get(stat.split(" = ")[0], stat) if target != "loss" else "loss")
    ax.grid(True, alpha=0.3)
    _legend(fig, ax, handles + skipped + alerts[:1], height)
    return fig


def _heatmap(records: Records, keys: list[SeriesKey], title: str, target: str, stat: str,
             span: tuple[float, float], several_ranks: bool, mpl_figure: Any) -> Any:
    """One row per module (the model's order), one column per step; grey where a step has no value."""
    import numpy as np
    from matplotlib.colors import LogNorm

    steps = sorted({s for key in keys for s in records.series[key]})
    grid = np.full((len(keys), len(steps)), np.nan)
    column = {s: i for i, s in enumerate(steps)}
    for row, key in enumerate(keys):
        for s, v in records.series[key].items():
            grid[row, column[s]] = v if math.isfinite(v) else np.nan
    finite = [float(v) for v in grid[np.isfinite(grid)]]
    height = TOP + BOTTOM + 0.5 + 0.2 * len(keys)
    fig, ax = _figure(mpl_figure, height)
    ax.set_facecolor("0.85")
    norm = LogNorm(vmin=min(finite), vmax=max(finite)) if _decades(finite) else None
    # each column is centred on its step (as wide as the gap to its neighbours), so the shared step axis holds
    gaps = [b - a for a, b in zip(steps, steps[1:])] or [1]
    edges = [steps[0] - gaps[0] / 2] + [(a + b) / 2 for a, b in zip(steps, steps[1:])] + [steps[-1] + gaps[-1] / 2]
    mesh = ax.pcolormesh(edges, np.arange(len(keys) + 1) - 0.5, np.ma.masked_invalid(grid), cmap="viridis",
                         norm=norm, shading="flat")
    bar = fig.add_axes(((LEFT + PLOT + 0.15) / WIDTH, BOTTOM / height, 0.15 / WIDTH,
                        (height - TOP - BOTTOM) / height))
    word = _STAT_WORDS.get(stat.split(" = ")[0], stat) if target != "loss" else "loss"
    fig.colorbar(mesh, cax=bar, label=word + (" (log scale)" if norm is not None else ""))
    ax.set_yticks(range(len(keys)), [_fit(_series_label(key, several_ranks, target)) for key in keys], fontsize=7)
    ax.set_ylim(len(keys) - 0.5, -0.5)
    marks = [ax.axvline(step, color=ALERT_COLOUR, linestyle="--", linewidth=1.2, label="alert")
             for step in records.marked()]
    if marks:
        ax.legend(handles=marks[:1], loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=7, frameon=False)
    ax.set_xlim(*span)
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=10, loc="left")
    return fig


def _decades(values: Sequence[float]) -> bool:
    """Values span three decades or more, all positive: a log scale shows them."""
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 1e3


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


#: the outcomes of an alert's `then` besides a skip that a figure marks: outcome -> (label, line style, colour)
DECISIONS = {"rewinding": ("rewound step", "-.", "tab:purple"), "cooling down": ("cool-down (set or extended)", ":", "tab:blue"),
             "halting": ("halt", "-", "black")}


def _decisions(ax: Any, records: Records, ranks: Optional[set[int]] = None) -> list[Any]:
    """Skipped steps dashed, rewinds, cool-downs and halts in their own styles, on `ranks` (all by default):
    one legend handle per kind."""
    kinds = [("skipped step", "--", "0.45", records.skipped)]
    kinds += [(label, style, colour, records.decided.get(outcome, {})) for outcome, (label, style, colour)
              in DECISIONS.items()]
    handles = []
    for label, style, colour, by_rank in kinds:
        steps = set().union(*(steps for rank, steps in by_rank.items() if ranks is None or rank in ranks))
        lines = [ax.axvline(step, color=colour, linestyle=style, linewidth=0.8, label=label) for step in sorted(steps)]
        handles += lines[:1]
    return handles


_SEVERITY_COLORS = {"info": "tab:blue", "warning": "tab:orange", "critical": ALERT_COLOUR}


def _timeline(records: Records, mpl_figure: Any, span: tuple[float, float]) -> Any:
    """Every alert over steps, one row per rule, coloured by severity; skipped steps dashed, rewinds,
    cool-downs and halts in their own styles (`DECISIONS`).

    An alert of a rule that captures nothing (a bare guard) has no line to sit on; here it shows.
    """
    rules = sorted(records.rules)
    height = TOP + BOTTOM + 0.4 + 0.35 * len(rules)
    fig, ax = _figure(mpl_figure, height)
    skipped = _decisions(ax, records)
    by_severity: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for policy, rule, step, severity in records.events:
        xs, ys = by_severity[severity]
        xs.append(step)
        ys.append(rules.index((policy, rule)))
    handles = [ax.scatter(xs, ys, marker="|", s=200, color=_SEVERITY_COLORS.get(severity, "black"),
                          label=f"{severity} alert")
               for severity, (xs, ys) in sorted(by_severity.items(), key=lambda kv: _SEVERITY_ORDER.get(kv[0], 9))]
    ax.set_yticks(range(len(rules)), [_fit(f"{p}/{r}") for p, r in rules], fontsize=8)
    ax.set_ylim(-0.5, len(rules) - 0.5)
    ax.set_xlim(*span)
    ax.set_xlabel("step")
    ax.set_title("alerts, by rule", fontsize=10, loc="left")
    ax.grid(True, axis="x", alpha=0.3)
    _legend(fig, ax, skipped + handles, height)
    return fig


_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def _file_name(*parts: str) -> str:
    return "-".join("".join(c if c.isalnum() or c in "._" else "_" for c in p) for p in parts) + ".png"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 0 0 1.5em 0; }
img { max-width: 100%; }
.note { color: #666; font-size: 0.85em; }
.runs { display: grid; gap: 1em; }
"""

UNKNOWN = "unknown (no alert records)"


def _run_heading(records: Records) -> str:
    when = ""
    if records.started is not None and records.ended is not None:
        import time

        fmt = "%Y-%m-%d %H:%M:%S UTC"
        when = f", {time.strftime(fmt, time.gmtime(records.started))} to {time.strftime(fmt, time.gmtime(records.ended))}"
    dumps = "".join(f"; the flight recorder's dump of {p}/{r} on rank {rank} around the alert of {', '.join(on)} "
                    f"at step {step} (steps {_span(first, last)})"
                    for rank, p, r, step, first, last, on in sorted(records.dumps))
    return f"run {_run_name(records.run)}{when}{dumps}"


def _table(records: Records) -> str:
    esc = html.escape
    several_ranks = len({r for s in records.rules.values() for r in s.ranks}) > 1
    rows = []
    for (policy, rule), s in sorted(records.rules.items()):
        target = next(iter(s.targets)) if len(s.targets) == 1 else ""
        bindings = [(m or _whole(target)) + (f"[{t}]" if t else "")
                    for m, t in sorted(s.bindings, key=lambda b: (records.order.get(b[0], 0), b))]
        shown = ", ".join(bindings[:8]) + (f", ... ({len(bindings)} in all)" if len(bindings) > 8 else "")
        if records.alerts_known:
            alerts = ", ".join(f"{sev} {n}" for sev, n in sorted(
                s.alerts.items(), key=lambda kv: _SEVERITY_ORDER.get(kv[0], 9))) or "none"
            skipped: str = str(len(s.skipped))
            firing = _span(s.first_alert, s.last_alert)
        else:
            alerts = skipped = firing = UNKNOWN
        cells = [f"{policy}/{rule}", shown, *([", ".join(str(r) for r in sorted(s.ranks))] if several_ranks else []),
                 s.records, _span(s.first_step, s.last_step), alerts, firing, skipped]
        rows.append("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in cells) + "</tr>")
    header = "".join(f"<th>{h}</th>" for h in (
        "rule", "modules it watches (the model's order)", *(["ranks"] if several_ranks else []),
        "records", "steps", "alerts", "first/last alert step", "skipped steps"))
    table = f"<table>\n<thead><tr>{header}</tr></thead>\n<tbody>\n{chr(10).join(rows)}\n</tbody>\n</table>"
    flat = constants(records)
    if flat:
        table += ("\n<table class=\"constants\">\n<thead><tr><th>statistics that never changed</th></tr></thead>\n"
                  "<tbody>\n" + "\n".join(f"<tr><td>{esc(line)}</td></tr>" for line in flat) + "\n</tbody>\n</table>")
    return table


def _image(f: Figure) -> str:
    esc = html.escape
    return (f'<figure><img alt="{esc(f.title)}" src="data:image/png;base64,{base64.b64encode(f.png).decode()}">'
            f"<figcaption class=\"note\">{esc(f.title)}</figcaption></figure>")


def render_report(runs: Sequence[Records], figures: Sequence[Sequence[Figure]], others: Sequence[str] = (),
                  notes: Sequence[str] = ()) -> str:
    """The HTML page: per run its summary table and its constant statistics, then the figures; several
    runs side by side, one column each and a row per figure. No external resource. `others` are the runs
    of the logs not shown; `notes` lines shown above the tables (`hookpolicy replay`'s summary)."""
    esc = html.escape
    tables = "\n".join(f"<h2>{esc(_run_heading(r))}</h2>\n{_table(r)}" for r in runs)
    if notes:
        tables = "<pre class=\"replay\">" + esc("\n".join(notes)) + "</pre>\n" + tables
    if len(runs) == 1:
        if not runs[0].series:
            body = "<p>No statistic was captured (only alerts).</p>"
        else:
            body = "\n".join(_image(f) for f in figures[0]) or "<p>No statistic changed (see the table).</p>"
    else:
        order = list(dict.fromkeys(f.name for shown in figures for f in shown))
        by_name = [{f.name: f for f in shown} for shown in figures]
        heads = "".join(f"<div><strong>{esc(_run_heading(r))}</strong></div>" for r in runs)
        cells = "".join(
            "".join(f"<div>{_image(mine[name]) if name in mine else '<p class=note>not in this run</p>'}</div>"
                    for mine in by_name) for name in order)
        body = f'<div class="runs" style="grid-template-columns: repeat({len(runs)}, 1fr)">{heads}{cells}</div>'
    files = ", ".join(esc(os.fspath(p)) for p in runs[0].files)
    ignored = f"; {runs[0].ignored} line(s) that are not records skipped" if runs[0].ignored else ""
    rest = (f" The logs hold {len(others)} other run(s): {esc(', '.join(_run_name(o) for o in others))} "
            "(hookpolicy report --run ID, or --run all for every run side by side).") if others else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<title>hookpolicy report</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>hookpolicy report</h1>
<p class="note">From {files}{ignored}.{rest}</p>
{tables}
{body}
</body>
</html>
"""


def _span(first: Optional[int], last: Optional[int]) -> str:
    if first is None or last is None:
        return "-"
    return str(first) if first == last else f"{first}-{last}"


def capture_logs(policies: Iterable["Policy"]) -> list[Path]:
    """The log files the policies' captures write (absolute, under the output folder), once each."""
    from ..policy.model import Capture
    from .sinks import output_root, safe_path

    root = output_root()
    paths: dict[Path, None] = {}
    for policy in policies:
        for rule in policy.rules:
            for action in rule.actions:
                if isinstance(action, Capture) and action.log is not None and action.log.path is not None:
                    paths[safe_path(root, action.log.path)] = None
    return list(paths)


@dataclass(frozen=True)
class Written:
    """What `write_report` wrote: the runs drawn, their figures, the runs left out, the PNG folder."""

    runs: list[Records]
    figures: list[list[Figure]]
    others: list[str]
    png_dir: Optional[Path]

    @property
    def count(self) -> int:
        return sum(len(f) for f in self.figures)


def write_report(logs: Sequence[str], out: Path, png_dir: Optional[Path] = None,
                 runs: Sequence[str] = ()) -> Written:
    """Read `logs`, write the HTML page of `runs` (default: the last) to `out` and, with `png_dir`, every
    figure as a PNG file (a folder per run when there are several)."""
    found = read_runs(logs)
    chosen = found.pick(runs)
    span = step_span(chosen)
    drawn = [draw(records, span) for records in chosen]
    if png_dir is not None:
        for records, shown in zip(chosen, drawn):
            folder = png_dir if len(chosen) == 1 else png_dir / _file_name(records.run or "no-run-id")[:-4]
            folder.mkdir(parents=True, exist_ok=True)
            for figure in shown:
                (folder / figure.name).write_bytes(figure.png)
    others = [run for run in found.runs if run not in {r.run for r in chosen}]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(chosen, drawn, others), encoding="utf-8")
    return Written(chosen, drawn, others, png_dir)


def replayed(records: Records, alerts: Sequence[dict[str, Any]]) -> Records:
    """`records`' run with the alert records `alerts` (what `hookpolicy replay` would have written) instead of the
    run's own: their markers, the steps they skipped, rewound, cooled down or halted at, the table's counts."""
    shown = Records(files=records.files, run=records.run, model=records.model, ignored=records.ignored,
                    started=records.started, ended=records.ended, order=dict(records.order), alerts_known=True)
    for series, points in records.series.items():
        shown.series[series] = dict(points)
    for rule, summary in records.rules.items():
        shown.rules[rule] = RuleSummary(set(summary.bindings), set(summary.ranks), set(summary.targets),
                                        summary.records, summary.first_step, summary.last_step)
    for record in alerts:
        shown.add(record)
    return shown


def replayed_page(records: Records, alerts: Sequence[dict[str, Any]], notes: Sequence[str], out: Path) -> int:
    """Write the page of `records`' run with the replayed `alerts` (`replayed`), `notes` (the replay's summary)
    on top. Returns the number of figures."""
    shown = replayed(records, alerts)
    drawn = draw(shown)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report([shown], [drawn], notes=notes), encoding="utf-8")
    return len(drawn)
