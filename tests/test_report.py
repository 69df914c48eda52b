"""`hookpolicy report`: real capture logs in, one self-contained HTML page (and PNGs) out."""

from __future__ import annotations

import json
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
from hookpolicy.export.report import MISSING_MATPLOTLIB, read_logs

pytest.importorskip("matplotlib")

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
    """Train a small MLP under the policy as `rank`; returns the alert stream saved as a file."""
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path / f"rank{rank}"))
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
    assert names == ["alerts.png", "watch-grads-grad-abs_max.png", "watch-grads-grad-l2_norm.png"]
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
    """Headless Chromium opens the page offline: no console error, and the screenshot shows the plots."""
    from PIL import Image

    out = tmp_path / "report.html"
    assert CliRunner().invoke(cli, ["report", *logs, "-o", str(out)]).exit_code == 0
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1000,1400", f"--screenshot={shot}", out.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot.exists(), done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line or "Content Security Policy" in line]
    assert console == []
    data = Image.open(shot).convert("RGB").tobytes()
    pixels = [data[i:i + 3] for i in range(0, len(data), 3)]
    # matplotlib's first line colour (tab:blue) and the alert markers' red are drawn, not a blank or broken page.
    blue = sum(1 for p in pixels if abs(p[0] - 31) < 12 and abs(p[1] - 119) < 12 and abs(p[2] - 180) < 12)
    red = sum(1 for p in pixels if p[0] > 200 and p[1] < 40 and p[2] < 40)
    assert blue > 200 and red > 50, (blue, red)


def test_an_audited_skip_is_not_reported_as_a_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """example-monitor's nan-guard under audit: the message and the record say the step was not skipped."""
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
