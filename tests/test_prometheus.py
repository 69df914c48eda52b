"""hookpolicy as a Prometheus citizen: a scrape that `promtool check metrics` finds clean, and
a real Prometheus server that scrapes a training run under `hookpolicy apply`, loads the
generated alerting rules, and answers queries over its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import hookpolicy
from helpers.outputs import metric
from hookpolicy.export.collector import StoreCollector, store_for
from hookpolicy.export.metrics import STAT_LABELS
from hookpolicy.export.rules import prometheus_rules
from hookpolicy.export.store import MetricsStore
from helpers.models import make_model, train_then_evaluate

TESTS = Path(__file__).resolve().parent
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
ALL_STATS = "[l2_norm, mean, std, min, max, abs_max, rms, zero_fraction, nonfinite, numel]"

EVERYTHING = f"""\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: everything
  labels: {{team: ml-platform}}
spec:
  rules:
    - name: inputs
      match: {{modules: ["**.mlp.c_fc"]}}
      trigger: {{at: forward_pre}}
      target: input
      actions: [{{capture: {{stats: {ALL_STATS}}}}}]
    - name: outputs
      match: {{types: [Linear, LayerNorm]}}
      trigger: {{at: forward, phase: any}}
      target: output
      actions: [{{capture: {{stats: {ALL_STATS}}}}}]
    - name: forward-inputs
      match: {{modules: ["lm_head"]}}
      trigger: {{at: forward}}
      target: input
      actions: [{{capture: {{stats: {ALL_STATS}}}}}]
    - name: grad-outputs
      match: {{modules: ["**.attn.c_proj"]}}
      trigger: {{at: backward}}
      target: grad_output
      actions: [{{capture: {{stats: {ALL_STATS}}}}}]
    - name: grad-inputs
      match: {{modules: ["**.mlp.c_proj"]}}
      trigger: {{at: backward}}
      target: grad_input
      actions: [{{capture: {{stats: {ALL_STATS}}}}}]
    - name: grads
      match: {{modules: ["**"]}}
      trigger: {{at: step}}
      target: grad
      actions:
        - capture: {{stats: {ALL_STATS}, per: tensor}}
        - clip: {{max_norm: 1.0}}
        - alert: {{if: "numel > 0", severity: info, message: "always"}}
    - name: weights
      match: {{types: [Linear]}}
      trigger: {{at: step, every: 2}}
      target: weight
      actions:
        - capture: {{stats: {ALL_STATS}, per: rule}}
    - name: skip-one
      match: {{modules: ["lm_head"]}}
      trigger: {{at: step, steps: {{from: 1, until: 2}}}}
      target: grad
      actions:
        - alert: {{if: "numel > 0", severity: warning, then: skip_step}}
"""

TINY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: tiny}
spec:
  limits: {maxSeries: 2}
  rules:
    - name: too-many
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions: [{capture: {stats: [l2_norm]}}]
"""


def _scrape_after_training(tmp_path: Path) -> tuple[bytes, set[str], CollectorRegistry]:
    """A scrape taken while the policies are attached (detaching removes their gauges)."""
    (tmp_path / "everything.yaml").write_text(EVERYTHING)
    (tmp_path / "tiny.yaml").write_text(TINY)
    policies = hookpolicy.load([str(tmp_path / "everything.yaml"), str(tmp_path / "tiny.yaml")])
    model = make_model()
    reg = CollectorRegistry()
    with policies.attach(model, registry=reg, rank=0):
        train_then_evaluate(model, steps=4)
        return generate_latest(reg), {s.name for m in reg.collect() for s in m.samples}, reg


