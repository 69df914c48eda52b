"""`hookpolicy report` tells the truth about one run: runs kept apart, the alert records found
beside the log, markers on the statistic a condition reads (the loss too), constant
statistics said in one line, plain words, one step axis at the same pixels, colours apart.

The references are the training loop's own numbers (its losses, the steps it ran, the
model's module order), the log's bytes as the first run left them, matplotlib's own
transforms and Pillow's CIELAB conversion (ImageCms), none of them computed by hookpolicy.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import hookpolicy
from hookpolicy.cli import cli
from hookpolicy.export.report import (
    ALERT_COLOUR, PALETTE, UNKNOWN, constants, figures, read_logs, read_runs, render_report, draw,
)

pytest.importorskip("matplotlib")

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: p}
spec:
  rules:
    - name: loss
      match: {root: true}
      trigger: {at: step}
      target: loss
      actions:
        - capture: {stats: [mean, max], per: rule, log: {path: logs/run.jsonl}}
        - alert: {if: "loss > 10", per: rule, severity: warning}
    - name: grads
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - capture: {stats: [l2_norm, nonfinite], log: {path: logs/run.jsonl}}
"""
SPIKES = {"a": (5, 17), "b": (3,)}
STEPS = {"a": 30, "b": 12}


def model_and_names() -> tuple[nn.Module, list[str]]:
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1))
    return model, [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: str) -> dict[int, float]:
    """One run into tmp_path/logs/run.jsonl under HOOKPOLICY_RUN_ID=run; the loss of each step, as the loop saw it."""
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("HOOKPOLICY_RUN_ID", run)
    monkeypatch.delenv("HOOKPOLICY_ALERT_LOG", raising=False)
    (tmp_path / "p.yaml").write_text(POLICY)
    torch.manual_seed(len(run))
    model, _ = model_and_names()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = {}
    with hookpolicy.load(str(tmp_path / "p.yaml")).attach(model):
        for step in range(STEPS[run]):
            loss = model(torch.randn(16, 6)).pow(2).mean()
            if step in SPIKES[run]:  # the value a thousand times, the gradient as it was: the run goes on as before
                loss = loss + (999 * loss).detach()
            losses[step] = loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return losses


