"""The `hookpolicy` command line, through click's CliRunner (apply's runs are in test_apply.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from helpers import REPO
from helpers.policies import write_policy
from hookpolicy import __version__
from hookpolicy.cli import cli
from hookpolicy.policy.expr import STATS
from hookpolicy.policy.schema import schema_json

MONITOR = str(REPO / "policies" / "example-monitor.yaml")
PROBLEM = re.compile(r"^(?P<file>.+):(?P<line>\d+):(?P<col>\d+): (?P<path>\$\S*): (?P<message>.+)$")

BAD_POLICY = """\
apiVersion: hookpolicy/v2
kind: HookPolicy
metadata:
  name: Bad_Name
spec:
  rules:
    - name: r
      match: {modules: ["**"]}
      trigger: {at: forward, every: 0}
      target: grad
      actions:
        - capture: {stats: [l2_norm]}
"""

NOTHING_POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata:
  name: nothing
spec:
  rules:
    - name: convs
      match: {types: [Conv2d]}
      trigger: {at: forward}
      target: output
      actions:
        - capture: {stats: [rms]}
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOOKPOLICY_POLICY_DIRS", raising=False)
    monkeypatch.chdir(REPO)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), prog_name="hookpolicy")


def assert_problem_lines(text: str) -> list[re.Match[str]]:
    """The problems of `text`, one per line; `hookpolicy:` notes may follow them, nothing else."""
    lines = text.splitlines()
    while lines and lines[-1].startswith("hookpolicy: "):
        lines.pop()
    assert lines, "no problem printed"
    matches = [PROBLEM.match(line) for line in lines]
    assert all(matches), f"not FILE:LINE:COL: $.path: message lines:\n{text}"
    assert "Traceback" not in text
    return [m for m in matches if m]


# -- check -------------------------------------------------------------------------------


def test_check_valid() -> None:
    result = invoke("check", MONITOR)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"{MONITOR}: ok (example-monitor, 3 rules, revision {result.stdout.split('revision ')[1][:12]})"
    )


def test_check_invalid_prints_every_problem_in_position_form(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_POLICY)
    result = invoke("check", str(bad))
    assert result.exit_code == 1
    assert result.stdout == ""
    problems = assert_problem_lines(result.stderr)
    assert {m["file"] for m in problems} == {str(bad)}
    paths = {m["path"] for m in problems}
    assert {"$.apiVersion", "$.metadata.name", "$.spec.rules[0].trigger.every"} <= paths
    assert any(m["path"] == "$.apiVersion" and (m["line"], m["col"]) == ("1", "13") for m in problems)


def test_check_missing_file_is_one_line() -> None:
    result = invoke("check", "no/such/policy.yaml")
    assert result.exit_code == 1
    assert result.stderr == "no/such/policy.yaml: no such file\n"  # no made-up ":0:0: $:" position


def test_check_reads_the_ops_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = tmp_path / "ops"
    ops.mkdir()
    (ops / "copy.yaml").write_text(Path(MONITOR).read_text())
    monkeypatch.setenv("HOOKPOLICY_POLICY_DIRS", str(ops))
    result = invoke("check", MONITOR)  # the same policy name twice
    assert result.exit_code == 1
    [problem] = assert_problem_lines(result.stderr)
    assert problem["path"] == "$.metadata.name" and "duplicate policy name" in problem["message"]
    assert result.stderr.splitlines()[-1].startswith(f"hookpolicy: {ops / 'copy.yaml'} comes from HOOKPOLICY_POLICY_DIRS")
    assert invoke("check").exit_code == 0  # the folder alone is a valid source


def test_check_without_any_policy_is_a_usage_error() -> None:
    result = invoke("check")
    assert result.exit_code == 2
    assert "no policy given" in result.stderr


# -- explain -----------------------------------------------------------------------------


def test_explain_says_what_max_job_series_counts(tmp_path: Path) -> None:
    policy = tmp_path / "budgeted.yaml"
    policy.write_text(Path(MONITOR).read_text().replace("spec:\n", "spec:\n  limits: {maxJobSeries: 300}\n", 1))
    result = invoke("explain", str(policy), "--model", "examples.train_mlp:build_model")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == (
        "note: example-monitor: spec.limits.maxJobSeries=300: the job exports at most that many of its statistic "
        "series, all ranks together; a series exported once per job counts 1, one every rank exports counts the "
        "number of ranks; the job's series of a step are kept before each rank's, then first published, first kept")


def test_explain_text_table() -> None:
    result = invoke("explain", MONITOR, "--model", "examples.train_mlp:build_model")
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["RULE", "MODULE", "TYPE", "HOOK", "WHEN", "TARGET", "ACTIONS"]
    assert rows[-1].startswith("note: example-monitor: in a process group, the series of grad-norms are exported once per job")
    rows = rows[:-1]
    assert len(rows) == 9
    starts = [header.index(name) for name in header.split()] + [None]
    table = [[row[a:b].strip() for a, b in zip(starts, starts[1:])] for row in rows]
    assert table[0][:6] == ["example-monitor/nan-guard", "0", "Linear", "step", "train, every step", "grad(weight,bias)"]
    assert "skip_step" in table[0][6]
    assert ["example-monitor/layer-outputs", "4", "Linear", "forward", "train, every 10th step"] in [r[:5] for r in table]


def test_a_type_in_the_wrong_case_is_named_as_the_model_spells_it(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, """
    - name: lin
      match: {types: [linear, LayerNrom]}
      trigger: {at: step}
      target: grad
      actions: [{capture: {stats: [l2_norm]}}]
