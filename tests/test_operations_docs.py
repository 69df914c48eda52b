"""Every configuration snippet of docs/operations.md, checked by the tool that reads it.

Prometheus configurations (whole, or a scrape job or relabelling placed in one) by
`promtool check config`, rule groups by `promtool check rules`, the Alertmanager
configuration by `amtool check-config`, the exporter's web config by `promtool check
web-config`, Kubernetes objects by YAML and their kind's
required fields. A YAML block no checker claims fails the test: a new snippet gets its
checker here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import yaml

from helpers import REPO

PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None or AMTOOL is None,
                                reason="promtool and amtool (Debian packages prometheus, prometheus-alertmanager)")

_PROMETHEUS_HEAD = "global: {scrape_interval: 15s}\n"


def blocks() -> list[str]:
    """operations.md's YAML code blocks, dedented as written in their list items."""
    text = (REPO / "docs" / "operations.md").read_text("utf-8")
    return [textwrap.dedent(b) for b in re.findall(r"^ *```yaml\n(.*?)^ *```", text, re.S | re.M)]


def _run(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout}{done.stderr}"


#: Debian's Prometheus is built without Kubernetes service discovery (its promtool refuses
#: `kubernetes_sd_configs` as an unknown field), so that one line is checked as YAML and
#: replaced by a static target list; the relabelling around it is checked as written.
_KUBERNETES_SD = "kubernetes_sd_configs: [{role: pod}]"


def prometheus_config(text: str, cwd: Path) -> None:
    if _KUBERNETES_SD in text:
        assert yaml.safe_load(_KUBERNETES_SD) == {"kubernetes_sd_configs": [{"role": "pod"}]}
        text = text.replace(_KUBERNETES_SD, 'static_configs: [{targets: ["pod:9400"]}]')
    assert "kubernetes_sd_configs" not in text
    (cwd / "prometheus.yml").write_text(text)
    _run([str(PROMTOOL), "check", "config", "prometheus.yml"], cwd)


def scrape_job(text: str, cwd: Path) -> None:
    prometheus_config(_PROMETHEUS_HEAD + "scrape_configs:\n" + textwrap.indent(text, "  "), cwd)


def rules(text: str, cwd: Path) -> None:
    (cwd / "rules.yml").write_text(text)
    _run([str(PROMTOOL), "check", "rules", "rules.yml"], cwd)


def alertmanager(text: str, cwd: Path) -> None:
    (cwd / "alertmanager.yml").write_text(text)
    _run([str(AMTOOL), "check-config", "alertmanager.yml"], cwd)


def kubernetes(text: str, cwd: Path) -> None:
    """Objects parse, and each whole object names its apiVersion, kind and metadata.name."""
    for doc in yaml.safe_load_all(text):
        assert isinstance(doc, (dict, list)), doc
        if isinstance(doc, dict) and "kind" in doc:
            assert doc.get("apiVersion") and doc.get("metadata", {}).get("name"), doc


def container_ports_then_scrape_job(text: str, cwd: Path) -> None:
    ports, job = text.split("\n---\n")
    kubernetes(ports, cwd)
    scrape_job(textwrap.dedent(job.split("\n", 1)[1]), cwd)  # after its `# in prometheus.yml` comment


def web_config(text: str, cwd: Path) -> None:
    """`promtool check web-config` (it loads the certificate), and hookpolicy's own loader, agree."""
    from helpers.tls import make_pki
    from hookpolicy.export.webconfig import load_web_config

    pki = make_pki(cwd)
    pki.server_cert.rename(cwd / "server.crt")
    pki.server_key.rename(cwd / "server.key")
    (cwd / "web.yml").write_text(text)
    _run([str(PROMTOOL), "check", "web-config", "web.yml"], cwd)
    load_web_config(str(cwd / "web.yml"))


def metric_relabelling(text: str, cwd: Path) -> None:
    scrape_job("- job_name: training\n  static_configs: [{targets: [\"node:9400\"]}]\n" + textwrap.indent(text, "  "), cwd)


#: (how a block starts, its checker); every block matches exactly one.
CHECKERS: list[tuple[str, Callable[[str, Path], None]]] = [
    ("# prometheus.yml\nscrape_configs:", prometheus_config),
    ("# prometheus.yml\nglobal:", prometheus_config),
    ("scrape_configs:", prometheus_config),
    ("metadata:\n  annotations:", kubernetes),
    ("# in the pod's container spec", container_ports_then_scrape_job),
    ("# alertmanager.yml", alertmanager),
    ("# web.yml", web_config),
    ("apiVersion: v1\nkind: ConfigMap", kubernetes),
    ("metric_relabel_configs:", metric_relabelling),
    ("groups:", rules),
]


def _checker(block: str) -> Callable[[str, Path], None]:
    found = [check for start, check in CHECKERS if block.startswith(start)]
    assert len(found) == 1, f"no checker (or several) for the operations.md snippet:\n{block}"
    return found[0]


@pytest.mark.parametrize("index", range(len(blocks())))
def test_every_snippet_passes_its_tool(index: int, tmp_path: Path) -> None:
    block = blocks()[index]
    _checker(block)(block, tmp_path)


def test_the_checkers_refuse_what_their_tool_refuses(tmp_path: Path) -> None:
    """The reported fault: §6's Alertmanager configuration failed `amtool check-config` as written."""
    am = next(b for b in blocks() if b.startswith("# alertmanager.yml"))
    with pytest.raises(AssertionError, match="unsupported scheme"):
        alertmanager(re.sub(r'api_url: "[^"]*"', 'api_url: "<webhook>"', am), tmp_path)
    with pytest.raises(AssertionError):
        rules("groups:\n  - name: g\n    rules:\n      - record: x\n        expr: 'sum(('\n", tmp_path)


def test_the_alerting_section_sets_an_evaluation_interval() -> None:
    """Without it Prometheus evaluates every minute: 58 s from a NaN to Alertmanager instead of 17 s."""
    (config,) = [yaml.safe_load(b) for b in blocks() if b.startswith("# prometheus.yml\nglobal:")]
    assert config["global"]["evaluation_interval"] == "15s" and config["rule_files"]