@pytest.fixture
def two_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run `a` (30 steps), then run `b` (12 steps) appending to the same log; the bytes `a` left."""
    losses = {"a": train(tmp_path, monkeypatch, "a")}
    left = (tmp_path / "logs" / "run.jsonl").read_bytes()
    losses["b"] = train(tmp_path, monkeypatch, "b")
    return {"log": tmp_path / "logs" / "run.jsonl", "losses": losses, "left": left, "dir": tmp_path}


def test_a_second_run_appends_and_the_page_is_the_last_run(two_runs: dict[str, Any]) -> None:
    log: Path = two_runs["log"]
    assert log.read_bytes().startswith(two_runs["left"])  # the first run's records as it wrote them
    raw = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["run"] for r in raw} == {"a", "b"} and all(list(r)[0] == "run" for r in raw)
    runs = read_runs([str(log)])
    assert list(runs.runs) == ["a", "b"]
    for run, records in runs.runs.items():
        steps = {s for points in records.series.values() for s in points}
        assert steps == set(range(STEPS[run]))  # the loop's steps, none of the other run's
    last = read_logs([str(log)])
    assert last.run == "b"
    assert read_logs([str(log)], run="a").run == "a"


def test_alert_records_are_kept_beside_the_log_and_found(two_runs: dict[str, Any]) -> None:
    beside = two_runs["log"].with_name("run.alerts.jsonl")
    assert beside.is_file()
    for run in ("a", "b"):
        records = read_logs([str(two_runs["log"])], run=run)
        fired = sorted(step for _, _, step, _ in records.events)
        assert fired == sorted(s for s, loss in two_runs["losses"][run].items() if loss > 10)
        assert records.alerts_known
        page = render_report([records], [draw(records)])
        assert UNKNOWN not in page and f"warning {len(fired)}" in page


def test_a_page_without_alert_records_says_unknown_never_zero(two_runs: dict[str, Any]) -> None:
    two_runs["log"].with_name("run.alerts.jsonl").unlink()
    records = read_logs([str(two_runs["log"])])
    assert not records.alerts_known
    page = render_report([records], [draw(records)])
    rows = [row for row in page.split("<tr>") if row.startswith("<td>p/") and row.count("<td>") > 1]
    assert len(rows) == 2 and all(row.count(UNKNOWN) == 3 for row in rows)  # alerts, first/last, skipped
    assert "<td>0</td>" not in page and "<td>none</td>" not in page


def test_loss_markers_sit_on_the_loss_at_the_steps_it_spiked(two_runs: dict[str, Any]) -> None:
    """`loss > 10` reads the loss rule's `mean`: crosses at the loop's own spiking losses."""
    losses = two_runs["losses"]["a"]
    shown = {name: fig for _, name, fig in figures(read_logs([str(two_runs["log"])], run="a"))}
    (name,) = [n for n in shown if n.startswith("p-loss-loss-")]  # mean and max: one root a step, one figure
    marked = [(round(float(x)), float(y)) for c in shown[name].axes[0].collections for x, y in c.get_offsets()]
    spiked = [s for s, loss in sorted(losses.items()) if loss > 10]
    assert spiked == list(SPIKES["a"])
    assert [s for s, _ in sorted(marked)] == spiked
    for step, y in marked:
        assert math.isclose(y, losses[step], rel_tol=1e-5)
    assert not shown["p-grads-grad-l2_norm.png"].axes[0].collections  # the condition does not read it


def test_constant_statistics_are_one_line_not_a_figure(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    lines = [{"run": "r", "time": 1.0 + s, "step": s, "rank": 0, "policy": "p", "rule": "g", "module": f"layer{i}",
              "target": "grad", "tensor": "", "stats": {"nonfinite": 0, "l2_norm": 1.0 + s * (i + 1)}}
             for s in range(10) for i in range(24)]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_logs([str(log)])
    assert constants(records) == ["p/g: non-finite values (count) of the gradient: 0 on all 24 modules in every "
                                  "record (steps 0-9)"]
    names = [name for _, name, _ in figures(records)]
    assert names == ["p-g-grad-l2_norm-layers.png"]  # 24 modules: the heatmap alone; nonfinite: no figure
    page = render_report([records], [draw(records)])
    assert "0 on all 24 modules" in page and "No statistic" not in page
    only = tmp_path / "only.jsonl"
    only.write_text("".join(json.dumps({**r, "stats": {"nonfinite": 0}}) + "\n" for r in lines))
    flat = read_logs([str(only)])
    assert figures(flat) == [] and "0 on all 24 modules" in render_report([flat], [[]])


def test_figures_share_one_step_axis_at_the_same_pixels_and_the_legend_keeps_model_order(
    two_runs: dict[str, Any],
) -> None:
    records = read_logs([str(two_runs["log"])], run="a")
    drawn = {name: fig for _, name, fig in figures(records)}
    assert len(drawn) >= 3
    lo, hi = 0, STEPS["a"] - 1
    pixels = set()
    for fig in drawn.values():
        fig.draw_without_rendering()
        ax = fig.axes[0]
        width = fig.get_size_inches()[0] * fig.dpi
        pixels.add((round(width), *(round(float(ax.transData.transform((s, 1.0))[0]), 3) for s in (lo, hi))))
    assert len(pixels) == 1, pixels  # the same width, and step 0 and step 29 at the same pixel column
    _, names = model_and_names()
    legend = drawn["p-grads-grad-l2_norm.png"].legends[0]
    assert [t.get_text() for t in legend.get_texts()] == names  # the model's order
    loss_name = next(n for n in drawn if n.startswith("p-loss-loss-"))
    texts = [t.get_text() for t in drawn[loss_name].legends[0].get_texts()]
    assert texts[-1] == "alert" and texts[0] == "the step's loss"


def test_labels_are_plain_words(two_runs: dict[str, Any]) -> None:
    records = read_logs([str(two_runs["log"])], run="a")
    titles = [title for title, _, _ in figures(records)]
    assert "p/loss: loss (mean of the step's backward roots), equal to the largest backward root of the step " \
           "at every step" in titles or \
           "p/loss: largest backward root of the step, equal to the loss (mean of the step's backward roots) " \
           "at every step" in titles
    assert "p/grads: L2 norm of the gradient" in titles
    page = render_report([records], [draw(records)])
    for code in ("&lt;rule&gt;", " = ", "<th>ranks</th>", "l2_norm", "mean = max", "max = mean"):
        assert code not in page, code


def test_twenty_lines_have_twenty_colours_apart() -> None:
    """Every pair of the 20 line colours, and each against the alert marker's red, differ by more than
    tab10's closest pair less a little (CIE76 on Pillow's CIELAB); tab20's closest pair is far below."""
    from PIL import Image, ImageCms
    from matplotlib import colormaps
    from matplotlib.colors import to_hex, to_rgb

    transform = ImageCms.buildTransform(ImageCms.createProfile("sRGB"), ImageCms.createProfile("LAB"), "RGB", "LAB")

    def lab(colours: list[str]) -> list[tuple[float, float, float]]:
        image = Image.new("RGB", (len(colours), 1))
        for i, c in enumerate(colours):
            image.putpixel((i, 0), tuple(round(255 * v) for v in to_rgb(c)))
        out = ImageCms.applyTransform(image, transform)
        assert out is not None
        return [(px[0] * 100 / 255, px[1] - 128, px[2] - 128) for px in
                (out.getpixel((i, 0)) for i in range(len(colours)))]

    def closest(colours: list[str]) -> float:
        return min(math.dist(a, b) for a, b in itertools.combinations(lab(colours), 2))

    assert len(set(PALETTE)) == 20
    tab20 = closest([to_hex(c) for c in colormaps["tab20"].colors])
    assert tab20 < 20 < 28 < closest(list(PALETTE))
    red = lab([ALERT_COLOUR])[0]
    assert min(math.dist(red, c) for c in lab(list(PALETTE))) > 28


def test_the_command_picks_runs_shows_them_side_by_side_and_names_the_png_folder(two_runs: dict[str, Any]) -> None:
    log, out, png = two_runs["log"], two_runs["dir"] / "page.html", two_runs["dir"] / "png"
    runner = CliRunner()
    last = runner.invoke(cli, ["report", str(log), "-o", str(out), "--png", str(png)])
    assert last.exit_code == 0, last.output
    assert f"the figures as PNG files in {os.path.abspath(png)}{os.sep}" in last.output
    assert "1 other run(s) (--run ID, or --run all): a" in last.output
    assert "<h2>run b" in out.read_text() and "<h2>run a" not in out.read_text()
    both = runner.invoke(cli, ["report", str(log), "-o", str(out), "--run", "all", "--png", str(png / "all")])
    assert both.exit_code == 0, both.output
    page = out.read_text()
    assert "<h2>run a" in page and "<h2>run b" in page and "repeat(2, 1fr)" in page
    assert sorted(p.name for p in (png / "all").iterdir()) == ["a", "b"]
    missing = runner.invoke(cli, ["report", str(log), "-o", str(out), "--run", "c"])
    assert missing.exit_code == 1 and "no run 'c'" in missing.output and "runs: a, b" in missing.output