""")
    text = invoke("explain", str(policy), "--model", "examples.charlm:build_model").stdout
    assert "p/lin: matches no module of TinyGPT; types: no module is a linear; did you mean Linear? " in text
    assert "types: no module is a LayerNrom; did you mean LayerNorm?" in text


def test_explain_shows_when_each_rule_is_active(tmp_path: Path) -> None:
    """The window of each rule, as its YAML writes it: phase, every, steps (until exclusive)."""
    policy = write_policy(tmp_path, """
    - name: late
      match: {types: [Linear]}
      trigger: {at: step, every: 5, steps: {from: 100, until: 5000}}
      target: grad
      actions: [{capture: {stats: [l2_norm]}}]
    - name: evals
      match: {types: [Linear]}
      trigger: {at: forward, phase: eval, steps: {from: 20}}
      actions: [{capture: {stats: [rms]}}]
""")
    data = json.loads(invoke("explain", str(policy), "--model", "examples.train_mlp:build_model",
                             "--format", "json").stdout)
    when = {row["rule"]: row["when"] for row in data["bindings"]}
    assert when == {"late": {"phase": "train", "every": 5, "from": 100, "until": 5000, "after": None},
                    "evals": {"phase": "eval", "every": 1, "from": 20, "until": None, "after": None}}
    text = invoke("explain", str(policy), "--model", "examples.train_mlp:build_model").stdout
    assert "train, every 5th step, steps 100-4999" in text and "eval, every step, from step 20" in text


def test_explain_prints_the_history_bound_of_each_action(tmp_path: Path) -> None:
    """Per action that keeps a history: its values per group x its groups on this model, against
    maxHistoryValues; a policy whose total passes the budget gets a warning with the total."""
    import torch

    from examples.train_mlp import build_model

    policy = write_policy(tmp_path, """
    - name: z
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "zscore(l2_norm, 100) > 4", per: tensor}
        - clip: {max_norm: "2 * mean(norm, 50)", per: module}