def test_scrape_has_every_family_with_samples(tmp_path: Path) -> None:
    text, names, reg = _scrape_after_training(tmp_path)
    for target in ("input", "output", "grad_output", "grad_input", "grad", "weight"):
        for stat in ("l2_norm", "mean", "std", "min", "max", "abs_max", "rms", "zero_fraction", "nonfinite", "numel"):
            assert f"hookpolicy_{target}_{stat}" in names
    for family in ("hookpolicy_steps_total", "hookpolicy_last_step_timestamp_seconds", "hookpolicy_actions_total",
                   "hookpolicy_alerts_total", "hookpolicy_alert_firing", "hookpolicy_skipped_steps_total",
                   "hookpolicy_hook_seconds_total", "hookpolicy_policy_info", "hookpolicy_config_last_reload_successful",
                   "hookpolicy_series_dropped_total"):
        assert family in names, family
    # each series beyond maxSeries is dropped and counted once, not once per step
    linears = sum(isinstance(m, torch.nn.Linear) for m in make_model().modules())
    assert metric(reg, "hookpolicy_series_dropped_total", {"policy": "tiny", "rank": "0"}) == linears - 2
    assert metric(reg, "hookpolicy_skipped_steps_total", {"policy": "everything", "rule": "skip-one", "rank": "0"}) == 1
    assert b"# HELP hookpolicy_grad_l2_norm " in text


class _ByAddMetric(Collector):
    """`reg`'s families, the statistic ones rebuilt from the store with prometheus_client's own `add_metric`."""

    def __init__(self, reg: CollectorRegistry, stats: dict[str, dict[tuple[str, ...], float]]) -> None:
        self.reg, self.stats = reg, stats

    def collect(self) -> Iterator[Metric]:
        for family in self.reg.collect():
            if family.name not in self.stats:
                yield family
                continue
            rebuilt = GaugeMetricFamily(family.name, family.documentation, labels=[*STAT_LABELS, "rank"])
            for labels, value in self.stats[family.name].items():
                rebuilt.add_metric([*labels, "0"], value)
            yield rebuilt


def test_the_statistic_families_expose_what_add_metric_would(tmp_path: Path) -> None:
    """The collector builds its statistic samples itself: the exposition is byte for byte that of `add_metric`'s."""
    (tmp_path / "everything.yaml").write_text(EVERYTHING)
    model = make_model()
    reg = CollectorRegistry()
    with hookpolicy.load(str(tmp_path / "everything.yaml")).attach(model, registry=reg, rank=0):
        train_then_evaluate(model, steps=3)
        _, stats = store_for(reg, 0).snapshot()
        assert len(stats) >= 50 and sum(len(series) for series in stats.values()) >= 500
        reference = CollectorRegistry()
        reference.register(_ByAddMetric(reg, stats))
        assert generate_latest(reg) == generate_latest(reference)
    store = MetricsStore(0)  # a series of other labels than the five (written directly): zipped as before
    store.set_stats({("hookpolicy_grad_l2_norm", ("p", "r", "m", "")): 2.5}, {})
    ours = list(StoreCollector(store).collect())[-1]
    expected = GaugeMetricFamily("hookpolicy_grad_l2_norm", ours.documentation, labels=[*STAT_LABELS, "rank"])
    expected.add_metric(["p", "r", "m", "", "0"], 2.5)
    assert ours.samples == expected.samples


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) is not installed")
def test_promtool_check_metrics_is_clean(tmp_path: Path) -> None:
    text, _, _ = _scrape_after_training(tmp_path)
    done = subprocess.run([str(PROMTOOL), "check", "metrics"], input=text, capture_output=True)
    report = (done.stdout + done.stderr).decode()
    assert done.returncode == 0 and not report.strip(), report


# --------------------------------------------------------------------------- a real server

TRAIN = """\
import sys, time
import torch
sys.path.insert(0, {tests!r})
from helpers.models import make_model, train_step

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
end = time.time() + float(sys.argv[1])
step = 0
while time.time() < end:
    train_step(model, opt, step)
    step += 1
    time.sleep(0.2)  # slowly: a few steps per scrape
print("trained", step, "steps", flush=True)
"""

