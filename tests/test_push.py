"""`apply --push-gateway` (`hookpolicy/export/push.py`): each process pushes its final series at
exit (a normal end, a halt, SIGTERM) to Debian's prometheus-pushgateway on 127.0.0.1, grouped
by job, rank and run, so a retry is a group of its own. The page through Prometheus and
Alertmanager of a 5-second job is in tests/test_alerting_e2e.py."""

from __future__ import annotations

import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from helpers.processes import Proc, child_env, end_training
from hookpolicy.export.push import push_final

PUSHGATEWAY = shutil.which("prometheus-pushgateway")
needs_pushgateway = pytest.mark.skipif(
    PUSHGATEWAY is None, reason="prometheus-pushgateway (Debian package prometheus-pushgateway) is not installed")


Samples = list[tuple[str, dict[str, str], float]]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def pushgateway(tmp_path: Path) -> Iterator[str]:
    """Debian's Pushgateway on 127.0.0.1 (no persistence), its URL."""
    if PUSHGATEWAY is None:
        pytest.skip("prometheus-pushgateway is not installed")
    port = _port()
    proc = Proc(tmp_path / "pushgateway", [PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}"], child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(lambda: _get(url + "/-/ready") is not None, 30, "the pushgateway ready")
        yield url
    finally:
        proc.proc.terminate()
        try:
            proc.proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
            proc.proc.wait()


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return None


def pushed(url: str) -> Samples:
    text = _get(url + "/metrics")
    assert text is not None
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("hookpolicy_")]


def one(samples: Samples, name: str, **labels: str) -> float:
    (value,) = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
    return value


@needs_pushgateway
def test_a_push_is_grouped_by_job_rank_and_run(pushgateway: str) -> None:
    from hookpolicy.export.collector import store_for
    from hookpolicy.export.metrics import STEPS

    for run, steps in (("attempt-1", 3.0), ("attempt-2", 5.0)):  # a retry is a group of its own
        registry = CollectorRegistry()
        store_for(registry, 1).inc(STEPS, ("MLP",), steps)
        said = push_final(registry, pushgateway, job="training", rank=1, run=run)
        assert said == f"pushed the final series to {pushgateway} (job 'training', rank 1, run '{run}')"
    samples = pushed(pushgateway)
    for run, steps in (("attempt-1", 3.0), ("attempt-2", 5.0)):
        assert one(samples, "hookpolicy_steps_total", job="training", rank="1", run=run) == steps
        assert one(samples, "hookpolicy_run_info", job="training", rank="1", run=run) == 1


def test_a_push_that_fails_is_one_line() -> None:
    port = _port()  # nothing listens there
    said = push_final(CollectorRegistry(), f"http://127.0.0.1:{port}", job="j", rank=0, run="r", timeout=2)
    assert said.startswith(f"error: could not push the final series to http://127.0.0.1:{port} (job 'j', rank 0, run 'r'): ")


@pytest.mark.slow
@needs_pushgateway
@pytest.mark.parametrize("end", ["exit", "halt", "sigterm"])
def test_apply_pushes_the_final_series_at_every_end(
    tmp_path: Path, procs: list[Proc], pushgateway: str, end: str,
) -> None:
    proc = end_training(procs, tmp_path, end, ["--push-gateway", pushgateway, "--push-job", "training"])
    assert "hookpolicy: pushed the final series to " + pushgateway in proc.stderr
    samples = pushed(pushgateway)
    group = {"job": "training", "rank": "0", "run": "attempt-7"}
    assert one(samples, "hookpolicy_steps_total", model="Sequential", **group) == (4 if end == "halt" else 12)  # the halted step 4 is not one
    assert one(samples, "hookpolicy_alerts_total", policy="guard", rule="nan", **group) > 0
    assert one(samples, "hookpolicy_run_info", **group) == 1
    assert "step 3 loss " in proc.stdout and ("step 4 loss nan" in proc.stdout) == (end != "halt")