""", spec="limits: {maxHistoryValues: 500}\n")
    linears = [m for m in build_model().modules() if isinstance(m, torch.nn.Linear)]
    tensors = sum(1 for m in linears for _ in m.parameters())
    result = invoke("explain", str(policy), "--model", "examples.train_mlp:build_model")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert (f"note: p/z: action 0 keeps 100 history values per group x {tensors} groups (per: tensor) = "
            f"{100 * tensors} of spec.limits.maxHistoryValues=500") in lines
    assert (f"note: p/z: action 1 keeps 50 history values per group x {len(linears)} groups (per: module) = "
            f"{50 * len(linears)} of spec.limits.maxHistoryValues=500") in lines
    assert any(line.startswith(f"warning: p: its history needs {100 * tensors + 50 * len(linears)} values, more than "
                               "spec.limits.maxHistoryValues=500") for line in lines)


def test_explain_json_and_warnings(tmp_path: Path) -> None:
    nothing = tmp_path / "nothing.yaml"
    nothing.write_text(NOTHING_POLICY)
    result = invoke("explain", MONITOR, str(nothing), "--model", "examples.charlm:build_model", "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc) == {"bindings", "notes", "warnings"}
    heads = [b for b in doc["bindings"] if b["module"] == "lm_head" and b["rule"] == "grad-norms"]
    assert heads == [{
        "policy": "example-monitor", "rule": "grad-norms", "priority": 50, "mode": "enforce", "module": "lm_head",
        "type": "Linear", "hook": "step", "target": "grad", "params": ["weight", "bias"], "select": [],
        "actions": ["capture(l2_norm,abs_max per=module)"],
        "when": {"phase": "train", "every": 1, "from": 0, "until": None, "after": None},
    }]
    assert any("nothing/convs" in w and "matches no module" in w for w in doc["warnings"])
    text = invoke("explain", str(nothing), "--model", "examples.charlm:build_model")
    assert text.exit_code == 0
    assert "no rule binds" in text.stdout
    assert re.search(rf"^warning: {re.escape(str(nothing))}:8:7: \$\.spec\.rules\[0\]\.match: nothing/convs: matches no module",
                     text.stdout, re.M)
    strict = invoke("explain", str(nothing), "--model", "examples.charlm:build_model", "--strict")
    assert strict.exit_code == 1
    assert f"{nothing}:8:7: $.spec.rules[0].match: nothing/convs: matches no module of TinyGPT" in strict.stderr


def test_explain_accepts_a_module_instance_and_a_file_path(tmp_path: Path) -> None:
    source = tmp_path / "mymodel.py"
    source.write_text("import torch\nnet = torch.nn.Sequential(torch.nn.Linear(2, 2))\n")
    result = invoke("explain", MONITOR, "--model", f"{source}:net", "--format", "json")
    assert result.exit_code == 0, result.output
    assert {b["module"] for b in json.loads(result.stdout)["bindings"]} == {"0"}


@pytest.mark.parametrize(("spec", "code", "needle"), [
    ("examples.train_mlp", 2, "is not MODULE:ATTR"),
    ("no_such_module_hp:model", 2, "no module named 'no_such_module_hp'"),
    ("examples.train_mlp:no_such_attr", 2, "has no attribute 'no_such_attr'"),
    ("examples.charlm:TEXT", 2, "not an nn.Module or a zero-argument callable"),
    ("examples.train_mlp:make_data", 1, "calling examples.train_mlp:make_data() failed: TypeError"),
    ("examples.charlm:vocabulary", 1, "returned a list, not an nn.Module"),
    ("missing/file.py:model", 2, "no such file"),
])
def test_explain_bad_model(spec: str, code: int, needle: str) -> None:
    result = invoke("explain", MONITOR, "--model", spec)
    assert result.exit_code == code, result.output
    assert needle in result.stderr
    assert "Traceback" not in result.output


def test_explain_reports_an_error_in_the_user_module_in_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken_model_hp.py"
    broken.write_text("import torch\nraise RuntimeError('no GPU here')\n")
    for spec in (f"{broken}:model", ):
        result = invoke("explain", MONITOR, "--model", spec)
        assert result.exit_code == 1
        assert result.stderr.strip().splitlines() == [
            f"Error: importing {broken} failed: RuntimeError: no GPU here"]
    exits = tmp_path / "exits_hp.py"
    exits.write_text("import sys\nsys.exit(2)\n")
    result = invoke("explain", MONITOR, "--model", f"{exits}:model")
    assert result.exit_code == 1 and "called sys.exit(2)" in result.stderr


def test_explain_invalid_policy(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_POLICY)
    result = invoke("explain", str(bad), "--model", "examples.train_mlp:build_model")
    assert result.exit_code == 1
    assert_problem_lines(result.stderr)


# -- apply (what needs no subprocess) ----------------------------------------------------


def test_apply_needs_a_command() -> None:
    result = invoke("apply", MONITOR)
    assert result.exit_code == 2
    assert "missing '-- COMMAND'" in result.stderr


def test_apply_invalid_policy_starts_nothing(tmp_path: Path) -> None:
    bad, marker = tmp_path / "bad.yaml", tmp_path / "started"
    bad.write_text(BAD_POLICY)
    result = invoke("apply", str(bad), "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert result.exit_code == 1
    assert all(line.startswith("hookpolicy: ") for line in result.stderr.splitlines())  # apply's lines, all
    assert_problem_lines(result.stderr.replace("hookpolicy: ", "", result.stderr.count("\n") - 1))
    assert result.stderr.splitlines()[-1].startswith("hookpolicy: nothing was started: ")
    assert not marker.exists()


def test_apply_rejects_a_bad_port() -> None:
    result = invoke("apply", MONITOR, "--metrics-port", "70000", "--", "true")
    assert result.exit_code == 2


# -- schema, export, version, help -------------------------------------------------------


def test_schema_prints_the_json_schema() -> None:
    result = invoke("schema")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["$schema"].startswith("http://json-schema.org/")
    assert result.stdout.rstrip("\n") == schema_json().rstrip("\n")


def test_export_verbs() -> None:
    pytest.importorskip("hookpolicy.export.rules")
    rules = invoke("export", "prometheus-rules", MONITOR)
    assert rules.exit_code == 0, rules.output
    assert "groups" in rules.stdout
    dashboard = invoke("export", "grafana", MONITOR)
    assert dashboard.exit_code == 0, dashboard.output
    assert isinstance(json.loads(dashboard.stdout), dict)


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"hookpolicy, version {__version__}"


@pytest.mark.parametrize("command", [
    [], ["check"], ["explain"], ["apply"], ["schema"], ["export"], ["export", "prometheus-rules"],
    ["export", "grafana"],
])
def test_help(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert result.stdout.startswith("Usage: hookpolicy")


def test_python_dash_m_is_the_same_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "hookpolicy", "check", MONITOR], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == invoke("check", MONITOR).stdout


# -- the README's two commands -----------------------------------------------------------


def readme_commands() -> tuple[str, str]:
    """(run the bundled example, run the tests): the indented command lines of "The two commands"."""
    section = (REPO / "README.md").read_text().split("## The two commands", 1)[1].split("\n## ", 1)[0]
    example, tests = [line.strip() for line in section.splitlines()
                      if line.startswith("    pip install") and "--index-url" not in line]
    return example, tests


def test_readme_names_the_cpu_wheel_index_next_to_the_pinned_torch() -> None:
    """Both commands come with PyTorch's CPU index on the pinned torch, and otherwise as on the mirror."""
    section = (REPO / "README.md").read_text().split("## The two commands", 1)[1].split("\n## ", 1)[0]
    cpu = [line.strip() for line in section.splitlines() if "--index-url" in line]
    assert len(cpu) == 2
    for line, mirror in zip(cpu, readme_commands()):
        pinned, rest = mirror.split(" && ", 1)
        assert line == f"{pinned} --index-url https://download.pytorch.org/whl/cpu && {rest}"


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    _, tests = readme_commands()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert tests in ci
    installs = [part for part in tests.split(" && ") if part.startswith("pip install")]
    assert installs and all("torch==2.13.0" in part.split() for part in installs)  # never a CUDA torch


