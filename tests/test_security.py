"""Security defaults: policy files are data, never code; files stay in their folder; metrics stay local.

A policy file is edited by hand and mounted from places an ops team does not fully
control (a ConfigMap, a shared folder). Loading it must never run anything, reading it
must be bounded, and what it writes must stay inside the output folder.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

import hookpolicy
from hookpolicy import PolicyError
from hookpolicy.policy import loader
from hookpolicy.policy.expr import FUNCTIONS, STATS, Arith, Call, Compare, ExprError, Junction, Name, Neg, Num, parse
from hookpolicy.export.sinks import SinkError, TensorWriter, file_name, safe_path
from hookpolicy.policy.linear import LinearPattern
from hookpolicy.engine.decide import alerts
from hookpolicy.policy.messages import MAX_FIELD_WIDTH
from hookpolicy.policy.model import Alert, TensorFiles
from hookpolicy.policy.patterns import compile_glob

from helpers import REPO
from helpers.models import tiny
from helpers.outputs import metric, served

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: p
spec:
  rules:
    - name: r
      match: {modules: ["**"]}
      trigger: {at: step}
      actions:
        - alert: {if: "nonfinite > 0"}
"""


def problems(tmp_path: Path, text: str) -> list[hookpolicy.Problem]:
    path = tmp_path / "p.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError) as caught:
        hookpolicy.load(path)
    return list(caught.value.problems)


@pytest.fixture
def no_process_spawning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything that would run a program fails the test (the loader catches no AssertionError)."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a policy file started a program")

    for name in ("system", "popen", "execv", "execve", "execvp", "spawnv", "posix_spawn"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)


# =========================================================================== YAML tags

TAGGED = [
    '!!python/object/apply:os.system ["touch {canary}"]',
    '!!python/object/new:os.system ["touch {canary}"]',
    '!!python/object/apply:builtins.exec ["open(\'{canary}\', \'w\')"]',
    '!!python/object/apply:subprocess.check_call [["touch", "{canary}"]]',
    "!!python/name:os.system",
    "!!python/module:os",
    "!!python/object:argparse.Namespace {{a: 1}}",
    '!<tag:yaml.org,2002:python/object/apply:os.system> ["touch {canary}"]',
    "!!binary dG91Y2g=",
    "!!set {{a, b}}",
    "!local {{a: 1}}",
]


@pytest.mark.parametrize("tagged", TAGGED)
def test_yaml_tags_never_construct_objects(tmp_path: Path, no_process_spawning: None, tagged: str) -> None:
    canary = tmp_path / "canary"
    value = tagged.format(canary=canary)
    found = problems(tmp_path, POLICY.replace("name: p\n", f"name: {value}\n"))
    assert [(p.line, p.column, p.path) for p in found][0] == (4, 9, "$.metadata.name")
    assert "are not allowed" in found[0].message and "tags (" in found[0].message
    assert not canary.exists()


def test_a_tag_directive_is_refused_too(tmp_path: Path, no_process_spawning: None) -> None:
    canary = tmp_path / "canary"
    text = '%TAG !p! tag:yaml.org,2002:python/\n---\n' + POLICY.replace(
        "name: p\n", f'name: !p!object/apply:os.system ["touch {canary}"]\n')
    found = problems(tmp_path, text)
    assert any("tags (" in p.message for p in found)
    assert not canary.exists()


def test_pyyaml_unsafe_loaders_are_never_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Not `yaml.load`, not `yaml.unsafe_load`, not `yaml.full_load`: hookpolicy composes nodes itself."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a PyYAML loading function was called")

    for name in ("load", "unsafe_load", "full_load", "load_all", "unsafe_load_all", "safe_load", "full_load_all"):
        monkeypatch.setattr(yaml, name, forbidden)
    path = tmp_path / "p.yaml"
    path.write_text(POLICY)
    assert hookpolicy.load(path).names == ("p",)


# =========================================================================== the `if` language

