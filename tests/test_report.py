"""`hookpolicy report`: real capture logs in, one self-contained HTML page (and PNGs) out."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import hookpolicy
from hookpolicy.cli import cli
from hookpolicy.export.report import MISSING_MATPLOTLIB, figures, read_logs

from helpers.outputs import alert_lines

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parent.parent

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: watch}
spec:
  rules:
    - name: guard
      priority: 0
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "nonfinite > 0", per: rule, severity: critical, then: skip_step}
    - name: grads
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - capture: {stats: [l2_norm, abs_max], log: {path: logs/grads.jsonl, max_bytes: 4000, keep: 20}}
        - alert: {if: "l2_norm > 0.3", severity: warning}
"""
STEPS = 30
NAN_AT = 12


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rank: int) -> Path:
    """Train a small MLP under the policy as `rank`; returns its alert records' file: rank 0's
    HOOKPOLICY_ALERT_LOG, rank 1's stderr in the JSON format saved (`2> alerts.err`)."""
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path / f"rank{rank}"))
    (tmp_path / f"rank{rank}").mkdir()
    if rank == 0:
        monkeypatch.setenv("HOOKPOLICY_ALERT_LOG", str(tmp_path / "rank0" / "alerts.jsonl"))
    else:
        monkeypatch.delenv("HOOKPOLICY_ALERT_LOG")
        monkeypatch.setenv("HOOKPOLICY_LOG_FORMAT", "json")
    (tmp_path / "watch.yaml").write_text(POLICY)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    capsys.readouterr()
    with hookpolicy.load(str(tmp_path / "watch.yaml")).attach(model, rank=rank):
        for step in range(STEPS):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            (loss * (math_nan() if step == NAN_AT else 1.0)).backward()
            opt.step()
            opt.zero_grad()
    if rank == 0:
        return tmp_path / "rank0" / "alerts.jsonl"
    alerts = tmp_path / f"rank{rank}" / "alerts.err"
    alerts.write_text(capsys.readouterr().err)
    return alerts


def math_nan() -> float:
    return float("nan")


@pytest.fixture
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Two ranks' rotated capture logs and alert streams."""
    out = []
    for rank in (0, 1):
        alerts = run(tmp_path, monkeypatch, capsys, rank)
        out += [str(tmp_path / f"rank{rank}" / "logs" / "grads.jsonl"), str(alerts)]
    return out


def raw_records(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.startswith("{")]


def test_rotated_logs_of_two_ranks_are_read_whole(logs: list[str]) -> None:
    rotated = [p for log in (logs[0], logs[2]) for p in sorted(Path(log).parent.glob("grads.jsonl.*"))]
    assert len(rotated) >= 4, "the fixture's max_bytes must make both logs rotate"
    records = read_logs(logs)
    # Every capture record written, also those in rotated files, is in a series.
    everything = raw_records([Path(p) for p in logs] + rotated)
    captures = [r for r in everything if "event" not in r]
    assert {(r["rank"], r["module"], r["step"]) for r in captures} == {
        (key[6], key[4], step) for key, points in records.series.items() for step in points
    }
    for r in captures:
        for stat, value in r["stats"].items():
            got = records.series[("watch", "grads", "grad", stat, r["module"], "", r["rank"])][r["step"]]
            assert got == value or (got != got and value != value)
    assert {key[6] for key in records.series} == {0, 1}
    # The NaN step was skipped on both ranks, and the guard's summary says so.
    assert records.skipped == {0: {NAN_AT}, 1: {NAN_AT}}
    guard = records.rules[("watch", "guard")]
    assert dict(guard.alerts) == {"critical": 2} and guard.first_alert == guard.last_alert == NAN_AT
    warnings = [r for r in everything if r.get("event") == "alert" and r["rule"] == "grads"]
    grads = records.rules[("watch", "grads")]
    assert grads.alerts["warning"] == len(warnings) > 0
    assert grads.first_alert == min(r["step"] for r in warnings)
    assert grads.last_alert == max(r["step"] for r in warnings)
    assert grads.bindings == {("0", ""), ("2", "")}


