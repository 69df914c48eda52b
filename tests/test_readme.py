"""The README is a test: every shell command and code block in it (and in the docs' quick
starts) runs as written, in a copy of the checkout, with the interpreter under test.

The installs are not re-run: they are checked against `.ci/run`, which runs them. The
benchmarks (their README comment says how many minutes they take) are not run either:
their options are checked against the script's own `--help`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from helpers.outputs import alert_lines

REPO = Path(__file__).resolve().parent.parent
#: file -> the heading its quick start ends at (docs/guardrails.md has its one command in the README)
QUICK_STARTS = {"README.md": None, "docs/operations.md": "## 3. "}


@dataclass(frozen=True)
class Block:
    """A code block of a Markdown file: its language ("" for an indented block) and text."""

    file: str
    line: int
    lang: str
    text: str


def blocks(name: str) -> Iterator[Block]:
    """The fenced blocks and the indented (4-space, after a blank line) blocks of a Markdown
    file's quick start (the whole README)."""
    text = (REPO / name).read_text("utf-8")
    end = QUICK_STARTS.get(name)
    lines = (text.split("\n" + end, 1)[0] if end else text).splitlines()
    fence: list[str] = []
    lang, start, blank, indented = None, 0, True, []
    for number, line in enumerate(lines, 1):
        if lang is not None:
            if line.startswith("```"):
                yield Block(name, start, lang, "\n".join(fence) + "\n")
                lang, fence = None, []
            else:
                fence.append(line)
            continue
        if line.startswith("```"):
            lang, start = line[3:].strip() or "text", number  # an untagged fence: a synopsis, not a command
            continue
        if line.startswith("    ") and (blank or indented):
            indented.append(line[4:])
            start = start if len(indented) > 1 else number
        elif indented:
            yield Block(name, start, "", "\n".join(indented) + "\n")
            indented = []
        blank = line.strip() == ""


def commands(name: str) -> list[tuple[Block, str]]:
    """Each shell command of a file: the lines of its indented and `sh` blocks (comments cut,
    a trailing backslash joined), with the block it is in."""
    out = []
    for block in blocks(name):
        if block.lang not in ("", "sh"):
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                out.append((block, command))
    return out


#: The README's virtual environment: made and entered before anything is installed.
VENV = "python3 -m venv .venv && . .venv/bin/activate"
#: PyTorch's CPU wheel index, for the first install off the project's package mirror.
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def is_install(command: str) -> bool:
    return command.startswith(("pip install", "apt-get", "python3 -m venv", ". .venv/bin/activate"))


def is_bench(block: Block, command: str) -> bool:
    """A benchmark: its comment in the block says it takes minutes."""
    line = next(line for line in block.text.splitlines() if line.strip().startswith(command.split()[0]) and
                command.split()[1] in line)
    return command.startswith("python bench/") and "minute" in line


def ci_script() -> str:
    return (REPO / ".ci" / "run").read_text("utf-8")


# -- what is not run: checked against what runs it ----------------------------------------


def test_the_installs_are_the_ones_ci_runs() -> None:
    """The README's system packages are the ones .ci/run installs; .ci/run makes a fresh venv and
    runs the README's test command in it; both commands come with the pinned CPU torch, from
    PyTorch's CPU index and from the mirror, the example without the test extra."""
    readme = [command for _, command in commands("README.md") if is_install(command.split(" && ")[0])]
    (apt,) = [c for c in readme if c.startswith("apt-get")]
    assert apt == ("apt-get update && apt-get install -y prometheus prometheus-alertmanager prometheus-pushgateway "
                   "prometheus-node-exporter chromium")
    ci = ci_script()
    ci_apt = re.findall(r"apt-get install -y -q ([\w .-]+)", ci)
    # (python3-venv: what Debian's python3 needs for the venv, when the image lacks it)
    assert ci_apt and {p for line in ci_apt for p in line.split()} - {"python3-venv"} == set(apt.split("-y ")[1].split())
    # the venv comes first, before any pip install; .ci/run makes one (python3 -m venv) and enters it
    assert readme.index(VENV) == 0
    mirror = "pip install torch==2.13.0 && pip install torch==2.13.0 -e '.[test]' && python -m pytest"
    ci_lines = [line.strip() for line in ci.splitlines()]
    assert mirror in ci_lines
    made = [n for n, line in enumerate(ci_lines) if re.match(r'python3 -m venv "?\$\w+"?$', line)]
    entered = [n for n, line in enumerate(ci_lines) if re.match(r'\. "?\$\w+/bin/activate"?$', line)]
    assert made and entered and made[0] < entered[0] < ci_lines.index(mirror)
    # each command in both forms: the CPU index on the first install, or the mirror's torch==2.13.0
    cpu = mirror.replace("pip install torch==2.13.0 &&", f"pip install torch==2.13.0 {CPU_INDEX} &&", 1)
    assert mirror in readme and cpu in readme
    example = [c for c in readme if "hookpolicy apply" in c]
    assert len(example) == 2
    assert example[0] == example[1].replace("pip install torch==2.13.0 &&", f"pip install torch==2.13.0 {CPU_INDEX} &&", 1)
    assert example[1].startswith("pip install torch==2.13.0 && pip install -e . && hookpolicy apply ")
    # the report extra, from the checkout (a bare 'hookpolicy[report]' is not on any index): the
    # extra exists, and the test extra (what CI has) holds it
    assert "pip install -e '.[report]'" in readme
    pyproject = (REPO / "pyproject.toml").read_text("utf-8")
    assert re.search(r'^report = \["matplotlib', pyproject, re.M)
    test_extra = pyproject.split("\ntest = [", 1)[1].split("]", 1)[0]
    assert "matplotlib" in test_extra