REACHING_FOR_PYTHON = [
    "__import__('os').system('true') > 0",
    "l2_norm.__class__ > 0",
    "l2_norm.real > 0",
    "l2_norm() > 1",
    "abs(l2_norm) > 1",
    "l2_norm[0] > 1",
    "lambda: 1",
    "(lambda x: x)(l2_norm) > 1",
    "'a' > 1",
    "l2_norm > 'a'",
    'f"{l2_norm}" > 1',
    "l2_norm > 1 and __import__('os')",
    "l2_norm > 1; import os",
    "l2_norm > 1 if True else 0",
    "not l2_norm > 1",
    "l2_norm > 1 # comment",
    "globals() > 1",
    "__builtins__ > 0",
    "l2_norm > 0x10",
    "l2_norm > 1e999",
    "l2_norm > nan",
    "l2_norm > inf",
    "l2_norm > 1_000",
    "l2_norm > True",
    "l2_norm > None",
    "[l2_norm] > 1",
    "{l2_norm} > 1",
    "l2_norm > 1 or",
    "l2_norm >> 1",
    "l2_norm := 1",
    "l2_norm > 1\nimport os",
    "eval('1') > 0",
    "exec > 0",
    "os.system > 0",
    "l2_norm > -.inf",
    "l2_norm in (1, 2)",
    "l2_norm is 1",
    "l2_norm > 1 > 0",
]


@pytest.mark.parametrize("condition", REACHING_FOR_PYTHON)
def test_the_if_language_has_no_way_to_reach_python(condition: str) -> None:
    with pytest.raises(ExprError) as caught:
        parse(condition)
    assert 0 <= caught.value.offset <= len(condition)


@pytest.mark.parametrize("condition", [
    "l2_norm() > 1", "l2_norm > 1 and __import__(os)", "l2_norm.real > 0", "l2_norm > 1 and 'x'",
])
def test_if_problems_point_into_the_string(tmp_path: Path, condition: str) -> None:
    text = POLICY.replace('"nonfinite > 0"', f'"{condition}"')
    problem, *_ = problems(tmp_path, text)  # the first (`__import__(os)` also names an unknown statistic os)
    assert problem.path == "$.spec.rules[0].actions[0].alert.if"
    assert problem.message.startswith("invalid condition: ")
    with pytest.raises(ExprError) as caught:
        parse(condition)
    value_line = text.splitlines()[problem.line - 1]
    quote = value_line.index('"') + 1  # 1-based column of the opening quote
    assert problem.column == quote + 1 + caught.value.offset


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([
    "l2_norm", "nonfinite", "numel", "mean", "ema", "zscore", "prev", "0.5", "100", "/", "-", "__import__", "os", "system", "(", ")", "[", "]", ".", ",", "'x'",
    '"x"', "and", "or", "not", "lambda", ":", ">", ">=", "==", "!=", "<", "1", "-1", "1e3", "nan", "inf", "()",
    "__class__", "f'{x}'", "+", "*", "**", " ", "\n", "if", "else", "True", "None", "0x1", "=", ";",
]), max_size=12).map(" ".join))
def test_any_condition_parses_to_comparisons_of_statistics_with_numbers_only(text: str) -> None:
    """Whatever parses is a tree of and/or over comparisons of arithmetic over statistics, history
    functions of statistics and finite numbers: nothing else exists."""
    try:
        condition = parse(text)
    except ExprError as exc:
        assert 0 <= exc.offset <= len(text)
        return
    stack: list[Any] = [condition.root]
    while stack:
        node = stack.pop()
        if isinstance(node, Junction):
            assert node.kind in ("and", "or")
            assert all(isinstance(p, (Junction, Compare)) for p in node.parts)
            stack.extend(node.parts)
        elif isinstance(node, Compare):
            assert node.op in (">", ">=", "<", "<=", "==", "!=")
            stack.extend((node.left, node.right))
        elif isinstance(node, Arith):
            assert node.op in "+-*/"
            stack.extend((node.left, node.right))
        elif isinstance(node, Neg):
            stack.append(node.operand)
        elif isinstance(node, Num):
            assert isinstance(node.value, float) and node.value == node.value and abs(node.value) != float("inf")
        elif isinstance(node, Call):
            assert node.func in FUNCTIONS and node.series in STATS
        else:
            assert isinstance(node, Name) and node.series in STATS, node
    assert condition.stats <= frozenset(STATS)


@pytest.mark.parametrize("message", [
    "{module.__class__}", "{policy.__class__.__mro__}", "{step.real}", "{rule[0]}", "{0}", "{}",
    "{__import__}", "{module.__init__.__globals__}", "{l2_norm:{module}}",
])
def test_alert_messages_cannot_walk_python_objects(tmp_path: Path, message: str) -> None:
    text = POLICY.replace('{if: "nonfinite > 0"}', "{if: \"nonfinite > 0\", message: '" + message + "'}")
    (problem,) = problems(tmp_path, text)
    assert problem.path == "$.spec.rules[0].actions[0].alert.message"