def test_report_command_writes_self_contained_html_and_pngs(logs: list[str], tmp_path: Path) -> None:
    out, pngs = tmp_path / "report.html", tmp_path / "png"
    result = CliRunner().invoke(cli, ["report", *logs, "-o", str(out), "--png", str(pngs)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    # Nothing is fetched: every image is inline, no URL in a src or href, and the page forbids itself the network.
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", page)
    assert "default-src 'none'" in page
    images = re.findall(r'src="data:image/png;base64,', page)
    names = sorted(p.name for p in pngs.iterdir())
    assert names == ["alerts.png", "watch-grads-grad-abs_max-layers.png", "watch-grads-grad-abs_max.png",
                     "watch-grads-grad-l2_norm-layers.png", "watch-grads-grad-l2_norm.png"]
    assert len(images) == len(names)
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in pngs.iterdir())
    assert "watch/guard" in page and "critical 2" in page


def test_report_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    missing = runner.invoke(cli, ["report", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 1 and "nope.jsonl: no such file" in missing.output
    (tmp_path / "prints.txt").write_text("step 0 loss 1.0\nhookpolicy: something\n")
    empty = runner.invoke(cli, ["report", str(tmp_path / "prints.txt")])
    assert empty.exit_code == 1 and "no hookpolicy record" in empty.output
    (tmp_path / "one.jsonl").write_text(json.dumps({
        "step": 0, "rank": 0, "policy": "p", "rule": "r", "module": "m", "target": "grad", "tensor": "",
        "stats": {"l2_norm": 1.0}}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    absent = runner.invoke(cli, ["report", str(tmp_path / "one.jsonl"), "-o", str(tmp_path / "r.html")])
    assert absent.exit_code == 1 and MISSING_MATPLOTLIB in absent.output
    assert "Traceback" not in absent.output and not (tmp_path / "r.html").exists()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (CI installs it)")
def test_report_in_a_real_browser(logs: list[str], tmp_path: Path) -> None:
    """Headless Chromium opens the page offline: no console error, and the screenshot shows the plots,
    their alert crosses, and every plot's frame at the same pixel columns (one step axis)."""
    from PIL import Image

    out = tmp_path / "report.html"
    assert CliRunner().invoke(cli, ["report", *logs, "-o", str(out)]).exit_code == 0
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1200,3600", f"--screenshot={shot}", out.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot.exists(), done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line or "Content Security Policy" in line]
    assert console == []
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 3600)
    colours = {colour: n for n, colour in image.getcolors(maxcolors=1 << 24)}

    def near(rgb: tuple[int, int, int], tolerance: int = 10) -> int:
        return sum(n for c, n in colours.items() if all(abs(a - b) <= tolerance for a, b in zip(c, rgb)))

    # the 4 lines of a figure (2 modules x 2 ranks) in 4 distinct colours, tab10's first four
    tab10 = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    assert all(near(c) > 100 for c in tab10), [near(c) for c in tab10]
    assert near((255, 0, 0), 15) > 50  # the alert crosses (pure red, not tab:red)
    viridis = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
    assert sum(near(c, 25) > 20 for c in viridis) >= 3  # the per-layer heatmaps, over the colour scale
    # each plot's frame: its left and right spines, the long black vertical lines of a figure's band
    import numpy as np

    dark = np.asarray(image).max(axis=2) < 50
    runs: list[tuple[int, int, int]] = []  # (x, top, bottom) of every vertical dark run of 80 px or more
    for x in range(dark.shape[1]):
        column = np.concatenate(([False], dark[:, x], [False]))
        edges = np.flatnonzero(column[1:] != column[:-1])
        runs += [(x, int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]) if b - a >= 80]
    frames = set()
    bands = sorted({(top, bottom) for _, top, bottom in runs})
    for top, bottom in bands:
        xs = sorted(x for x, t, b in runs if (t, b) == (top, bottom))
        if len(xs) >= 2:
            frames.add((xs[0], xs[1] if xs[1] - xs[0] > 300 else xs[-1]))
    plots = [b for b in bands if sum((t, bb) == b for _, t, bb in runs) >= 2]
    assert len(plots) >= 4, bands  # the timeline and at least three figures on the screen
    assert len(frames) == 1, frames  # every plot spans the same pixel columns


def test_an_audited_skip_is_not_reported_as_a_skip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """example-monitor's nan-guard under audit: the message and the record say the step was not skipped."""
    monkeypatch.setenv("HOOKPOLICY_LOG_FORMAT", "json")
    from examples.train_mlp import build_model

    monitor = hookpolicy.load(str(Path(__file__).resolve().parent.parent / "policies" / "example-monitor.yaml"))
    messages = {}
    for audit in (False, True):
        torch.manual_seed(0)
        model = build_model()
        before: dict[str, torch.Tensor] = {}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        capsys.readouterr()
        with monitor.attach(model, audit=audit):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            (model(torch.randn(4, 8)).sum() * math_nan()).backward()
            opt.step()
        changed = any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
        (record,) = [json.loads(line) for line in capsys.readouterr().err.splitlines()
                     if line.startswith("{") and '"nan-guard"' in line]
        assert changed == audit  # the reference: whether the parameters moved
        messages[audit] = (record["outcome"], record["message"])
    assert messages[False] == ("step skipped", "non-finite gradients at step 1: step skipped")
    assert messages[True] == ("step not skipped (audit mode)",
                              "non-finite gradients at step 1: step not skipped (audit mode)")


# -- what the figures show ------------------------------------------------------------------


def drawn(fig: Any) -> Any:
    """The figure laid out as its PNG is (window extents are known after a draw)."""
    fig.draw_without_rendering()
    return fig


def overlaps(a: Any, b: Any) -> bool:
    return bool(a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1)


def test_figures_share_the_step_axis_with_distinct_colours_and_the_legend_outside(logs: list[str]) -> None:
    records = read_logs(logs)
    drawn_figures = {name: drawn(fig) for _, name, fig in figures(records)}
    assert "alerts.png" in drawn_figures
    steps = [s for points in records.series.values() for s in points]
    spans = {name: fig.axes[0].get_xlim() for name, fig in drawn_figures.items()}
    assert len(set(spans.values())) == 1, spans  # the timeline too: one step axis
    lo, hi = next(iter(spans.values()))
    assert lo <= min(steps) and max(steps) <= hi and hi - lo < (max(steps) - min(steps)) * 1.1
    for name in ("watch-grads-grad-l2_norm.png", "watch-grads-grad-abs_max.png"):
        fig = drawn_figures[name]
        ax = fig.axes[0]
        colours = [line.get_color() for line in ax.get_lines() if line.get_label() != "skipped step"
                   and line.get_linestyle() == "-"]
        assert len(colours) == 4 and len(set(colours)) == 4  # 2 modules x 2 ranks, each its own colour
        (legend,) = fig.legends
        assert not overlaps(legend.get_window_extent(), ax.get_window_extent())


def test_alert_markers_sit_only_on_the_statistics_the_condition_names(logs: list[str]) -> None:
    """The grads rule alerts on `l2_norm > 0.3`: crosses on the l2_norm lines at exactly the steps
    and modules of its alert records, none on abs_max, which the condition does not name."""
    shown = {name: fig for _, name, fig in figures(read_logs(logs))}
    ax = shown["watch-grads-grad-l2_norm.png"].axes[0]
    marked = sorted((round(float(x)), round(float(y), 6)) for c in ax.collections for x, y in c.get_offsets())
    alerts = [json.loads(line) for log in logs for line in Path(log).read_text().splitlines()
              if line.startswith("{") and '"rule": "grads"' in line and '"event": "alert"' in line]
    assert alerts and all(a["condition"] == "l2_norm > 0.3" for a in alerts)
    assert marked == sorted((a["step"], round(a["stats"]["l2_norm"], 6)) for a in alerts)
    assert len(shown["watch-grads-grad-abs_max.png"].axes[0].collections) == 0


def record(step: int, module: str, stats: dict[str, float], rule: str = "r", target: str = "grad") -> dict[str, Any]:
    return {"step": step, "rank": 0, "policy": "p", "rule": rule, "module": module, "target": target, "tensor": "",
            "stats": stats}


def test_equal_statistics_are_drawn_once_and_values_over_decades_on_a_log_scale(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    lines = [record(s, "", {"mean": 2.0 / (s + 1), "max": 2.0 / (s + 1)}, rule="loss", target="loss")
             for s in range(20)]
    lines += [record(s, f"layer{i}", {"l2_norm": 10.0 ** (i - 12) * (1 + s)}) for s in range(20) for i in range(25)]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    shown = {name: fig for _, name, fig in figures(read_logs([str(log)]))}
    # the loss's mean and max are the same series: one figure, named for both
    assert [n for n in shown if n.startswith("p-loss")] == ["p-loss-loss-max_mean.png"]
    # 25 modules: no tangle of 25 lines, a heatmap of the layers over steps, on a log colour scale
    assert "p-r-grad-l2_norm.png" not in shown
    heat = shown["p-r-grad-l2_norm-layers.png"]
    (mesh,) = heat.axes[0].collections
    assert type(mesh.norm).__name__ == "LogNorm"
    assert [t.get_text() for t in heat.axes[0].get_yticklabels()] == [f"layer{i}" for i in range(25)]  # model order
    lines_log = tmp_path / "few.jsonl"
    lines_log.write_text("".join(json.dumps(record(s, f"l{i}", {"rms": 10.0 ** (4 * i) + s})) + "\n"
                                 for s in range(5) for i in range(2)))
    (few,) = [fig for _, name, fig in figures(read_logs([str(lines_log)])) if not name.endswith("-layers.png")]
    assert few.axes[0].get_yscale() == "log"


@pytest.mark.slow
def test_apply_writes_the_report_at_the_end_of_the_run(tmp_path: Path) -> None:
    """`hookpolicy apply --report`: the run's stderr still reaches the terminal, and the page has
    the capture log's figures and the markers of the alert records the run folder kept (a NaN
    at step 7, skipped)."""
    (tmp_path / "watch.yaml").write_text(POLICY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", "watch.yaml", "--report", "out/report.html", "--",
         sys.executable, str(REPO / "examples" / "train_mlp.py"), "--steps", "20", "--nan-at", "7"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hookpolicy: governing Sequential" in done.stderr  # the child's lines passed through
    assert [a["step"] for a in alert_lines(done.stderr) if a["rule"] == "guard"] == [7]  # readable, on stderr
    assert len([line for line in done.stdout.splitlines() if line.startswith("step ")]) == 20  # stdout untouched
    page = (tmp_path / "out" / "report.html").read_text()
    assert f"hookpolicy: report: {tmp_path / 'out' / 'report.html'} (" in done.stderr
    assert "watch/guard" in page and "critical 1" in page and "alerts and skipped steps" in page
    assert "watch/grads: L2 norm of the gradient" in page
    # A second run into the same folder, 12 steps with a NaN at step 3: `hookpolicy report LOG`, told of no alert
    # file, shows that run alone and finds its alerts beside the log.
    again = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", "watch.yaml", "--", sys.executable,
         str(REPO / "examples" / "train_mlp.py"), "--steps", "12", "--nan-at", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len([line for line in again.stdout.splitlines() if line.startswith("step ")]) == 12
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "logs" / "grads.jsonl"), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert "1 other run(s)" in result.output
    page = (tmp_path / "r.html").read_text()
    (guard,) = [row for row in page.split("<tr>") if row.startswith("<td>watch/guard</td>")]
    cells = re.findall(r"<td>(.*?)</td>", guard)
    assert cells[-4:] == ["critical 1", "3", "1"] or cells[-3:] == ["critical 1", "3", "1"], cells
    (grads,) = [row for row in page.split("<tr>") if row.startswith("<td>watch/grads</td>")]
    assert "<td>0-11</td>" in grads  # this run's 12 steps, none of the first run's 20


def test_apply_without_a_capture_log_says_there_is_no_report(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", str(REPO / "policies" / "nan-guard.yaml"), "--report", "r.html",
         "--", sys.executable, "-c", "print('no training')"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "hookpolicy: no report: no capture of the policies wrote a log" in done.stderr
    assert not (tmp_path / "r.html").exists()
