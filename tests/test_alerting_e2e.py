"""docs/operations.md's promise end to end: a NaN step in a run under `hookpolicy apply`
pages through Debian's Prometheus (the rules `hookpolicy export prometheus-rules` wrote)
and Debian's Alertmanager (the guide's severity routing, as written) to a receiver."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from helpers import REPO
from helpers.processes import Proc, child_env, start_apply

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager")
PUSHGATEWAY = shutil.which("prometheus-pushgateway")
POLICIES = ["policies/nan-guard.yaml", "policies/gradient-monitor.yaml"]  # the guide's pair
BOUND = 60  # seconds from the end of training to the page at the receiver


class Receiver(http.server.ThreadingHTTPServer):
    """Alertmanager's webhook notifications, by path (one path per receiver of the route)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def alerts(self, path: str) -> list[dict[str, Any]]:
        with self.lock:
            return [a for p, body in self.received if p == path for a in body["alerts"]]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.received.append((self.path, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def guide_alertmanager_config(webhook: str) -> dict[str, Any]:
    """docs/operations.md's alertmanager.yml, as written, with each receiver a webhook to
    its own path and the group waits/intervals 1 s (the routing and inhibition untouched)."""
    text = (REPO / "docs" / "operations.md").read_text("utf-8")
    (block,) = re.findall(r"```yaml\n(# alertmanager\.yml\n.*?)```", text, re.S)
    config: dict[str, Any] = yaml.safe_load(block)
    names = [r["name"] for r in config["receivers"]]
    assert names == ["pager", "chat", "blackhole"], names
    config["receivers"] = [{"name": "pager", "webhook_configs": [{"url": f"{webhook}/pager"}]},
                           {"name": "chat", "webhook_configs": [{"url": f"{webhook}/chat"}]},
                           {"name": "blackhole"}]
    for route in [config["route"], *config["route"]["routes"]]:
        for key in ("group_wait", "group_interval"):
            if key in route:
                route[key] = "1s"
    return config


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stop(proc: Proc) -> None:
    if proc.proc.poll() is None:
        proc.proc.send_signal(signal.SIGTERM)
        try:
            proc.proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _query(port: int, promql: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["data"]["result"]
    except OSError as exc:
        return repr(exc)


@contextlib.contextmanager
def paging_stack(tmp_path: Path, procs: list[Proc], scrape_configs: list[dict[str, Any]],
                 prometheus_port: int) -> Iterator[tuple[Receiver, Proc, Proc]]:
    """Debian's Prometheus (1 s scrapes and evaluations, the rules `hookpolicy export prometheus-rules`
    writes for the guide's policies) and Alertmanager (the guide's routing) on 127.0.0.1, paging a
    webhook receiver: (receiver, prometheus, alertmanager)."""
    alertmanager_port = _port()
    rules = tmp_path / "rules"
    rules.mkdir()
    exported = subprocess.run([sys.executable, "-m", "hookpolicy", "export", "prometheus-rules", *POLICIES],
                              cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    (rules / "hookpolicy.rules.yml").write_text(exported.stdout)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules / "*.rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]},
        "scrape_configs": scrape_configs,
    }))
    receiver = Receiver()
    thread = threading.Thread(target=receiver.serve_forever, name="webhook-receiver", daemon=True)
    thread.start()
    try:
        webhook = f"http://127.0.0.1:{receiver.server_address[1]}"
        (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(guide_alertmanager_config(webhook)))
        alertmanager = Proc(tmp_path / "alertmanager", [
            str(ALERTMANAGER), f"--config.file={tmp_path / 'alertmanager.yml'}",
            f"--storage.path={tmp_path / 'alertmanager-data'}", "--cluster.listen-address=",
            f"--web.listen-address=127.0.0.1:{alertmanager_port}"], child_env())
        procs.append(alertmanager)
        prometheus = Proc(tmp_path / "prometheus", [
            str(PROMETHEUS), f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}"], child_env())
        procs.append(prometheus)
        alertmanager.wait_for(lambda: _ready(alertmanager_port), 60, "alertmanager ready")
        prometheus.wait_for(lambda: _ready(prometheus_port), 60, "prometheus ready")
        yield receiver, prometheus, alertmanager
    finally:
        receiver.shutdown()
        receiver.server_close()
        thread.join(10)
        for proc in reversed(procs):  # apply forwards SIGTERM to the script's process group
            _stop(proc)


def wait_for_page(receiver: Receiver, prometheus: Proc, alertmanager: Proc, prometheus_port: int,
                  alertname: str) -> dict[str, Any]:
    """The first alert `alertname` the pager receiver got within BOUND seconds."""
    deadline = time.monotonic() + BOUND
    paged: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not paged:
        paged = [a for a in receiver.alerts("/pager") if a["labels"].get("alertname") == alertname]
        time.sleep(0.2)
    if not paged:
        pytest.fail(
            f"no page for the NaN step within {BOUND} s; the receiver got {receiver.received}; "
            f"Prometheus' ALERTS: {_query(prometheus_port, 'ALERTS')}; "
            f"alertmanager log:\n{alertmanager.stderr[-3000:]}\nprometheus log:\n{prometheus.stderr[-3000:]}")
    return paged[0]


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus (Debian package prometheus) is not installed")
@pytest.mark.skipif(ALERTMANAGER is None,
                    reason="prometheus-alertmanager (Debian package prometheus-alertmanager) is not installed")
def test_a_nan_step_pages_through_prometheus_and_alertmanager(
        tmp_path: Path, procs: list[Proc], free_port: int) -> None:
    metrics_port, prometheus_port = free_port, free_port + 1
    scrape = [{"job_name": "training", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}]
    with paging_stack(tmp_path, procs, scrape, prometheus_port) as (receiver, prometheus, alertmanager):
        hold = tmp_path / "hold"  # the script waits after training until it exists: the series stay up
        run = start_apply(procs, tmp_path / "run", [
            *POLICIES, "--metrics-port", str(metrics_port), "--", sys.executable, "examples/train_mlp.py",
            "--steps", "20", "--nan-at", "5", "--hold-file", str(hold)])
        run.wait_for(lambda: "step 19 loss " in run.stdout, 120, "the 20 training steps")
        assert "step 5 loss nan" in run.stdout

        alert = wait_for_page(receiver, prometheus, alertmanager, prometheus_port, "HookpolicyNanGuardNonfiniteGrads")
        assert alert["status"] == "firing"
        assert {k: alert["labels"].get(k) for k in ("policy", "rule", "model", "severity", "rank", "job")} == {
            "policy": "nan-guard", "rule": "nonfinite-grads", "model": "Sequential", "severity": "critical",
            "rank": "0", "job": "training"}
        assert alert["annotations"]["summary"] == "nan-guard/nonfinite-grads: nonfinite > 0 on Sequential rank 0"
        # severity routing: critical went to the pager only, never to chat
        assert not [a for a in receiver.alerts("/chat") if a["labels"].get("severity") == "critical"]

        hold.touch()
        assert run.wait(60) == 0, run.stderr


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None or ALERTMANAGER is None or PUSHGATEWAY is None,
                    reason="prometheus, prometheus-alertmanager and prometheus-pushgateway (Debian packages)")
def test_a_nan_in_a_five_second_job_pages_through_the_pushgateway(
        tmp_path: Path, procs: list[Proc], free_port: int) -> None:
    """No scrape of the job itself (no --metrics-port): it pushes its final series at exit, Prometheus
    scrapes the Pushgateway (honor_labels, as its docs say), and the NaN pages after the job is gone."""
    pushgateway_port, prometheus_port = free_port, free_port + 1
    pushgateway = Proc(tmp_path / "pushgateway", [
        str(PUSHGATEWAY), f"--web.listen-address=127.0.0.1:{pushgateway_port}"], child_env())
    procs.append(pushgateway)
    scrape = [{"job_name": "pushgateway", "honor_labels": True,
               "static_configs": [{"targets": [f"127.0.0.1:{pushgateway_port}"]}]}]
    with paging_stack(tmp_path, procs, scrape, prometheus_port) as (receiver, prometheus, alertmanager):
        pushgateway.wait_for(lambda: _ready(pushgateway_port), 60, "pushgateway ready")
        started = time.monotonic()
        run = start_apply(procs, tmp_path / "run", [
            *POLICIES, "--push-gateway", f"http://127.0.0.1:{pushgateway_port}", "--push-job", "training", "--",
            sys.executable, "examples/train_mlp.py", "--steps", "20", "--nan-at", "5", "--sleep", "0.1"],
            HOOKPOLICY_RUN_ID="short-1")
        assert run.wait(60) == 0, run.stderr
        assert "step 5 loss nan" in run.stdout and time.monotonic() - started < 30
        ended = time.monotonic()
        alert = wait_for_page(receiver, prometheus, alertmanager, prometheus_port, "HookpolicyNanGuardNonfiniteGrads")
        assert {k: alert["labels"].get(k) for k in ("policy", "rule", "model", "severity", "rank", "job", "run")} == {
            "policy": "nan-guard", "rule": "nonfinite-grads", "model": "Sequential", "severity": "critical",
            "rank": "0", "job": "training", "run": "short-1"}
        assert time.monotonic() - ended < BOUND
        # the finished run's final states page nothing: not stalled, no reload failed
        assert not [a for a in receiver.received if any(
            x["labels"].get("alertname") in ("HookpolicyTrainingStalled", "HookpolicyReloadFailed") for x in a[1]["alerts"])]