# =========================================================================== patterns

NESTED = nn.Sequential()
_inner = NESTED
for _ in range(60):
    _next = nn.Sequential()
    _inner.add_module("0", _next)
    _inner = _next
_inner.add_module("0", nn.Linear(1, 1))


@pytest.mark.parametrize("pattern, name, matching", [
    ("*a*a*a*a*a*a*a*a*a*a*a*ab", "a" * 40, "xa" * 12 + "b"),  # 100 s with re's backtracking
    ("re:(a+)+x", "a" * 40 + "b", "aaax"),  # x4 per two characters with re
    ("re:(?:a|aa)*c", "a" * 60, "aaac"),
    ("**.*.**.*.**.*.**.*.**.*.**.*.**.zzz", ".".join(["0"] * 60), "1.2.3.4.5.6.7.zzz"),  # 62 s, 60-deep
])
def test_patterns_that_backtrack_catastrophically_run_on_the_linear_automaton(
    pattern: str, name: str, matching: str,
) -> None:
    compiled = compile_glob(pattern)
    assert isinstance(compiled, LinearPattern)
    assert compiled.fullmatch(name) is None  # re needs minutes (or years) to say so
    assert compiled.fullmatch(matching) == matching


def test_a_glob_against_a_sixty_deep_model_selects_without_backtracking(tmp_path: Path) -> None:
    text = POLICY.replace('["**"]', '["**.*.**.*.**.*.**.*.**.*.**.*.**.zzz", "**.*.**.*.**.*.**.*.**.*.**.*.**.0"]')
    path = tmp_path / "p.yaml"
    path.write_text(text)
    plan = hookpolicy.load(path).plan(NESTED)
    assert len({b.module for b in plan.bindings}) == 1  # only the Linear has parameters


@pytest.mark.parametrize("regex, at", [
    ("(a+)+$", 0), ("^(\\w+\\s?)*$", 1), ("(a|a)*$", 0), ("(?<=x)(b*)*", 6), ("(.)\\1.*.*.*.*", 12),
    ("(?<=a)" + "b" * 400, 300),
])
def test_regexes_that_re_must_run_are_refused_when_they_could_backtrack(tmp_path: Path, regex: str, at: int) -> None:
    """With an anchor, a backreference or a lookaround, `re` runs it: the guard points at the problem."""
    text = POLICY.replace('["**"]', f"['re:{regex}']")
    (problem,) = problems(tmp_path, text)
    assert problem.path == "$.spec.rules[0].match.modules[0]"
    value_line = text.splitlines()[problem.line - 1]
    assert problem.column == value_line.index("'re:") + 2 + len("re:") + at, problem


def test_a_simple_regex_with_an_anchor_still_works() -> None:
    compiled = compile_glob("re:^layers\\.\\d+$")
    assert not isinstance(compiled, LinearPattern)
    assert compiled.fullmatch("layers.12") and not compiled.fullmatch("layers.x")


@pytest.mark.parametrize("message, field", [
    ("at {step:>99999999}", "{step"),  # wrote 1.5 GB to stderr in a 5-step run
    ("{policy} at {step:999999999999}", "{step"),  # ended check, apply and load in a MemoryError
    ("{l2_norm:.100000f}", "{l2_norm"),
    ("{module:x^999}", "{module"),
])
def test_alert_message_widths_are_bounded_at_check_time(tmp_path: Path, message: str, field: str) -> None:
    text = POLICY.replace('{if: "nonfinite > 0"}', "{if: \"nonfinite > 0\", message: '" + message + "'}")
    (problem,) = problems(tmp_path, text)
    assert problem.path == "$.spec.rules[0].actions[0].alert.message"
    assert f"at most {MAX_FIELD_WIDTH}" in problem.message
    value_line = text.splitlines()[problem.line - 1]
    assert problem.column == value_line.index("'") + 2 + message.index(field)


