"""`hookpolicy report`: capture logs (JSON lines) -> one self-contained HTML page of plots.

For researchers who look at pictures, not at scrapes: per rule, target and statistic one
figure over steps with one line per module (and tensor, and rank), alert markers on the
line that alerted, skipped steps as dashed verticals, and a summary table per rule. The
figures are PNGs drawn with matplotlib (an optional extra, `hookpolicy[report]`) and
embedded as `data:` URIs, and the page forbids itself any network access (a
Content-Security-Policy of `default-src 'none'`), so it opens offline, from a mail or an
artefact store, exactly as written.

Input is what the sinks write: capture records and alert records (a HOOKPOLICY_ALERT_LOG
file, or a stderr saved from a run with `--log-format json`; lines that are not records,
such as `hookpolicy:` lines or a script's prints, are skipped and counted). A log named
`path` brings its rotated predecessors `path.1`, `path.2`, ... along; logs of several
ranks (one file each, or a shared one) are merged and told apart by their `rank`.
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

if TYPE_CHECKING:
    from ..policy.model import Policy

__all__ = ["ReportError", "Records", "read_logs", "render_report", "MISSING_MATPLOTLIB"]

MISSING_MATPLOTLIB = (
    "hookpolicy report draws with matplotlib, which is not installed: "
    "pip install 'hookpolicy[report]' (or: pip install torch==2.13.0 matplotlib)"
)

#: A series: (policy, rule, target, stat, module, tensor, rank).
SeriesKey = tuple[str, str, str, str, str, str, int]


class ReportError(Exception):
    """A report cannot be made: no usable record, or matplotlib missing."""


@dataclass
class RuleSummary:
    """What the table says about one rule: what it bound, when it fired."""

    bindings: set[tuple[str, str]] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
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


@dataclass
class Records:
    """Every usable record of the logs, as series and per-rule summaries."""

    series: dict[SeriesKey, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    #: (policy, rule, module, tensor, rank) -> {step at which an alert of that rule fired there:
    #: the statistics its condition names (every statistic of the record for a log without `condition`)}
    alerts: dict[tuple[str, str, str, str, int], dict[int, set[str]]] = field(
        default_factory=lambda: defaultdict(dict))
    #: module -> the order it first appeared in (the plan's order, which follows the model's)
    order: dict[str, int] = field(default_factory=dict)
    #: every alert: (policy, rule, step, severity)
    events: list[tuple[str, str, int, str]] = field(default_factory=list)
    #: rank -> steps an enforcing alert skipped
    skipped: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    rules: dict[tuple[str, str], RuleSummary] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    ignored: int = 0

    def add(self, record: Any) -> bool:
        """Take one parsed line; False (and nothing kept) when it is not a hookpolicy record."""
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
        summary = self.rules.setdefault((policy, rule), RuleSummary())
        summary.bindings.add((module, tensor))
        summary.ranks.add(rank)
        if record.get("event") == "alert":
            severity = str(record.get("severity", "warning"))
            summary.fired(step, severity)
            self.events.append((policy, rule, step, severity))
            condition = record.get("condition")
            named = set(values) if not isinstance(condition, str) else {
                s for s in values if re.search(rf"\b{re.escape(s)}\b", condition)}
            self.alerts[(policy, rule, module, tensor, rank)].setdefault(step, set()).update(named)
            outcome = record.get("outcome")  # absent in logs of older versions: then and mode tell
            if outcome == "step skipped" or (outcome is None and record.get("then") == "skip_step"
                                             and record.get("mode") == "enforce"):
                summary.skipped.add(step)
                self.skipped[rank].add(step)
            return True
        summary.saw(step)
        self.order.setdefault(module, len(self.order))
        for stat, value in values.items():
            self.series[(policy, rule, target, stat, module, tensor, rank)][step] = value
        return True


def log_files(paths: Iterable[str]) -> list[Path]:
    """The files to read: each path with its rotated predecessors, oldest first, once each."""
    seen: set[Path] = set()
    out: list[Path] = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise ReportError(f"{name}: no such file")
        chain = [path]
        n = 1
        while Path(f"{name}.{n}").is_file():
            chain.append(Path(f"{name}.{n}"))
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


def read_logs(paths: Sequence[str]) -> Records:
    """Parse every line of the logs; a line that is not a record (or is cut short) is counted, not fatal."""
    records = Records(files=log_files(paths))
    for path in records.files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in _bounded_lines(f):
                    try:
                        parsed = json.loads(line)
                    except (ValueError, RecursionError):  # not JSON; nested too deep for the parser
                        parsed = None
                    if not (isinstance(parsed, dict) and records.add(parsed)):
                        records.ignored += line.strip() != ""
        except OSError as exc:
            raise ReportError(f"{path}: {exc.strerror or exc}") from None
    if not records.rules:
        names = ", ".join(str(p) for p in records.files)
        raise ReportError(f"no hookpolicy record in {names} (a capture's `log: {{path: ...}}` writes them)")
    return records


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


#: Up to this many series a figure draws lines (each its own colour of tab10/tab20); a
#: per-module statistic with more modules is drawn as a heatmap only.
MAX_LINES = 20


def draw(records: Records) -> list[Figure]:
    """Every figure of the report, as PNG."""
    return [Figure(title, name, _png(fig)) for title, name, fig in figures(records)]


def figures(records: Records) -> list[tuple[str, str, Any]]:
    """(title, file name, matplotlib figure) for each figure of the report, in page order.

    Per (policy, rule, target, statistic): a line per module/tensor/rank (distinct colours,
    legend outside the axes) and, for a per-module statistic that varies, a heatmap of the
    modules (the model's order) over steps; first, the alert timeline. Every figure has the
    same step axis. Statistics of a rule equal at every point (a loss's mean and max with one
    micro-batch a step) are drawn once, titled `mean = max`.
    """
    mpl_figure = _matplotlib()
    groups: dict[tuple[str, str, str, str], list[SeriesKey]] = defaultdict(list)
    for key in sorted(records.series, key=lambda k: (k[:4], records.order.get(k[4], 0), k[4:])):
        groups[key[:4]].append(key)
    several_ranks = len({key[6] for key in records.series}) > 1
    span = _step_span(records)
    out: list[tuple[str, str, Any]] = []
    for (policy, rule, target, stat), keys in _distinct(groups, records).items():
        name = _file_name(policy, rule, target, stat.replace(" = ", "="))
        title = f"{policy}/{rule}: {target} {stat}"
        modules = list(dict.fromkeys(key[4] for key in keys))
        if len(keys) <= MAX_LINES:
            out.append((title, name, _lines(records, keys, title, stat, span, several_ranks, mpl_figure)))
        values = {v for key in keys for v in records.series[key].values() if math.isfinite(v)}
        if len(modules) > 1 and len(values) > 1:
            out.append((f"{title} per layer", name.replace(".png", "-layers.png"),
                        _heatmap(records, keys, f"{title}, per layer", stat, span, several_ranks, mpl_figure)))
    if records.events:
        out.insert(0, ("alerts and skipped steps", "alerts.png", _timeline(records, mpl_figure, span)))
    return out


def _step_span(records: Records) -> tuple[float, float]:
    """The step axis every figure shares: from the first to the last step any record has."""
    steps = [s for points in records.series.values() for s in points] + [e[2] for e in records.events]
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


def _series_label(key: SeriesKey, several_ranks: bool) -> str:
    module, tensor, rank = key[4], key[5], key[6]
    return (module or "<rule>") + (f"[{tensor}]" if tensor else "") + (f" rank {rank}" if several_ranks else "")


def _alerted(records: Records, key: SeriesKey) -> set[int]:
    """The steps at which an alert of the series' rule fired there on a condition naming this statistic."""
    policy, rule, _, stat, module, tensor, rank = key
    fired = records.alerts.get((policy, rule, module, tensor, rank), {})
    return {step for step, stats in fired.items() if any(s in stats for s in stat.split(" = "))}


def _lines(records: Records, keys: list[SeriesKey], title: str, stat: str, span: tuple[float, float],
           several_ranks: bool, mpl_figure: Any) -> Any:
    from matplotlib import colormaps

    fig = mpl_figure(figsize=(10, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    colours = colormaps["tab10" if len(keys) <= 10 else "tab20"]
    ranks = {key[6] for key in keys}
    for rank in sorted(ranks):
        for i, step in enumerate(sorted(records.skipped.get(rank, ()))):
            ax.axvline(step, color="0.45", linestyle="--", linewidth=0.8,
                       label="skipped step" if i == 0 and rank == min(ranks) else None)
    labelled = False
    finite: list[float] = []
    for n, key in enumerate(keys):
        points = sorted(records.series[key].items())
        steps = [s for s, _ in points]
        values = [v if math.isfinite(v) else math.nan for _, v in points]
        finite += [v for v in values if math.isfinite(v)]
        ax.plot(steps, values, color=colours(n % colours.N), linewidth=1.3, label=_series_label(key, several_ranks),
                marker="." if len(steps) < 30 else None)
        fired = _alerted(records, key)
        marked = [(s, v) for s, v in zip(steps, values) if s in fired and math.isfinite(v)]
        if marked:
            ax.scatter([s for s, _ in marked], [v for _, v in marked], marker="x", s=60, color="red", zorder=5,
                       label=None if labelled else "alert")
            labelled = True
    if _decades(finite):
        ax.set_yscale("log")
    ax.set_xlim(*span)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.grid(True, alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=7, ncols=1 if len(keys) <= 14 else 2)
    return fig


def _heatmap(records: Records, keys: list[SeriesKey], title: str, stat: str, span: tuple[float, float],
             several_ranks: bool, mpl_figure: Any) -> Any:
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
    fig = mpl_figure(figsize=(10, 1.4 + 0.22 * len(keys)), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_facecolor("0.85")
    norm = LogNorm(vmin=min(finite), vmax=max(finite)) if _decades(finite) else None
    # each column is centred on its step (as wide as the gap to its neighbours), so the shared step axis holds
    gaps = [b - a for a, b in zip(steps, steps[1:])] or [1]
    edges = [steps[0] - gaps[0] / 2] + [(a + b) / 2 for a, b in zip(steps, steps[1:])] + [steps[-1] + gaps[-1] / 2]
    mesh = ax.pcolormesh(edges, np.arange(len(keys) + 1) - 0.5, np.ma.masked_invalid(grid), cmap="viridis",
                         norm=norm, shading="flat")
    fig.colorbar(mesh, ax=ax, label=stat + (" (log)" if norm is not None else ""), pad=0.01)
    ax.set_yticks(range(len(keys)), [_series_label(key, several_ranks) for key in keys], fontsize=7)
    ax.set_ylim(len(keys) - 0.5, -0.5)
    ax.set_xlim(*span)
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=10)
    return fig


def _decades(values: Sequence[float]) -> bool:
    """Values span three decades or more, all positive: a log scale shows them."""
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 1e3


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


_SEVERITY_COLORS = {"info": "tab:blue", "warning": "tab:orange", "critical": "red"}


def _timeline(records: Records, mpl_figure: Any, span: tuple[float, float]) -> Any:
    """Every alert over steps, one row per rule, coloured by severity; skipped steps dashed.

    An alert of a rule that captures nothing (a bare guard) has no line to sit on; here it shows.
    """
    rules = sorted(records.rules)
    fig = mpl_figure(figsize=(10, 0.9 + 0.35 * len(rules)), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for i, step in enumerate(sorted(set().union(*records.skipped.values()))):
        ax.axvline(step, color="0.45", linestyle="--", linewidth=0.8, label="skipped step" if i == 0 else None)
    by_severity: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for policy, rule, step, severity in records.events:
        xs, ys = by_severity[severity]
        xs.append(step)
        ys.append(rules.index((policy, rule)))
    for severity, (xs, ys) in sorted(by_severity.items()):
        ax.scatter(xs, ys, marker="|", s=200, color=_SEVERITY_COLORS.get(severity, "black"), label=severity)
    ax.set_yticks(range(len(rules)), [f"{p}/{r}" for p, r in rules], fontsize=8)
    ax.set_ylim(-0.5, len(rules) - 0.5)
    ax.set_xlim(*span)
    ax.set_xlabel("step")
    ax.set_title("alerts", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=7)
    return fig


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
"""


def render_report(records: Records, figures: Sequence[Figure]) -> str:
    """The HTML page: the summary table, then every figure inline; no external resource."""
    esc = html.escape
    rows = []
    for (policy, rule), s in sorted(records.rules.items()):
        bindings = sorted((m or "<rule>") + (f"[{t}]" if t else "") for m, t in s.bindings)
        shown = ", ".join(bindings[:8]) + (f", ... ({len(bindings)} in all)" if len(bindings) > 8 else "")
        alerts = ", ".join(f"{sev} {n}" for sev, n in sorted(s.alerts.items())) or "none"
        rows.append(
            "<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in (
                f"{policy}/{rule}", shown, ", ".join(str(r) for r in sorted(s.ranks)), s.records,
                _span(s.first_step, s.last_step), alerts, _span(s.first_alert, s.last_alert), len(s.skipped),
            )) + "</tr>"
        )
    header = "".join(f"<th>{h}</th>" for h in (
        "rule", "bindings", "ranks", "records", "steps", "alerts", "first/last firing", "skipped steps"))
    body = "\n".join(
        f'<figure><img alt="{esc(f.title)}" src="data:image/png;base64,{base64.b64encode(f.png).decode()}">'
        f"<figcaption class=\"note\">{esc(f.title)}</figcaption></figure>"
        for f in figures
    )
    files = ", ".join(esc(os.fspath(p)) for p in records.files)
    ignored = f"; {records.ignored} line(s) that are not records skipped" if records.ignored else ""
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
<p class="note">From {files}{ignored}.</p>
<table>
<thead><tr>{header}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody>
</table>
{body or '<p>No statistic was captured (only alerts).</p>'}
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


def write_report(logs: Sequence[str], out: Path, png_dir: Optional[Path] = None) -> tuple[Records, list[Figure]]:
    """Read `logs`, write the HTML page to `out` and, with `png_dir`, every figure as a PNG file."""
    records = read_logs(logs)
    figures = draw(records)
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for figure in figures:
            (png_dir / figure.name).write_bytes(figure.png)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(records, figures), encoding="utf-8")
    return records, figures
