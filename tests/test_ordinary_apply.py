"""A governed model stays an ordinary model (issue 12), under `hookpolicy apply`, in real processes.

One script (`SCRIPT`) trains a model with no hookpolicy in it, does one operation to it
(save, pickle, deepcopy, average, ...), and records with its own forward hooks the norm
of every output of the original's Linear layers. The policy logs what hookpolicy
captured; the two lists must be the same: nothing of a copy's calls in it, nothing of
the original's missing. Files the script writes under `apply` must be byte-identical to
those of the same script run without hookpolicy, and must load in a Python where
hookpolicy cannot be imported. The bundled examples' `--save` is checked the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import pytest

from helpers import REPO
from helpers.processes import Run, child_env

POLICY = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: ordinary}
spec:
  rules:
    - name: act
      match: {types: [Linear]}
      trigger: {at: forward, phase: any}
      target: output
      actions: [{capture: {stats: [l2_norm], log: {path: act.jsonl}}}]
    - name: grads
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions: [{capture: {stats: [l2_norm], per: tensor, log: {path: grads.jsonl}}}]
"""

SCRIPT = '''\
"""Train two steps, then do each operation in argv[2] to the model, each followed by one training step."""
import copy, json, os, pickle, sys
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

out = sys.argv[1]
OPS = sys.argv[2].split(",")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
step = 0
dtype = torch.float32
report = {"own": [], "checks": {}}
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


def data(seed):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(6, 4, generator=g).to(dtype), torch.randn(6, 2, generator=g).to(dtype)


def recorded(call):
    """Run call() with the script's own forward hooks on the original's Linear layers."""
    def hook(name):
        return lambda m, a, o: report["own"].append([step, name, torch.linalg.vector_norm(o.detach().double()).item()])
    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in ("0", "2")]
    try:
        return call()
    finally:
        for h in handles:
            h.remove()


def train(steps=1):
    global step
    for _ in range(steps):
        x, y = data(step)
        recorded(lambda: nn.functional.mse_loss(model(x), y).backward())
        opt.step()
        opt.zero_grad()
        step += 1


def hooks(m):
    return sum(len(getattr(s, name)) for s in m.modules() for name in HOOK_DICTS)


def check(op, name, value):
    report["checks"].setdefault(op, {})[name] = value


def use(op, copied):
    """Call a copy as training and evaluation would, on an input no call of the original sees."""
    big = data(0)[0] * 1000
    copied.train()
    copied(big).sum().backward()
    copied.eval()
    with torch.no_grad():
        copied(big)
    check(op, "copy_hooks", hooks(copied))


def same_outputs(copied):
    x = data(99)[0]
    with torch.no_grad():
        return bool(torch.equal(copied(x), recorded(lambda: model(x))))


def saved(op, obj):
    path = os.path.join(out, f"{op}.pt")
    torch.save(obj, path)
    with open(path, "rb") as f:
        check(op, "hookpolicy_in_file", b"hookpolicy" in f.read())
    return path


train(2)
for op in OPS:
    check(op, "step", step)
    if op == "save":
        loaded = torch.load(saved(op, model), weights_only=False)
        check(op, "same_outputs", same_outputs(loaded))
        use(op, loaded)
    elif op == "pickle":
        pickled = pickle.dumps(model)
        check(op, "hookpolicy_in_pickle", b"hookpolicy" in pickled)
        loaded = pickle.loads(pickled)
        check(op, "same_outputs", same_outputs(loaded))
        saved(op, loaded)
        use(op, loaded)
    elif op == "deepcopy":
        copied = copy.deepcopy(model)
        check(op, "same_outputs", same_outputs(copied))
        saved(op, copied)
        use(op, copied)
    elif op == "averaged":
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        check(op, "copy_hooks", hooks(ema))
        train()
        ema.update_parameters(model)
        saved(op, ema.state_dict())
        use(op, ema)
    elif op == "state_dict":
        fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        fresh.load_state_dict(torch.load(saved(op, model.state_dict())))
        check(op, "same_outputs", same_outputs(fresh))
        use(op, fresh)
        model.load_state_dict(fresh.state_dict())
    elif op == "copy_trained":
        copied = copy.deepcopy(model)
        copied_opt = torch.optim.SGD(copied.parameters(), lr=0.1)
        for i in range(3):
            x, y = data(50 + i)
            nn.functional.mse_loss(copied(x), y).backward()
            copied_opt.step()
            copied_opt.zero_grad()
    elif op == "train_eval":
        model.eval()
        with torch.no_grad():
            recorded(lambda: model(data(98)[0]))
        model.train()
    elif op == "user_hook":
        calls = []
        handle = model[2].register_forward_hook(lambda m, a, o: calls.append(1))
        train()
        handle.remove()
        check(op, "user_hook_calls", len(calls))
    elif op == "requires_grad":
        model[0].requires_grad_(False)
        train()
        model[0].requires_grad_(True)
    elif op == "replace":
        model[2] = nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif op == "to_dtype":
        model.to(torch.float64)
        dtype = torch.float64
    else:
        sys.exit(f"unknown op {op}")
    train()
saved("final", model)
report["steps"] = step
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
'''