def test_a_rendered_alert_message_is_cut_to_a_bounded_length() -> None:
    """The template is bounded at check time; a module name is not, so the rendering is cut."""
    alert = Alert(condition=parse("nonfinite > 0"), source="nonfinite > 0", message="{module} at {step}")
    base = {"module": "m" * 100_000, "step": 3, "policy": "p", "rule": "r", "rank": 0, "target": "grad", "tensor": ""}
    rendered = alerts.render(alert, base, {"nonfinite": 1.0})
    assert len(rendered) == alerts.MAX_RENDERED_CHARS and rendered.startswith("mmm")


@pytest.mark.parametrize("kind, make, said", [
    ("dangling", lambda p: p.symlink_to(p.parent / "gone.yaml"), "a dangling symbolic link"),
    ("fifo", lambda p: os.mkfifo(p), "a FIFO (named pipe)"),  # reading it would block forever
    ("folder", lambda p: p.mkdir(), "a folder"),
])
def test_a_policy_folder_entry_that_is_not_a_file_is_reported_not_skipped(
    tmp_path: Path, kind: str, make: Any, said: str,
) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "good.yaml").write_text(POLICY)
    make(folder / f"x-{kind}.yaml")
    with pytest.raises(PolicyError) as caught:
        hookpolicy.load(folder)
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.path) == (str(folder / f"x-{kind}.yaml"), 0, "$")
    assert problem.message.startswith(said) and "not a policy file" in problem.message
    from hookpolicy import cli

    result = CliRunner().invoke(cli.cli, ["check", str(folder)])
    assert result.exit_code == 1 and said in result.output


def test_a_broken_file_from_policy_dirs_says_where_it_came_from_and_that_nothing_started(tmp_path: Path) -> None:
    folder = tmp_path / "site-policies"
    folder.mkdir()
    (folder / "broken.yaml").write_text(POLICY.replace("rules:", "rules: 3\n  x:"))
    (tmp_path / "mine.yaml").write_text(POLICY.replace("name: p", "name: mine"))
    env = {**os.environ, "HOOKPOLICY_POLICY_DIRS": str(folder), "PYTHONPATH": str(REPO)}
    ran = tmp_path / "ran"
    result = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", str(tmp_path / "mine.yaml"), "--", sys.executable, "-c",
         f"open({str(ran)!r}, 'w')"], env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1 and not ran.exists()
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"hookpolicy: {folder / 'broken.yaml'}:")
    assert lines[-2] == (f"hookpolicy: {folder / 'broken.yaml'} comes from HOOKPOLICY_POLICY_DIRS (folder {folder}), "
                         "which adds every policy of its folders to every run")
    assert lines[-1].startswith("hookpolicy: nothing was started: ")
    from hookpolicy import cli

    checked = CliRunner().invoke(cli.cli, ["check", str(tmp_path / "mine.yaml")], env={"HOOKPOLICY_POLICY_DIRS": str(folder)})
    assert checked.exit_code == 1 and "comes from HOOKPOLICY_POLICY_DIRS" in checked.output
    assert "nothing was started" not in checked.output


# =========================================================================== paths

CAPTURE = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: p}
spec:
  rules:
    - name: dump
      match: {modules: ["0"], params: [weight]}
      trigger: {at: step}
      actions:
        - capture: {stats: [l2_norm], tensors: {dir: DIR}}
    - name: logged
      match: {modules: ["0"], params: [weight]}
      trigger: {at: step}
      actions:
        - capture: {stats: [l2_norm], log: {path: LOG}}
"""


@pytest.mark.parametrize("escaping", [
    "..", "../x", "a/../../x", "a/b/../../../x", "..\\\\x", "/etc", "/tmp/x", "~/x", "~root/x",
    "C:\\\\x", "C:x", "\\\\\\\\server\\\\share\\\\x", '"t\\0x"', '"t\\nx"', '"t\\u202ex"',
])
@pytest.mark.parametrize("where", ["DIR", "LOG"])
def test_paths_that_leave_the_output_folder_are_refused_at_load(tmp_path: Path, escaping: str, where: str) -> None:
    text = CAPTURE.replace(where, escaping).replace("DIR", "tensors").replace("LOG", "logs/x.jsonl")
    (problem,) = problems(tmp_path, text)
    field = "tensors.dir" if where == "DIR" else "log.path"
    assert problem.path.endswith(field), problem


def train(policies: hookpolicy.PolicySet, steps: int = 3) -> CollectorRegistry:
    model, reg = tiny(), CollectorRegistry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with policies.attach(model, registry=reg, rank=0):
        for _ in range(steps):
            model(torch.randn(6, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return reg


@pytest.fixture
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """(output folder, a folder outside it that must stay empty)."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(out))
    yield out, outside
    assert sorted(p.name for p in outside.iterdir()) in ([], ["victim.jsonl"], ["victim.pt"])


