"""`hookpolicy export kubernetes` (`hookpolicy/export/kubernetes.py`): the PrometheusRule and PodMonitor
validated against the Prometheus Operator's CRDs as the models generated from them on PyPI
(cloudcoil-models-prometheus-operator, in the test extra) read them, the rule groups through promtool, and the example Job's ports, run identity and
ConfigMap mount against what the PodMonitor scrapes and what `apply` reads."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from click.testing import CliRunner
from cloudcoil.models.prometheus_operator import v1 as operator_v1

import hookpolicy
from helpers import REPO
from hookpolicy.cli import cli
from hookpolicy.export.kubernetes import POLICY_MOUNT, WEB_MOUNT, WEB_SECRET_KEYS, kubernetes_objects

PROMTOOL = shutil.which("promtool")
POLICIES = [REPO / "policies" / "nan-guard.yaml", REPO / "policies" / "gradient-monitor.yaml"]


def objects(**options: Any) -> dict[str, dict[str, Any]]:
    text = kubernetes_objects(hookpolicy.load([str(p) for p in POLICIES]).policies, **options)
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text)}


def _operator_reads(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as the operator's v1 model of `kind` reads it back: a field the CRD does not have is dropped."""
    model = getattr(operator_v1, kind).model_validate(obj)
    return dict(model.model_dump(by_alias=True, exclude_unset=True, mode="json"))


@pytest.mark.parametrize("kind", ["PrometheusRule", "PodMonitor"])
@pytest.mark.parametrize("web_secret", [None, "training-metrics-tls"])
def test_the_operator_objects_pass_the_operators_crd_models(kind: str, web_secret: str | None) -> None:
    obj = objects(ranks=8, web_secret=web_secret)[kind]
    assert _operator_reads(kind, obj) == obj  # every field is one of the CRD's, of its type
    typo = objects()[kind]
    field = "podMetricsEndpoints" if kind == "PodMonitor" else "groups"
    typo["spec"][field[:-1]] = typo["spec"].pop(field)  # a misspelt field is not the CRD's: it is dropped
    assert _operator_reads(kind, typo) != typo
    wrong = objects()[kind]
    wrong["spec"][field] = "not a list"
    with pytest.raises(pydantic.ValidationError):  # and a wrong type is refused
        _operator_reads(kind, wrong)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) is not installed")
def test_the_prometheus_rules_groups_pass_promtool(tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": objects()["PrometheusRule"]["spec"]["groups"]}))
    done = subprocess.run([str(PROMTOOL), "check", "rules", "rules.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_job_serves_every_rank_on_a_port_the_pod_monitor_scrapes() -> None:
    docs = objects(ranks=8, port=9400, name="llm")
    monitor, job, config_map = docs["PodMonitor"], docs["Job"], docs["ConfigMap"]
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = container["ports"]
    assert [(p["name"], p["containerPort"]) for p in ports] == [(f"hookpolicy-{r}", 9400 + r) for r in range(8)]
    assert all(len(p["name"]) <= 15 for p in ports)  # Kubernetes' limit on a port name
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [p["name"] for p in ports]
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= pod["metadata"]["labels"].items()
    args = container["args"]
    assert args[:2] == ["apply", POLICY_MOUNT] and "--watch" in args
    assert args[args.index("--metrics-port") + 1] == "9400" and args[args.index("--metrics-addr") + 1] == "0.0.0.0"
    assert args[args.index("--nproc_per_node") + 1] == "8"
    # each attempt its own run (a retried pod has a new uid), and the policies as a folder mount (no subPath)
    assert container["env"] == [{"name": "HOOKPOLICY_RUN_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == POLICY_MOUNT and "subPath" not in mount
    (volume,) = pod["spec"]["volumes"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_map["data"] == {p.name: p.read_text() for p in POLICIES}


def test_the_config_map_loads_as_the_same_policies(tmp_path: Path) -> None:
    for key, text in objects()["ConfigMap"]["data"].items():
        (tmp_path / key).write_text(text)
    loaded = hookpolicy.load(tmp_path).policies
    assert sorted((p.name, p.revision) for p in loaded) == sorted(
        (p.name, p.revision) for p in hookpolicy.load([str(p) for p in POLICIES]).policies)


def test_the_cli_writes_them_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(cli, ["export", "kubernetes", *map(str, POLICIES), "--nproc-per-node", "2"])
    assert done.exit_code == 0, done.output
    assert [d["kind"] for d in yaml.safe_load_all(done.output)] == ["PrometheusRule", "PodMonitor", "ConfigMap", "Job"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        text = POLICIES[0].read_text().replace("name: nan-guard", f"name: guard-{folder}")
        (tmp_path / folder / "guard.yaml").write_text(text)
    done = runner.invoke(cli, ["export", "kubernetes", str(tmp_path / "a"), str(tmp_path / "b")])
    assert done.exit_code == 2 and "two policy files are named 'guard.yaml'" in done.output
    done = runner.invoke(cli, ["export", "kubernetes", str(POLICIES[0]), "--metrics-port", "65535",
                               "--nproc-per-node", "2"])
    assert done.exit_code == 2 and "do not fit the port range" in done.output


def test_with_a_web_config_secret_the_pod_serves_tls_and_the_pod_monitor_scrapes_it(tmp_path: Path) -> None:
    """The Job mounts only the pod's three files of the Secret and passes --web-config; every endpoint of the
    PodMonitor scrapes over https with the Secret's CA, for the Job's name, with its username and password.
    A Secret made as the header says (web.yml naming tls.crt and tls.key beside it) loads in apply."""
    import bcrypt

    from helpers.tls import make_pki
    from hookpolicy.export.webconfig import load_web_config

    text = kubernetes_objects(hookpolicy.load([str(p) for p in POLICIES]).policies, name="llm", ranks=2,
                              web_secret="llm-metrics")
    assert "the Secret llm-metrics must hold web.yml, tls.crt, tls.key, ca.crt, username, password" in text
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(text)}
    pod = docs["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    web = args[args.index("--web-config") + 1]
    assert web == f"{WEB_MOUNT}/web.yml" and args.index("--web-config") < args.index("--")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == WEB_MOUNT)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] and volume["secret"]["secretName"] == "llm-metrics"
    assert [i["key"] for i in volume["secret"]["items"]] == ["web.yml", "tls.crt", "tls.key"]  # never the password
    endpoints = docs["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["hookpolicy-0", "hookpolicy-1"]
    for e in endpoints:
        assert e["scheme"] == "https" and e["tlsConfig"]["serverName"] == "llm"
        assert e["tlsConfig"]["ca"]["secret"] == {"name": "llm-metrics", "key": "ca.crt"}
        assert e["basicAuth"] == {"username": {"name": "llm-metrics", "key": "username"},
                                  "password": {"name": "llm-metrics", "key": "password"}}
    used = {i["key"] for i in volume["secret"]["items"]} | {"ca.crt", "username", "password"}
    assert used == set(WEB_SECRET_KEYS)
    # the Secret's pod side, as files at the mount's names
    pki = make_pki(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    shutil.copy(pki.server_cert, secret / "tls.crt")
    shutil.copy(pki.server_key, secret / "tls.key")
    hashed = bcrypt.hashpw(b"scrape", bcrypt.gensalt(rounds=4)).decode()
    (secret / "web.yml").write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"},
                                                    "basic_auth_users": {"prometheus": hashed}}))
    loaded = load_web_config(str(secret / "web.yml"))
    assert loaded.tls is not None and loaded.credentials is not None