@pytest.mark.slow
def test_the_readme_example_command_runs_and_serves_metrics(free_port: int) -> None:
    """The README's main-job command as written, on a free port and for 3 steps instead of 200."""
    example, _ = readme_commands()
    apply = example.split(" && ")[-1]
    assert re.search(r"--metrics-port 9400 .*--steps 200 --sleep 0.05$", apply), apply
    argv = apply.replace("--metrics-port 9400", f"--metrics-port {free_port}").replace("--steps 200", "--steps 3").split()
    assert argv[:2] == ["hookpolicy", "apply"] and argv[argv.index("--") + 1] == "python"
    argv[0:1] = [sys.executable, "-m", "hookpolicy"]
    argv[argv.index("--") + 1] = sys.executable
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"metrics on http://127.0.0.1:{free_port}/metrics" in done.stderr
    assert "governing" in done.stderr


# -- a forgotten `--` --------------------------------------------------------------------


def test_a_forgotten_dash_dash_is_named_with_the_command_line_meant() -> None:
    result = invoke("apply", MONITOR, "python", "train.py", "--steps", "3")
    assert result.exit_code == 2
    assert "no such option '--steps'" in result.output
    assert f"hookpolicy apply {MONITOR} -- python train.py --steps 3" in result.output
    bare = invoke("apply", MONITOR, "--audit", "python", "train.py")
    assert bare.exit_code == 2 and f"hookpolicy apply {MONITOR} -- python train.py" in bare.output
    # An option of nobody's, with the `--` in place, stays click's plain error.
    typo = invoke("apply", MONITOR, "--bogus", "--", "python", "train.py")
    assert typo.exit_code == 2 and "--bogus" in typo.output
    assert "put the training command" not in typo.output