#: in the order the script does them; to_dtype last, as it changes every later number
OPS = ("save", "pickle", "deepcopy", "averaged", "state_dict", "copy_trained", "train_eval", "user_hook",
       "requires_grad", "replace", "to_dtype")
#: the files the script writes, which must be byte-identical with and without hookpolicy
FILES = ("save", "pickle", "deepcopy", "averaged", "state_dict", "final")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The script run under `apply` and plain: (its folder under apply, the plain one, apply's stderr)."""
    folder = tmp_path_factory.mktemp("ordinary")
    script, policy = folder / "ordinary.py", folder / "policy.yaml"
    script.write_text(SCRIPT)
    policy.write_text(POLICY)
    governed, plain = folder / "apply", folder / "plain"
    governed.mkdir()
    plain.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "hookpolicy", "apply", str(policy), "--",
         sys.executable, str(script), str(governed), ",".join(OPS)],
        env=child_env(HOOKPOLICY_OUTPUT_DIR=str(governed)), capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    subprocess.run([sys.executable, str(script), str(plain), ",".join(OPS)], env=child_env(), check=True, timeout=300)
    return governed, plain, run.stderr


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rounded(triples: Iterable[Sequence[Any]]) -> Counter[tuple[int, str, float]]:
    return Counter((int(step), str(module), float(f"{value:.6g}")) for step, module, value in triples)


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
def test_an_operation_under_apply_is_as_without_hookpolicy(runs: tuple[Path, Path, str], op: str) -> None:
    """hookpolicy logged exactly the original's calls around the op; the op's file is the plain run's."""
    governed, plain, _ = runs
    report = json.loads((governed / "report.json").read_text())
    checks = report["checks"][op]
    assert checks.get("hookpolicy_in_file") is not True
    assert checks.get("hookpolicy_in_pickle") is not True
    assert checks.get("same_outputs") is not False
    assert checks.get("copy_hooks", 0) == 0
    assert checks.get("user_hook_calls", 1) == 1
    around = {checks["step"], checks["step"] + 1}  # the op, and the training step after it
    logged = rounded((r["step"], r["module"], r["stats"]["l2_norm"]) for r in records(governed / "act.jsonl"))
    own = rounded(report["own"])
    logged_here = Counter({k: n for k, n in logged.items() if k[0] in around})
    own_here = Counter({k: n for k, n in own.items() if k[0] in around})
    if op == "copy_trained":  # governed on its own merits: its records join the log, the original's all stay
        assert not own_here - logged_here
    else:
        assert logged_here == own_here
    grads = {(r["step"], r["module"], r["tensor"]) for r in records(governed / "grads.jsonl") if r["step"] in around}
    trained = {(s, m, t) for s in around if s < report["steps"] for m in ("0", "2") for t in ("weight", "bias")}
    if op == "requires_grad":  # layer 0 is frozen for the op's own training step
        trained -= {(checks["step"], "0", "weight"), (checks["step"], "0", "bias")}
    assert grads == trained
    if op in FILES:
        assert (governed / f"{op}.pt").read_bytes() == (plain / f"{op}.pt").read_bytes()


@pytest.mark.slow
def test_the_whole_run_under_apply_is_as_without_hookpolicy(runs: tuple[Path, Path, str]) -> None:
    governed, plain, stderr = runs
    report = json.loads((governed / "report.json").read_text())
    logged = rounded((r["step"], r["module"], r["stats"]["l2_norm"]) for r in records(governed / "act.jsonl"))
    assert not rounded(report["own"]) - logged
    assert (governed / "final.pt").read_bytes() == (plain / "final.pt").read_bytes()
    assert stderr.count("hookpolicy: governing Sequential") == 2, stderr  # the model, and the copy it trained
    assert "Traceback" not in stderr, stderr