def test_a_symlinked_tensor_folder_pointing_outside_is_refused_at_write(
    tmp_path: Path, folders: tuple[Path, Path],
) -> None:
    out, outside = folders
    (out / "tensors").symlink_to(outside, target_is_directory=True)
    path = tmp_path / "p.yaml"
    path.write_text(CAPTURE.replace("DIR", "tensors").replace("LOG", "logs/x.jsonl"))
    reg = train(hookpolicy.load(path))
    assert list(outside.iterdir()) == []
    assert metric(reg, "hookpolicy_hook_errors_total", {"policy": "p", "rule": "dump", "rank": "0"}) == 3
    assert metric(reg, "hookpolicy_hook_errors_total", {"policy": "p", "rule": "logged", "rank": "0"}) in (0, None)


def test_a_symlink_in_place_of_a_tensor_file_is_not_written_through(
    tmp_path: Path, folders: tuple[Path, Path],
) -> None:
    out, outside = folders
    victim = outside / "victim.pt"
    victim.write_bytes(b"precious")
    (out / "tensors").mkdir()
    (out / "tensors" / "step00000000-0-grad-weight.pt").symlink_to(victim)
    path = tmp_path / "p.yaml"
    path.write_text(CAPTURE.replace("DIR", "tensors").replace("LOG", "logs/x.jsonl"))
    train(hookpolicy.load(path))
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("link", ["logs", "logs/x.jsonl"])
def test_a_symlinked_log_path_pointing_outside_writes_nothing_outside(
    tmp_path: Path, folders: tuple[Path, Path], link: str,
) -> None:
    """Refused when the log is opened; the refusal is a sink fault, contained under
    `onError: continue` like those of test_reliability_faults' log sink tests."""
    out, outside = folders
    victim = outside / "victim.jsonl"
    victim.write_text("precious\n")
    if link == "logs":
        (out / "logs").symlink_to(outside, target_is_directory=True)
    else:
        (out / "logs").mkdir()
        (out / "logs" / "x.jsonl").symlink_to(victim)
    path = tmp_path / "p.yaml"
    path.write_text(CAPTURE.replace("DIR", "tensors").replace("LOG", "logs/x.jsonl"))
    try:
        train(hookpolicy.load(path))
    except SinkError:
        pass
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.jsonl"]


def test_an_output_folder_that_is_itself_a_symlink_is_fine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The output folder is resolved first (/scratch -> /mnt/disk1 is ordinary); only escapes from it are refused."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(tmp_path / "link"))
    path = tmp_path / "p.yaml"
    path.write_text(CAPTURE.replace("DIR", "tensors").replace("LOG", "logs/x.jsonl"))
    train(hookpolicy.load(path), steps=2)
    assert len(list((real / "tensors").glob("*.pt"))) == 2
    assert len((real / "logs" / "x.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("name", [
    "../../x.pt", "/etc/x.pt", "a\x00b.pt", "a\nb.pt", "x" * 1000 + ".pt", "a." + "b" * 1000, "..", ".",
])
def test_tensor_file_names_from_the_model_stay_one_name_in_the_folder(tmp_path: Path, name: str) -> None:
    """Module names and output dict keys become parts of file names; none may leave the folder."""
    writer = TensorWriter(tmp_path, TensorFiles(dir="t"))
    written = writer.write(name, torch.zeros(2))
    assert written.parent == tmp_path / "t"
    assert len(written.name.encode()) <= 255 and not written.name.startswith(".")
    assert file_name(name) == written.name
    assert torch.equal(torch.load(written, weights_only=True), torch.zeros(2))


def test_names_that_become_one_file_name_do_not_overwrite_each_other(tmp_path: Path) -> None:
    """`a/b.pt` and `a\\b.pt` (two module names) both become `a_b.pt`: the second is numbered."""
    writer = TensorWriter(tmp_path, TensorFiles(dir="t"))
    first, second = writer.write("a/b.pt", torch.zeros(2)), writer.write("a\\b.pt", torch.ones(2))
    assert (first.name, second.name) == ("a_b.pt", "a_b.2.pt")
    assert torch.equal(torch.load(first, weights_only=True), torch.zeros(2))
    assert torch.equal(torch.load(second, weights_only=True), torch.ones(2))


