"""docs/operations.md §9's Prometheus snippets for a large fleet, checked by Prometheus's own promtool.

The recording rules (and the straggler alert) are unit-tested with `promtool test rules` on the series two ranks of
one job export (the job's value is what Prometheus itself computes from them); the
relabelling is checked inside a scrape configuration by `promtool check config`, and its
regular expression (anchored, as Prometheus anchors it) against the families and ports it
names.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from helpers import REPO

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) is not installed")


def _section_blocks() -> list[str]:
    """The YAML code blocks of operations.md §9, dedented as written in its list items."""
    text = (REPO / "docs" / "operations.md").read_text("utf-8")
    section = text.split("\n## 9. ", 1)[1].split("\n## 10. ", 1)[0]
    return [textwrap.dedent(block) for block in re.findall(r"```yaml\n(.*?)\s*```", section, re.S)]


def _block(key: str) -> str:
    (found,) = [b for b in _section_blocks() if b.lstrip().startswith(key)]
    return found


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_recording_rules_compute_the_jobs_series_as_prometheus_does(tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(_block("groups:"))
    checked = _promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    labels = 'job="train", policy="p", rule="outputs", module="0", tensor="", model="MLP"'
    counter = 'job="train", policy="p", rule="nan", severity="critical", model="MLP"'
    steps = 'job="train", model="MLP"'
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f'hookpolicy_output_abs_max{{{labels}, rank="0", instance="a:9400"}}', "values": "1 2 3 4 5 6"},
                {"series": f'hookpolicy_output_abs_max{{{labels}, rank="1", instance="a:9401"}}', "values": "7 1 1 1 1 1"},
                {"series": f'hookpolicy_alerts_total{{{counter}, rank="0", instance="a:9400"}}', "values": "0 0 0 0 0 0"},
                {"series": f'hookpolicy_alerts_total{{{counter}, rank="1", instance="a:9401"}}', "values": "0 1 2 3 4 5"},
                # 60 steps a minute on both ranks; rank 0 waits 0.5 s a step in the agreement, rank 1 (the
                # straggler) 0.05 s: a minute of rank 0 holds 30 s of waiting, 27 s more than rank 1's
                {"series": f'hookpolicy_steps_total{{{steps}, rank="0", instance="a:9400"}}', "values": "0+60x30"},
                {"series": f'hookpolicy_steps_total{{{steps}, rank="1", instance="a:9401"}}', "values": "0+60x30"},
                {"series": f'hookpolicy_agreement_wait_seconds_total{{{steps}, rank="0", instance="a:9400"}}',
                 "values": "0+30x30"},
                {"series": f'hookpolicy_agreement_wait_seconds_total{{{steps}, rank="1", instance="a:9401"}}',
                 "values": "0+3x30"},
            ],
            "promql_expr_test": [
                # the job's maximum over both ranks: rank 1's 7 at first, then rank 0's
                {"expr": "job:hookpolicy_output_abs_max:max", "eval_time": "0m",
                 "exp_samples": [{"labels": f"job:hookpolicy_output_abs_max:max{{{labels}}}", "value": 7}]},
                {"expr": "job:hookpolicy_output_abs_max:max", "eval_time": "5m",
                 "exp_samples": [{"labels": f"job:hookpolicy_output_abs_max:max{{{labels}}}", "value": 6}]},
                # one alert a minute on rank 1 only: the job's rate is 1/60 per second
                {"expr": "job:hookpolicy_alerts:rate5m", "eval_time": "5m",
                 "exp_samples": [{"labels": f"job:hookpolicy_alerts:rate5m{{{counter}}}", "value": 1 / 60}]},
                # each rank's wait per step, and the share of time the fastest rank loses to the straggler
                {"expr": "rank:hookpolicy_agreement_wait_seconds:per_step", "eval_time": "5m", "exp_samples": [
                    {"labels": f'rank:hookpolicy_agreement_wait_seconds:per_step{{{steps}, rank="0", instance="a:9400"}}',
                     "value": 0.5},
                    {"labels": f'rank:hookpolicy_agreement_wait_seconds:per_step{{{steps}, rank="1", instance="a:9401"}}',
                     "value": 0.05}]},
                {"expr": "bottomk by (job, model) (1, rank:hookpolicy_agreement_wait_seconds:per_step)", "eval_time": "5m",
                 "exp_samples": [{"labels": f'rank:hookpolicy_agreement_wait_seconds:per_step{{{steps}, rank="1", '
                                            f'instance="a:9401"}}', "value": 0.05}]},
                {"expr": "job:hookpolicy_straggler_wait:ratio", "eval_time": "5m",
                 "exp_samples": [{"labels": f"job:hookpolicy_straggler_wait:ratio{{{steps}}}", "value": 0.45}]},
            ],
            # 45 % of the time waited, for 15 minutes: the straggler alert fires (not before its for:)
            "alert_rule_test": [
                {"alertname": "HookpolicyStraggler", "eval_time": "10m", "exp_alerts": []},
                {"alertname": "HookpolicyStraggler", "eval_time": "25m", "exp_alerts": [{
                    "exp_labels": {"job": "train", "model": "MLP", "severity": "warning"},
                    "exp_annotations": {
                        "summary": "train: its fastest ranks wait 45% of their time for the slowest"}}]},
            ],
        }],
    }))
    tested = _promtool("test", "rules", "test.yml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_relabelling_is_a_valid_scrape_config_that_drops_what_it_says(tmp_path: Path) -> None:
    relabel = yaml.safe_load(_block("metric_relabel_configs:"))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({"scrape_configs": [{
        "job_name": "train", "static_configs": [{"targets": [f"node:{9400 + r}" for r in range(8)]}], **relabel}]}))
    checked = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (rule,) = relabel["metric_relabel_configs"]
    assert rule["action"] == "drop" and rule["source_labels"] == ["__name__", "instance"]
    pattern = re.compile(f"^(?:{rule['regex']})$")  # Prometheus anchors a relabel regex at both ends

    def dropped(name: str, port: int) -> bool:
        return pattern.match(f"{name};node:{port}") is not None

    for port in range(9400, 9408):  # the activation families of LOCAL_RANK 1-7 go, LOCAL_RANK 0's stay
        assert dropped("hookpolicy_output_abs_max", port) == (port != 9400)
        assert dropped("hookpolicy_grad_input_l2_norm", port) == (port != 9400)
        for kept in ("hookpolicy_grad_l2_norm", "hookpolicy_steps_total", "hookpolicy_alerts_total"):
            assert not dropped(kept, port)