LOAD_WITHOUT_HOOKPOLICY = """\
import importlib.util, sys
sys.path.append(sys.argv[1])  # site-packages, without its .pth files: no editable hookpolicy
assert importlib.util.find_spec("hookpolicy") is None, "hookpolicy is importable here"
import torch
kind, n = sys.argv[2], int(sys.argv[3])
x = torch.arange(n).reshape(1, n) if kind == "tokens" else torch.linspace(-1, 1, n).reshape(1, n)
for path in sys.argv[4:]:
    model = torch.load(path, weights_only=False)
    with torch.no_grad():
        out = model(x.to(next(model.parameters()).dtype) if x.is_floating_point() else x)
    out = out[0] if isinstance(out, tuple) else out  # nanoGPT-style models return (logits, loss)
    print(repr(out.flatten().tolist()))
"""


def load_without_hookpolicy(folder: Path, paths: Sequence[Path], features: int, tokens: bool = False,
                            lib: str = "") -> list[str]:
    """Load whole-model files in a Python that cannot import hookpolicy; each one's output on a fixed input.

    `python -S` skips site-packages' `.pth` files (the editable install of hookpolicy is one);
    site-packages itself goes back on the path for torch; `lib` is the only other entry.
    """
    script = folder / "load.py"
    script.write_text(LOAD_WITHOUT_HOOKPOLICY)
    env = {k: v for k, v in child_env().items() if k not in ("PYTHONPATH", "HOOKPOLICY_BOOTSTRAP")}
    if lib:
        env["PYTHONPATH"] = lib
    done = subprocess.run(
        [sys.executable, "-S", str(script), sysconfig.get_paths()["purelib"], "tokens" if tokens else "features",
         str(features), *map(str, paths)],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.slow
def test_models_saved_under_apply_load_where_hookpolicy_is_not_installed(
    runs: tuple[Path, Path, str], tmp_path: Path,
) -> None:
    governed, plain, _ = runs
    names = ("save.pt", "final.pt")  # right after attach, and in float64 after every operation
    outputs = load_without_hookpolicy(tmp_path, [*(governed / n for n in names), *(plain / n for n in names)], 4)
    assert len(outputs) == 4 and outputs[:2] == outputs[2:]


@pytest.mark.slow
def test_train_mlp_saves_its_best_model_as_without_hookpolicy(apply: Callable[..., Run], tmp_path: Path) -> None:
    args = ["--steps", "30", "--save"]
    plain = tmp_path / "plain.pt"
    subprocess.run([sys.executable, str(REPO / "examples" / "train_mlp.py"), *args, str(plain)],
                   env=child_env(), check=True, capture_output=True, timeout=120)
    governed = tmp_path / "governed.pt"
    run = apply(str(REPO / "policies" / "example-monitor.yaml"), "--",
                sys.executable, str(REPO / "examples" / "train_mlp.py"), *args, str(governed))
    assert run.wait() == 0, run.stderr
    assert "governing Sequential" in run.stderr
    assert governed.read_bytes() == plain.read_bytes()
    assert b"hookpolicy" not in governed.read_bytes()
    outputs = load_without_hookpolicy(tmp_path, [governed, plain], 8)
    assert len(outputs) == 2 and outputs[0] == outputs[1]


@pytest.mark.slow
def test_charlm_saves_its_best_model_as_without_hookpolicy(apply: Callable[..., Run], tmp_path: Path) -> None:
    args = ["-m", "examples.charlm", "--steps", "12", "--eval-every", "4", "--save"]
    plain = tmp_path / "plain.pt"
    subprocess.run([sys.executable, *args, str(plain)], cwd=REPO, env=child_env(), check=True,
                   capture_output=True, timeout=120)
    governed = tmp_path / "governed.pt"
    run = apply(str(REPO / "policies" / "example-monitor.yaml"), "--", sys.executable, *args, str(governed))
    assert run.wait() == 0, run.stderr
    assert "governing TinyGPT" in run.stderr
    assert governed.read_bytes() == plain.read_bytes()
    # The model's class lives in examples/charlm: the loader gets that folder alone, not the repository.
    lib = tmp_path / "lib"
    shutil.copytree(REPO / "examples" / "charlm", lib / "examples" / "charlm", ignore=shutil.ignore_patterns("__pycache__"))
    outputs = load_without_hookpolicy(tmp_path, [governed, plain], 8, tokens=True, lib=str(lib))
    assert len(outputs) == 2 and outputs[0] == outputs[1]