@pytest.mark.parametrize("relative", ["../x", "/etc/passwd", "a/../../x", "a\x00b"])
def test_safe_path_refuses_escapes_with_a_sink_error(tmp_path: Path, relative: str) -> None:
    with pytest.raises(SinkError):
        safe_path(tmp_path.resolve(), relative)


# =========================================================================== the exporter


def test_the_exporter_binds_loopback_unless_told_otherwise(free_port: int) -> None:
    from hookpolicy import cli
    from hookpolicy.apply import launch
    from hookpolicy.environment import ENV_METRICS_ADDR, ChildConfig
    from hookpolicy.export.exporter import serve

    assert inspect.signature(serve).parameters["addr"].default == "127.0.0.1"
    assert launch.Launch(sources=()).metrics_addr == "127.0.0.1"
    assert ChildConfig.from_env({}).metrics_addr == "127.0.0.1"
    assert ChildConfig.from_env({ENV_METRICS_ADDR: ""}).metrics_addr == "127.0.0.1"
    option = next(p for p in cli.apply.params if p.name == "metrics_addr")
    assert option.default == "127.0.0.1"
    with served(CollectorRegistry(), free_port) as server:
        assert server.server_address[0] == "127.0.0.1"


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port`, from /proc/net/tcp and tcp6."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                if len(address) == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
                else:
                    words = [bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, 32, 8)]
                    found.add(socket.inet_ntop(socket.AF_INET6, b"".join(words)))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs /proc/net/tcp")
def test_apply_serves_metrics_on_loopback_only_by_default(tmp_path: Path, free_port: int) -> None:
    policy = REPO / "policies" / "example-monitor.yaml"
    stop = tmp_path / "stop"
    env = {k: v for k, v in os.environ.items() if k != "HOOKPOLICY_POLICY_DIRS"}
    env["OMP_NUM_THREADS"] = "1"
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hookpolicy", "apply", str(policy), "--metrics-port", str(free_port), "--",
             sys.executable, str(REPO / "examples" / "train_mlp.py"), "--steps", "100000", "--sleep", "0.02",
             "--stop-file", str(stop)],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
        )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{free_port}/metrics", timeout=5).read()
                break
            except OSError:
                time.sleep(0.1)
        assert listening_addresses(free_port) == {"127.0.0.1"}
    finally:
        stop.touch()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# =========================================================================== size


@pytest.fixture
def parser_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any YAML parsing starts."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the YAML parser ran on an oversized file")

    monkeypatch.setattr(loader, "_StrictLoader", forbidden)
    monkeypatch.setattr(yaml.reader.Reader, "__init__", forbidden)
    monkeypatch.setattr(yaml, "compose", forbidden)


def test_a_file_over_one_mib_is_refused_before_parsing(tmp_path: Path, parser_forbidden: None) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(POLICY.encode() + b"#" * loader.MAX_BYTES + b"\n")
    (problem,) = problems_of_path(big)
    assert (problem.line, problem.column, problem.path) == (0, 0, "$")
    assert "larger than 1 MiB" in problem.message


def problems_of_path(path: Path) -> list[hookpolicy.Problem]:
    with pytest.raises(PolicyError) as caught:
        hookpolicy.load(path)
    return list(caught.value.problems)


def test_a_sparse_ten_gib_file_is_refused_after_reading_one_mib(tmp_path: Path, parser_forbidden: None) -> None:
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as out:
        out.truncate(10 * 2**30)  # sparse: takes no disk, reads as zeros
    (problem,) = problems_of_path(huge)
    assert "larger than 1 MiB" in problem.message


def test_a_big_file_in_a_policy_folder_and_through_the_cli_is_refused_before_parsing(
    tmp_path: Path, parser_forbidden: None,
) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "big.yaml").write_bytes(b"# " + b"x" * (loader.MAX_BYTES + 10) + b"\n")
    found = problems_of_path(folder)
    assert len(found) == 1 and "larger than 1 MiB" in found[0].message
    from hookpolicy.cli import cli

    result = CliRunner().invoke(cli, ["check", str(folder / "big.yaml")])
    assert result.exit_code == 1
    assert re.search(r"big\.yaml: the file is larger than 1 MiB", result.output)
    assert "Traceback" not in result.output
