"""`hookpolicy report`: capture logs (JSON lines) -> one self-contained HTML page of plots.

For researchers who look at pictures, not at scrapes: per rule, target and statistic one
figure over steps with one line per module (and tensor, and rank), alert markers on the
line that alerted, skipped steps as dashed verticals, and a summary table per rule. The
figures are PNGs drawn with matplotlib (an optional extra, `hookpolicy[report]`) and
embedded as `data:` URIs, and the page forbids itself any network access (a
Content-Security-Policy of `default-src 'none'`), so it opens offline, from a mail or an
artefact store, exactly as written.

Input is what the sinks write: capture records and alert records (the alert stream is
stderr, so `2> run.err` may be passed too; lines that are not records, such as
`hookpolicy:` lines or a script's prints, are skipped and counted). A log named
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
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

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
    #: (policy, rule, module, tensor, rank) -> steps at which an alert of that rule fired there
    alerts: dict[tuple[str, str, str, str, int], set[int]] = field(default_factory=lambda: defaultdict(set))
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
            self.alerts[(policy, rule, module, tensor, rank)].add(step)
            outcome = record.get("outcome")  # absent in logs of older versions: then and mode tell
            if outcome == "step skipped" or (outcome is None and record.get("then") == "skip_step"
                                             and record.get("mode") == "enforce"):
                summary.skipped.add(step)
                self.skipped[rank].add(step)
            return True
        summary.saw(step)
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


def read_logs(paths: Sequence[str]) -> Records:
    """Parse every line of the logs; a line that is not a record (or is cut short) is counted, not fatal."""
    records = Records(files=log_files(paths))
    for path in records.files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        parsed = json.loads(line)
                    except ValueError:
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


def draw(records: Records) -> list[Figure]:
    """One figure per (policy, rule, target, statistic), one line per module/tensor/rank."""
    mpl_figure = _matplotlib()
    groups: dict[tuple[str, str, str, str], list[SeriesKey]] = defaultdict(list)
    for key in sorted(records.series):
        groups[key[:4]].append(key)
    several_ranks = len({key[6] for key in records.series}) > 1
    figures = []
    for (policy, rule, target, stat), keys in groups.items():
        fig = mpl_figure(figsize=(9, 3.6), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        ranks = {key[6] for key in keys}
        for rank in sorted(ranks):
            for i, step in enumerate(sorted(records.skipped.get(rank, ()))):
                ax.axvline(step, color="0.45", linestyle="--", linewidth=0.8,
                           label="skipped step" if i == 0 and rank == min(ranks) else None)
        labelled = False
        for key in keys:
            points = sorted(records.series[key].items())
            steps = [s for s, _ in points]
            values = [v if math.isfinite(v) else math.nan for _, v in points]
            module, tensor, rank = key[4], key[5], key[6]
            label = (module or "<rule>") + (f"[{tensor}]" if tensor else "") + (f" rank {rank}" if several_ranks else "")
            (line,) = ax.plot(steps, values, marker="." if len(steps) < 60 else None, linewidth=1.2, label=label)
            fired = records.alerts.get((policy, rule, module, tensor, rank), set())
            marked = [(s, v) for s, v in zip(steps, values) if s in fired and math.isfinite(v)]
            if marked:
                ax.scatter([s for s, _ in marked], [v for _, v in marked], marker="x", s=60, color="red",
                           zorder=5, label=None if labelled else "alert")
                labelled = True
        finite = [v for key in keys for v in records.series[key].values() if math.isfinite(v)]
        if finite and min(finite) > 0 and max(finite) / min(finite) > 1e3:
            ax.set_yscale("log")
        ax.set_title(f"{policy}/{rule}: {target} {stat}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(stat)
        ax.grid(True, alpha=0.3)
        if len(keys) <= 12:
            ax.legend(fontsize=7, loc="best")
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        figures.append(Figure(f"{policy}/{rule}: {target} {stat}", _file_name(policy, rule, target, stat),
                              buffer.getvalue()))
    if records.events:
        figures.insert(0, _timeline(records, mpl_figure))
    return figures


_SEVERITY_COLORS = {"info": "tab:blue", "warning": "tab:orange", "critical": "red"}


def _timeline(records: Records, mpl_figure: Any) -> Figure:
    """Every alert over steps, one row per rule, coloured by severity; skipped steps dashed.

    An alert of a rule that captures nothing (a bare guard) has no line to sit on; here it shows.
    """
    rules = sorted(records.rules)
    fig = mpl_figure(figsize=(9, 0.9 + 0.35 * len(rules)), dpi=100, layout="constrained")
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
    ax.set_xlabel("step")
    ax.set_title("alerts", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return Figure("alerts and skipped steps", "alerts.png", buffer.getvalue())



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


def write_report(logs: Sequence[str], out: Path, png_dir: Optional[Path] = None) -> tuple[Records, list[Figure]]:
    """Read `logs`, write the HTML page to `out` and, with `png_dir`, every figure as a PNG file."""
    records = read_logs(logs)
    figures = draw(records)
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for figure in figures:
            (png_dir / figure.name).write_bytes(figure.png)
    out.write_text(render_report(records, figures), encoding="utf-8")
    return records, figures