def test_the_readme_gives_no_stale_numbers_of_tests() -> None:
    """Counts and durations of the suite change with every commit: the README leaves them to pytest."""
    text = (REPO / "README.md").read_text("utf-8")
    assert not re.search(r"[\d,]+ tests|about \d+ slow|\(about \d+, among them", text)


def test_the_language_summary_names_the_whole_language_and_points_to_its_contract() -> None:
    """Every target, `then` and statistic of the JSON Schema, and every history function the
    expression parser knows, is in the README's summary, which sends the reader to
    docs/policy-language.md (a file the repository has) for the rest; no unnamed "spec"."""
    from hookpolicy.policy.expr import FUNCTIONS

    text = (REPO / "README.md").read_text("utf-8")
    summary = text.split("- **match**:", 1)[1].split("`hookpolicy check policy.yaml`", 1)[0]
    schema = json.loads((REPO / "schemas" / "hookpolicy-v1.schema.json").read_text("utf-8"))
    enums: list[list[str]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                enums.append([str(v) for v in node["enum"]])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    (targets,) = [e for e in enums if "grad_output" in e]
    (thens,) = [e for e in enums if "skip_step" in e]
    flat = " ".join(summary.split())
    for word in [*targets, *thens]:
        assert f"`{word}`" in flat or re.search(rf"[`|] ?{word} ?[|`]", flat), word
    for func in FUNCTIONS:
        assert re.search(rf"\b{func}[(/]", flat) or re.search(rf"/{func}[/(]", flat), func
    assert "(docs/policy-language.md)" in flat and (REPO / "docs" / "policy-language.md").is_file()
    assert "project spec" not in text


@pytest.mark.parametrize("name", QUICK_STARTS)
def test_every_bench_command_names_options_its_script_has(name: str) -> None:
    benches = [c for block, c in commands(name) if is_bench(block, c)]
    for command in benches:
        argv = shlex.split(command)
        done = subprocess.run([sys.executable, argv[1], "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        for word in argv[2:]:
            if word.startswith("--"):
                assert word in done.stdout, f"{command}: {word} is not an option of {argv[1]}"


# -- what is run: a copy of the checkout, the commands as written --------------------------


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout without git and caches; `python` and `hookpolicy` on PATH are the
    interpreter under test and its copy of hookpolicy."""
    root = tmp_path_factory.mktemp("readme")
    copy = root / "checkout"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".mypy_cache",
                                                              ".pytest_cache", ".hypothesis", "runs"))
    shims = root / "bin"
    shims.mkdir()
    # Scripts that exec the interpreter by its own path, not symlinks to it: a venv's Python
    # started through a link in another folder finds no pyvenv.cfg beside it and runs as the
    # base Python, without the venv's packages.
    for name, argv in (("python", ""), ("hookpolicy", " -m hookpolicy")):
        (shims / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{argv} "$@"\n')
        (shims / name).chmod(0o755)
    return copy


@pytest.mark.slow
def test_python_on_the_path_is_the_interpreter_under_test(checkout: Path) -> None:
    """`python` in a README command is this interpreter with its own site: the same prefix (a
    venv's, in a venv) and the same torch, as Python itself reports them."""
    probe = "import sys, torch; print(sys.prefix); print(sys.base_prefix); print(torch.__file__)"
    done = run(checkout, f"python -c {shlex.quote(probe)}")
    assert done.returncode == 0, done.stderr[-2000:]
    import torch

    assert done.stdout.splitlines() == [sys.prefix, sys.base_prefix, torch.__file__]


def environment(checkout: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKPOLICY_")}
    env["PATH"] = f"{checkout.parent / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(checkout)
    return env


def listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts}


def run(checkout: Path, command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """One command of the README through bash, in the copy; what it leaves must be in .gitignore's runs/."""
    before = listing(checkout)
    done = subprocess.run(["bash", "-c", command], cwd=checkout, env=environment(checkout), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    left = {p for p in listing(checkout) - before if not p.startswith("runs")}
    assert not left, f"{command!r} left {sorted(left)} in the checkout"
    return done


def runnable(name: str) -> list[str]:
    """The commands of a file that the doc-test runs: all but installs and benchmarks; of a
    command that installs first, the part after the installs."""
    out = []
    for block, command in commands(name):
        parts = command.split(" && ")
        while parts and is_install(parts[0]):
            parts.pop(0)
        if parts and parts != ["python -m pytest"] and not is_bench(block, command):  # not the suite itself
            out.append(" && ".join(parts))
    return list(dict.fromkeys(out))


def test_the_doc_test_sees_every_command() -> None:
    """The parser finds the README's commands (a changed layout must not make this test vacuous)."""
    found = runnable("README.md")
    assert "hookpolicy apply policies/loss-spike-guard.yaml -- python bench/instability.py train --corrupt epoch --steps 100" in found
    assert any(c.startswith("hookpolicy report ") for c in found)
    assert len(found) >= 5, found
    assert "hookpolicy explain policies/gradient-monitor.yaml --model examples.charlm:build_model" in runnable(
        "docs/operations.md")


@pytest.mark.slow
@pytest.mark.parametrize("name", QUICK_STARTS)
def test_every_command_runs_as_written(name: str, checkout: Path) -> None:
    shutil.rmtree(checkout / "runs", ignore_errors=True)
    for command in runnable(name):
        done = run(checkout, command)
        assert done.returncode == 0, f"{name}: {command}\n{done.stderr[-3000:]}"
        check_output(command, done, checkout)


def check_output(command: str, done: subprocess.CompletedProcess[str], checkout: Path) -> None:
    """What the README says a newcomer sees, for the commands it describes."""
    if "bench/instability.py train --corrupt epoch --steps 100" in command:
        alerts = alert_lines(done.stderr)
        assert [a["step"] for a in alerts] == list(range(80, 88)), done.stderr[-2000:]
        skipped = [80, 81, 82, 83, 85, 86, 87]  # the fifth in a row, 84, is applied: max_in_a_row 4
        assert [a["step"] for a in alerts if a["message"].endswith("; step skipped")] == skipped
        assert alerts[4]["message"].endswith("(4 skipped in a row on the same weights: a spike that outlasts them "
                                             "may be the weights', which only an update undoes; the update is applied)")
        readme = (REPO / "README.md").read_text("utf-8")
        quoted = readme.split("each ending in `step skipped`\nbut step 84's, such as `", 1)[1].split("`", 1)[0]
        assert " ".join(quoted.split()) in done.stderr.splitlines()
        summary = readme.split("then the run summary (`", 1)[1].split("`", 1)[0]
        assert f"hookpolicy:   {' '.join(summary.split())}" in done.stderr.splitlines()
        steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"step"')]
        assert len(steps) == 100
        assert [s["step"] for s in steps if not s["updated"]] == skipped
        jumps = [s["loss"] for s in steps if s["corrupt"]], [s["loss"] for s in steps[60:80]]
        assert 4.5 < min(jumps[0]) and max(jumps[1]) < 1.6  # "from about 1.2-1.3 to about 5.4"
    if command.startswith("hookpolicy apply policies/observe.yaml"):
        assert (checkout / "runs" / "observe.jsonl").is_file()
        if "--report runs/report.html" in command:
            said = (REPO / "README.md").read_text("utf-8").split("one line says so:\n`", 1)[1].split("`", 1)[0]
            line = said.replace(".../", f"{checkout}/")
            assert line in done.stderr and (checkout / "runs" / "report.html").is_file(), done.stderr[-2000:]
    if command.startswith("hookpolicy report "):
        assert (checkout / "runs" / "again.html").is_file()
        assert any((checkout / "runs" / "figures").glob("*.png"))
    if command.startswith("hookpolicy replay "):
        said = (REPO / "README.md").read_text("utf-8").split("the log lacks is named (`", 1)[1].split(" ...`)", 1)[0]
        assert any(line.startswith(f"  {' '.join(said.split())}") for line in done.stdout.splitlines()), done.stdout
        assert "loss-spike-guard/loss-spike:" in done.stdout.splitlines()
    if "--metrics-port 9400" in command:
        assert "governing Sequential" in done.stderr


@pytest.mark.slow
def test_the_python_blocks_run_as_written(checkout: Path) -> None:
    python = [b for b in blocks("README.md") if b.lang == "python"]
    assert python
    for block in python:
        done = run(checkout, f"python -c {shlex.quote(block.text)}")
        assert done.returncode == 0, f"README.md:{block.line}: {done.stderr[-3000:]}"
        printed = done.stdout.splitlines()
        assert "None" not in printed, f"README.md:{block.line} printed None:\n{done.stdout}"
        if "hookpolicy_steps_total" in block.text:
            said = re.search(r'"hookpolicy_steps_total".*# (\S+)$', block.text, re.M)
            assert said and printed[0] == said.group(1) == "20"  # the 20 steps, as the comment says
            assert float(printed[-1]) > 0  # the last gradient norm of layer 4


@pytest.mark.slow
def test_the_readme_policy_checks_and_runs(checkout: Path) -> None:
    (policy,) = [b for b in blocks("README.md") if b.lang == "yaml" and "kind: HookPolicy" in b.text]
    (checkout / "runs").mkdir(exist_ok=True)
    (checkout / "runs" / "readme-policy.yaml").write_text(policy.text)
    done = run(checkout, "hookpolicy check runs/readme-policy.yaml "
                         "&& hookpolicy apply --strict runs/readme-policy.yaml -- python -m examples.charlm --steps 20")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (checkout / "runs" / "activations.jsonl").is_file()


# -- what the README says a feature costs, measured --------------------------------------


AGREEING_POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: guard}
spec:
  rules:
    - name: nan
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - alert: {if: "nonfinite > 0", per: rule, then: skip_step}
"""


def gathered(rank: int, policy: str) -> list[list[int]]:
    """DDP under a skip rule on 2 gloo ranks: per step, the size of every collective hookpolicy issued
    (torch.distributed's own all_gather_single and all_reduce, wrapped), in int64 per rank."""
    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples"))
    from train_mlp import build_model, make_data

    import hookpolicy

    issued: list[tuple[str, int]] = []
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "all_reduce", "all_gather")}

    def counting(name: str) -> object:
        def wrapper(*args: object, **kwargs: object) -> object:
            tensor = args[1] if name == "all_gather_single" else args[0]
            if isinstance(tensor, torch.Tensor):
                issued.append((name, tensor.numel() if tensor.dtype == torch.int64 else -1))
            return originals[name](*args, **kwargs)
        return wrapper

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(rank)
    steps: list[list[int]] = []
    with hookpolicy.load(policy).attach(model, rank=rank):
        for step in range(3):
            torch.nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
            for name in originals:
                setattr(dist, name, counting(name))
            try:
                optimizer.step()
            finally:
                for name, original in originals.items():
                    setattr(dist, name, original)
            steps.append([n for name, n in issued if name == "all_gather_single"] + [
                -2 for name, _ in issued if name != "all_gather_single"])
            issued.clear()
            optimizer.zero_grad()
    return steps


@pytest.mark.slow
def test_the_agreement_costs_what_the_readme_says(tmp_path: Path, free_port: int) -> None:
    """'one `all_gather` of N int64 per rank': the one collective of an enforced skip rule's step, as
    torch.distributed's own call received it on 2 gloo ranks, and nothing else."""
    from helpers.distributed import spawn

    readme = " ".join((REPO / "README.md").read_text("utf-8").split())
    said = re.search(r"costs one `all_gather` of (\d+) int64 per rank", readme)
    assert said, "the README says what a step of the agreement costs"
    (tmp_path / "guard.yaml").write_text(AGREEING_POLICY)
    ranks = spawn(gathered, tmp_path, free_port, str(tmp_path / "guard.yaml"))
    for steps in ranks:
        assert steps == [[int(said.group(1))]] * 3, steps
