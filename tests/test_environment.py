"""The environment contract: one module names and reads every variable, the README lists them."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

from hookpolicy import environment
from hookpolicy.apply.launch import BOOTSTRAP_DIR, Launch, child_environment
from hookpolicy.environment import ChildConfig, local_rank, output_dir, policy_dirs, rank

ROOT = Path(__file__).resolve().parent.parent
NAMES = {getattr(environment, n) for n in environment.__all__ if n.startswith("ENV_")}


def test_policy_dirs() -> None:
    assert policy_dirs({}) == []
    assert policy_dirs({"HOOKPOLICY_POLICY_DIRS": ""}) == []
    assert policy_dirs({"HOOKPOLICY_POLICY_DIRS": "/etc/hp::/opt/p:"}) == ["/etc/hp", "/opt/p"]


def test_output_dir() -> None:
    assert output_dir({}) is None
    assert output_dir({"HOOKPOLICY_OUTPUT_DIR": ""}) is None
    assert output_dir({"HOOKPOLICY_OUTPUT_DIR": "/data/out"}) == "/data/out"


@pytest.mark.parametrize("environ, expected", [
    ({}, 0),
    ({"RANK": "3", "LOCAL_RANK": "1"}, 3),
    ({"LOCAL_RANK": "1"}, 1),
    ({"RANK": "", "LOCAL_RANK": "2"}, 2),
    ({"RANK": "x", "LOCAL_RANK": "2"}, 2),
    ({"RANK": "-1"}, 0),
    ({"RANK": "\u00b2"}, 0),  # a digit to str.isdigit, not to int()
])
def test_one_rank_rule_for_attach_and_apply(environ: dict[str, str], expected: int) -> None:
    assert rank(environ) == expected
    assert ChildConfig.from_env(environ).rank == expected


def test_local_rank_is_the_port_offset() -> None:
    assert local_rank({"RANK": "5"}) == 0
    assert local_rank({"RANK": "5", "LOCAL_RANK": "1"}) == 1
    assert ChildConfig.from_env({"RANK": "5", "LOCAL_RANK": "1"}).local_rank == 1


@pytest.mark.parametrize("value, expected", [
    (None, 1.0), ("2.5", 2.5), ("soon", 1.0), ("0", 0.05),
    # nan spun the watcher at ~97% of a core; inf and 1e12 killed it (OverflowError in its wait)
    ("nan", 1.0), ("inf", 1.0), ("-inf", 1.0), ("1e12", 3600.0),
])
def test_watch_interval(value: str | None, expected: float) -> None:
    environ = {} if value is None else {"HOOKPOLICY_WATCH_INTERVAL": value}
    assert ChildConfig.from_env(environ).interval == expected


@pytest.mark.parametrize("launch", [
    Launch(sources=("/p/a.yaml", "/p/guardrails")),
    Launch(sources=("/p/with:colon.yaml", "/p/a folder:x", "/p/\u00e9t\u00e9.yaml")),  # the child split on ':'

    Launch(sources=("/p/a.yaml",), metrics_port=9400, metrics_addr="0.0.0.0", audit=True, watch=True),
])
def test_what_apply_writes_the_child_reads_back(launch: Launch) -> None:
    inherited = {"HOOKPOLICY_METRICS_PORT": "1234", "PYTHONPATH": "/mine", "RANK": "2"}
    env = child_environment(launch, "/tmp/run", inherited)
    assert env["PYTHONPATH"].split(":") == [BOOTSTRAP_DIR, "/mine"]
    assert env[environment.ENV_BOOTSTRAP] == "1"
    config = ChildConfig.from_env(env)
    assert config.sources == launch.sources
    assert (config.audit, config.watch) == (launch.audit, launch.watch)
    assert (config.metrics_port, config.metrics_addr) == (launch.metrics_port, launch.metrics_addr)
    assert (config.run_dir, config.rank) == ("/tmp/run", 2)


def test_the_bootstrap_spells_its_variable_as_the_contract_does() -> None:
    source = (ROOT / "hookpolicy/apply/_bootstrap/sitecustomize.py").read_text("utf-8")
    literals = {
        node.value for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("HOOKPOLICY_")
    }
    assert literals == {environment.ENV_BOOTSTRAP, environment.ENV_PARENT}


@pytest.mark.parametrize("environ", [{}, {"RANK": "1"}, {"LOCAL_RANK": "1"}, {"RANK": "3", "LOCAL_RANK": "1"}])
def test_the_bootstrap_tells_a_rank_as_the_contract_does(environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("bootstrap_copy", Path(BOOTSTRAP_DIR, "sitecustomize.py"))
    assert spec is not None and spec.loader is not None
    bootstrap = importlib.util.module_from_spec(spec)
    monkeypatch.delenv(environment.ENV_BOOTSTRAP, raising=False)  # loaded inert
    monkeypatch.delitem(sys.modules, "sitecustomize", raising=False)  # put back after: it chains to any other
    spec.loader.exec_module(bootstrap)
    assert bootstrap._rank_identity() == environment.rank_identity(environ)
    assert len({environment.rank_identity(e) for e in ({}, {"RANK": "1"}, {"LOCAL_RANK": "1"})}) == 3


def test_no_other_module_spells_a_variable_name() -> None:
    contract = {ROOT / "hookpolicy/environment.py", ROOT / "hookpolicy/apply/_bootstrap/sitecustomize.py"}
    for path in sorted((ROOT / "hookpolicy").rglob("*.py")):
        if path in contract:
            continue
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in NAMES, f"{path.relative_to(ROOT)} spells {node.value!r}"
                assert not node.value.startswith("HOOKPOLICY_"), f"{path.relative_to(ROOT)}: {node.value!r}"


def test_the_readme_lists_every_variable() -> None:
    readme = (ROOT / "README.md").read_text("utf-8")
    table = readme[readme.index("### Environment"):]
    table = table[: table.index("\n\n", table.index("| variable |"))]
    listed = set(re.findall(r"`([A-Z_]+)`", table)) - {"PYTHONPATH"}
    assert listed == NAMES


def test_a_run_id_is_one_per_apply_shared_by_its_ranks_and_new_per_restart() -> None:
    """`apply` gives its COMMAND one run identity (every rank the same); an inherited one stands;
    torchrun's restart count makes a restarted worker a new run; outside `apply` a process has its own."""
    launch = Launch(sources=("/p/a.yaml",))
    first, second = (child_environment(launch, "/tmp/run", {})[environment.ENV_RUN_ID] for _ in range(2))
    assert first != second and re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", first)
    assert child_environment(launch, "/tmp/run", {"HOOKPOLICY_RUN_ID": "pod-uid-1"})["HOOKPOLICY_RUN_ID"] == "pod-uid-1"
    assert environment.run_id({"HOOKPOLICY_RUN_ID": "a"}) == "a"
    assert environment.run_id({"HOOKPOLICY_RUN_ID": "a", "TORCHELASTIC_RESTART_COUNT": "0"}) == "a"
    assert environment.run_id({"HOOKPOLICY_RUN_ID": "a", "TORCHELASTIC_RESTART_COUNT": "2"}) == "a.2"
    assert environment.run_id({}) == environment.run_id({}) != environment.new_run_id()


def test_every_store_exports_its_run() -> None:
    from prometheus_client import CollectorRegistry

    from hookpolicy.export.collector import store_for

    registry = CollectorRegistry()
    store_for(registry, 3)
    run = environment.run_id(os.environ)
    assert registry.get_sample_value("hookpolicy_run_info", {"run": run, "rank": "3"}) == 1.0