WATCHED = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: watched}
spec:
  rules:
    - name: attn-norms
      match: {modules: ["**.attn.*"], types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - capture: {stats: [l2_norm]}
        - alert: {if: "numel > 0", severity: info, message: "always fires"}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    body = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _wait(what: str, probe: Callable[[], Optional[Any]], timeout: float, *procs: subprocess.Popen[Any]) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None and proc.returncode not in (0, None):
                raise AssertionError(f"{what}: {proc.args!r} exited with {proc.returncode}")
        try:
            last = probe()
            if last:
                return last
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def _stop(proc: Optional[subprocess.Popen[Any]]) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus (Debian package prometheus) is not installed")
def test_real_prometheus_scrapes_a_run_under_apply(tmp_path: Path) -> None:
    policy = tmp_path / "watched.yaml"
    policy.write_text(WATCHED)
    (tmp_path / "train.py").write_text(TRAIN.format(tests=str(TESTS)))
    (tmp_path / "hookpolicy.rules.yml").write_text(prometheus_rules(hookpolicy.load(policy).policies))
    metrics_port, prom_port = _free_port(), _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "rule_files:\n  - hookpolicy.rules.yml\n"
        "scrape_configs:\n"
        "  - job_name: hookpolicy-train\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n"
    )
    base = f"http://127.0.0.1:{prom_port}"
    env = {**os.environ, "HOOKPOLICY_OUTPUT_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    prometheus = train = None
    try:
        prometheus = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"), cwd=tmp_path,
        )
        train = subprocess.Popen(
            [sys.executable, "-m", "hookpolicy", "apply", str(policy), "--metrics-port", str(metrics_port),
             "--", sys.executable, "train.py", "15"],
            stdout=subprocess.PIPE, stderr=open(tmp_path / "train.log", "wb"), cwd=tmp_path, env=env,
        )
        _wait("prometheus ready", lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200,
              30, prometheus)

        def steps() -> list[dict[str, Any]]:
            got = _query(base, "hookpolicy_steps_total")
            return got if got and float(got[0]["value"][1]) >= 3 else []

        (series,) = _wait("hookpolicy_steps_total in Prometheus", steps, 45, prometheus, train)
        assert series["metric"] == {"__name__": "hookpolicy_steps_total", "job": "hookpolicy-train",
                                    "instance": f"127.0.0.1:{metrics_port}", "rank": "0", "model": "GPT"}
        assert float(series["value"][1]).is_integer()

        norms = _query(base, 'hookpolicy_grad_l2_norm{policy="watched", rule="attn-norms"}')
        assert {r["metric"]["module"] for r in norms} == {
            f"transformer.h.{i}.attn.{name}" for i in range(2) for name in ("c_attn", "c_proj")}
        for r in norms:
            assert r["metric"]["rank"] == "0" and "tensor" not in r["metric"]  # Prometheus drops empty labels
            assert float(r["value"][1]) > 0

        info = _query(base, "hookpolicy_policy_info")
        assert [(r["metric"]["policy"], r["metric"]["mode"], r["value"][1]) for r in info] == [("watched", "enforce", "1")]
        assert info[0]["metric"]["revision"]
        alerts = _query(base, 'hookpolicy_alerts_total{policy="watched", rule="attn-norms", severity="info"}')
        assert alerts and float(alerts[0]["value"][1]) >= 3

        # the generated rules load in a real server, evaluate cleanly, and the always-on alert fires
        groups = _get(f"{base}/api/v1/rules")["data"]["groups"]
        assert {g["name"] for g in groups} == {"hookpolicy.watched", "hookpolicy.engine"}
        assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
        firing = _wait("the alert to fire", lambda: _query(
            base, 'ALERTS{alertname="HookpolicyWatchedAttnNorms", alertstate="firing"}'), 30, prometheus)
        assert firing[0]["metric"]["severity"] == "info" and firing[0]["metric"]["rank"] == "0"
        assert not _query(base, 'ALERTS{alertname="HookpolicyTrainingStalled"}')

        assert train.stdout is not None
        out, _ = train.communicate(timeout=60)
        assert train.returncode == 0, (tmp_path / "train.log").read_text()
        assert out.decode().startswith("trained ")
    finally:
        _stop(train)
        _stop(prometheus)