@pytest.mark.parametrize("marks, soak", [([], False), (["-m", "not slow"], False), (["-m", "soak"], True)])
def test_the_soak_test_runs_only_when_asked(marks: list[str], soak: bool) -> None:
    """The README's quick loop (`-m 'not slow'`) must not start the 10,000-step soak test."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *marks,
                           "tests/test_soak.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    collected = [line for line in done.stdout.splitlines() if "::" in line and "[10000]" in line]
    assert bool(collected) == soak, done.stdout


def test_check_hints_what_would_be_right(tmp_path: Path) -> None:
    """C's `&&`, a bare number for `scale`, a bare path for `log`: each error says the YAML meant;
    a wrong target is one error, not also an "unknown statistic" for the name its intended target has."""
    path = tmp_path / "hints.yaml"
    path.write_text("""\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: hints}
spec:
  rules:
    - name: r1
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "l2_norm > 1 && nonfinite > 0"}
        - scale: 0.5
        - capture: {stats: [l2_norm], log: runs/x.jsonl}
    - name: r2
      match: {root: true}
      trigger: {at: step}
      target: los
      actions:
        - alert: {if: "loss > 3 || nonfinite > 0"}
""")
    result = invoke("check", str(path))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"{path}:11:36: $.spec.rules[0].actions[0].alert.if: invalid condition: unexpected character '&'; "
        "write 'and' to combine comparisons",
        f"{path}:12:18: $.spec.rules[0].actions[1].scale: expected a mapping, got number 0.5; write scale: {{factor: 0.5}}",
        f"{path}:13:44: $.spec.rules[0].actions[2].capture.log: expected a mapping, got string 'runs/x.jsonl'; "
        "write log: {path: runs/x.jsonl}",
        f"{path}:17:15: $.spec.rules[1].target: 'los' is not one of: input, output, grad_output, grad_input, grad, "
        "weight, loss, update, optimizer_state; did you mean 'loss'?",
        f"{path}:19:33: $.spec.rules[1].actions[0].alert.if: invalid condition: unexpected character '|'; "
        "write 'or' to combine comparisons",
    ]


def test_a_hint_quotes_a_string_it_cannot_write_back_plain(tmp_path: Path) -> None:
    """The shorthand hint writes a bare string back as it was written only where it reads so on one line;
    a string with a line break (hypothesis found '\\n' in metadata) or edge spaces is quoted, and the
    problem stays one line."""
    path = tmp_path / "hints.yaml"
    path.write_text('apiVersion: hookpolicy/v1\nkind: HookPolicy\nmetadata: "a\\nb "\nspec: {rules: []}\n')
    result = invoke("check", str(path))
    assert result.exit_code == 1
    assert f"{path}:3:11: $.metadata: expected a mapping, got string 'a\\nb '; write metadata: {{name: \"a\\nb \"}}" \
        in result.stderr.splitlines()


def test_explain_of_a_script_without_a_main_guard_does_not_train_it(tmp_path: Path) -> None:
    """`--model train.py:model` runs the script's top level only up to the line that builds `model`."""
    script = tmp_path / "train.py"
    script.write_text("""\
from __future__ import annotations
import pathlib
import torch


def build(width: Width) -> torch.nn.Module:  # a forward reference: the future import holds
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))


Width = int
model = build(16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
pathlib.Path(__file__).with_name("trained").write_text("the training loop ran")
""")
    result = invoke("explain", MONITOR, "--model", f"{script}:model")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "trained").exists()
    assert "example-monitor/grad-norms" in result.stdout
    assert f"hookpolicy: {script}: ran its top level up to line 11, where 'model' is defined; lines 12-13" in \
        result.stderr


