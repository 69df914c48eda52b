"""`apply --textfile-dir DIR` (`hookpolicy/export/textfile.py`): each process writes its final series at exit
(a normal end, a halt, SIGTERM) for node_exporter's textfile collector. Read back with prometheus_client's
parser and served by Debian's prometheus-node-exporter; the reference counts are the script's own lines."""

from __future__ import annotations

import os
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from helpers import REPO
from helpers.processes import Proc, child_env, end_training
from hookpolicy.export.collector import store_for
from hookpolicy.export.metrics import STEPS
from hookpolicy.export.textfile import textfile_name, write_final

NODE_EXPORTER = shutil.which("prometheus-node-exporter")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parsed(text: str) -> Samples:
    """Every sample as (name, sorted labels) -> value; a series twice fails (node_exporter refuses that)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"{key} twice"
            samples[key] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    (found,) = [v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == w for k, w in labels.items())]
    return found


def test_the_final_series_are_written_with_their_run_and_nothing_else_is_left(tmp_path: Path) -> None:
    for run, steps in (("attempt/1 x", 3.0), ("attempt-2", 5.0)):  # two runs of rank 1 on one node
        registry = CollectorRegistry()
        store_for(registry, 1).inc(STEPS, ("MLP",), steps)
        said = write_final(registry, str(tmp_path), rank=1, run=run)
        assert said == f"wrote the final series to {tmp_path / textfile_name(run, 1)} (node_exporter's textfile collector)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hookpolicy-attempt-2-rank1.prom", "hookpolicy-attempt_1_x-rank1.prom"]
    files = [parsed(p.read_text()) for p in sorted(tmp_path.iterdir())]
    for samples, (run, steps) in zip(files, (("attempt-2", 5.0), ("attempt/1 x", 3.0))):
        assert value(samples, "hookpolicy_steps_total", rank="1", model="MLP", run=run) == steps
        assert value(samples, "hookpolicy_run_info", rank="1", run=run) == 1
        assert all(dict(labels)["run"] == run for _, labels in samples)  # every series, so two runs never collide
    assert not set(files[0]) & set(files[1])  # node_exporter refuses a series two files hold


def test_a_folder_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    said = write_final(CollectorRegistry(), str(tmp_path / "missing"), rank=0, run="r")
    assert said.startswith(f"error: could not write the final series to {tmp_path / 'missing'}/hookpolicy-r-rank0.prom: ")
    assert not (tmp_path / "missing").exists()


def test_apply_refuses_a_folder_that_does_not_exist(tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "hookpolicy", "apply", "policies/nan-guard.yaml", "--textfile-dir",
                           str(tmp_path / "missing"), "--", sys.executable, "-c", "pass"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--textfile-dir" in done.stderr and "does not exist" in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("end", ["exit", "halt", "sigterm"])
def test_apply_writes_the_final_series_at_every_end(tmp_path: Path, procs: list[Proc], end: str) -> None:
    folder = tmp_path / "textfiles"
    folder.mkdir()
    proc = end_training(procs, tmp_path, end, ["--textfile-dir", str(folder)])
    path = folder / "hookpolicy-attempt-7-rank0.prom"
    assert f"hookpolicy: wrote the final series to {path}" in proc.stderr
    assert os.listdir(folder) == [path.name]  # the temporary file was renamed, not left
    samples = parsed(path.read_text())
    run = {"rank": "0", "run": "attempt-7"}
    # the script's own lines: steps 0-11, or 0-3 when step 4 halted
    done = sum(f"step {i} loss " in proc.stdout for i in range(12))
    assert done == (4 if end == "halt" else 12)
    assert value(samples, "hookpolicy_steps_total", model="Sequential", **run) == done
    assert value(samples, "hookpolicy_alerts_total", policy="guard", rule="nan", **run) > 0
    assert value(samples, "hookpolicy_run_info", **run) == 1



@pytest.mark.skipif(NODE_EXPORTER is None,
                    reason="prometheus-node-exporter (Debian package prometheus-node-exporter) is not installed")
def test_node_exporter_serves_the_files_as_written(tmp_path: Path, procs: list[Proc], free_port: int) -> None:
    """Two runs' files in one folder: node_exporter serves both, every series as written, and reads them
    without error (it refuses the whole folder when two files hold one series)."""
    from hookpolicy.export.metrics import ALERTS

    written: Samples = {}
    for run, steps in (("attempt-1", 3.0), ("attempt-2", 5.0)):
        registry = CollectorRegistry()
        store = store_for(registry, 0)
        store.inc(STEPS, ("MLP",), steps)
        store.inc(ALERTS, ("guard", "nan", "critical", "MLP"), 2)
        write_final(registry, str(tmp_path), rank=0, run=run)
        written.update(parsed((tmp_path / textfile_name(run, 0)).read_text()))
    port = free_port
    exporter = Proc(tmp_path / "node-exporter", [
        str(NODE_EXPORTER), "--collector.disable-defaults", "--collector.textfile",
        f"--collector.textfile.directory={tmp_path}", f"--web.listen-address=127.0.0.1:{port}"], child_env())
    procs.append(exporter)
    scraped: list[str] = []

    def scrape() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                scraped.append(response.read().decode())
                return True
        except OSError:
            return False

    exporter.wait_for(scrape, 30, "node_exporter's first answer")
    samples = parsed(scraped[-1])
    assert {k: v for k, v in samples.items() if k[0].startswith("hookpolicy_")} == written
    assert value(samples, "node_textfile_scrape_error") == 0