def test_check_names_every_unknown_name_of_an_expression(tmp_path: Path) -> None:
    path = tmp_path / "names.yaml"
    path.write_text("""\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: names}
spec:
  rules:
    - name: r
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "l2_nrm > 1 and foo > 2 and zscore(bar, 10) > 3"}
""")
    result = invoke("check", str(path))
    assert result.exit_code == 1
    found = [line.split(": invalid condition: ", 1)[1].split(";")[0] for line in result.stderr.splitlines()]
    assert found == ["unknown statistic 'l2_nrm'", "unknown statistic 'foo'", "unknown statistic 'bar'"]
    assert [line.split(":")[1:3] for line in result.stderr.splitlines()] == [["11", "24"], ["11", "39"], ["11", "58"]]


def test_check_gives_the_first_syntax_error_of_each_part_of_an_expression_and_every_unknown_name(
    tmp_path: Path,
) -> None:
    """A syntax error no longer ends the check of a condition: each part between a top-level
    `and`/`or` gets its first syntax error, the names skipped after one are still checked, and
    a C operator is said and read as its word."""
    path = tmp_path / "syntax.yaml"
    path.write_text("""\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: syntax}
spec:
  rules:
    - name: r
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "(l2_norm > > 1 and std < 2) or zscor(mean, 10) > 1 && max(l2_nrm, 5) > 0 or mean >"}
""")
    result = invoke("check", str(path))
    assert result.exit_code == 1
    line = path.read_text().splitlines()[10]
    END = '"}'  # the expression's end: its closing quote

    def at(needle: str) -> str:  # FILE:LINE:COL of `needle` in the policy's line 11, 1-based
        return f"{path}:11:{line.index(needle) + 1}: $.spec.rules[0].actions[0].alert.if: invalid condition:"

    assert result.stderr.splitlines() == [
        f"{at('> 1 and')} expected a number, a name, a function or '(' after '>' but found '>'",
        f"{at('zscor(')} 'zscor' is not a function; did you mean 'zscore'? the functions are: "
        "prev, count, ema, ema_std, mean, std, min, max, zscore, median, mad, robust_z",
        f"{at('&&')} unexpected character '&'; write 'and' to combine comparisons",
        f"{at('l2_nrm')} unknown statistic 'l2_nrm'; did you mean 'l2_norm'? one of: {', '.join(sorted(STATS))}",
        f"{at(END)} expected a number, a name, a function or '(' after '>' but found 'the end'",
    ]


def test_a_negation_is_answered_with_the_opposite_comparison(tmp_path: Path) -> None:
    """The language has no `not`; `!` is answered with what to write instead, and the
    hint's suggestion (the opposite comparison) is itself accepted by check."""
    path = tmp_path / "negation.yaml"
    text = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: negation}
spec:
  rules:
    - name: r
      match: {types: [Linear]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "!(l2_norm > 1)"}
"""
    path.write_text(text)
    result = invoke("check", str(path))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"{path}:11:24: $.spec.rules[0].actions[0].alert.if: invalid condition: unexpected character '!'; "
        "the language has no 'not': write the opposite comparison (<= for >, != for ==)"]
    path.write_text(text.replace("!(l2_norm > 1)", "l2_norm <= 1"))
    assert invoke("check", str(path)).exit_code == 0
