"""Which processes of a COMMAND's tree `hookpolicy apply` governs, with real processes.

Governed: the COMMAND and the ranks a launcher starts (a new RANK/LOCAL_RANK, or a rank of
`torch.multiprocessing.spawn`). Not governed, and costing nothing: DataLoader workers,
helpers started by exec with the same rank (`subprocess`), forked children. Each script
reports, from inside the process concerned, whether hookpolicy was even imported there:
the reference is `sys.modules`, not anything hookpolicy says about itself.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

from helpers.policies import write_policy
from helpers.processes import Run, child_env

#: Rules on the trainer's `Sequential`: `--strict` stops any process whose model lacks a `0`.
RULES = """\
- name: first
  match: {modules: ["0"]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm], log: {path: log.jsonl}}
"""

#: The trainer: a Sequential trained a few steps; whatever else it does comes from `body`.
TRAINER = """\
import json, os, subprocess, sys
import torch
from torch import nn

def step(model, opt):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

def report(path, **facts):
    with open(path, "w") as out:
        json.dump({"pid": os.getpid(), "hookpolicy": "hookpolicy.apply.child" in sys.modules, **facts}, out)
"""


def _run(apply: Callable[..., Run], folder: Path, *args: str) -> Run:
    """`hookpolicy apply ARGS` with the policies' output folder in `folder`."""
    return apply(*args, env=child_env(HOOKPOLICY_OUTPUT_DIR=str(folder)))


def _script(folder: Path, body: str) -> Path:
    path = folder / "train.py"
    path.write_text(TRAINER + textwrap.dedent(body))
    return path


def _governing_pids(stderr: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"hookpolicy: governing .*\(rank \d+, pid (\d+)\)", stderr)]


@pytest.mark.slow
def test_spawn_dataloader_workers_calling_a_trainable_module_are_not_governed(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    policy = write_policy(tmp_path, RULES)
    script = _script(tmp_path, f"""
        class Samples(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                layer = nn.Linear(4, 4)  # a trainable module, called with grad on, in the worker
                layer(torch.randn(1, 4)).sum().backward()
                return torch.randn(4), "hookpolicy.apply.child" in sys.modules, os.getpid()

        if __name__ == "__main__":
            model = nn.Sequential(nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = torch.utils.data.DataLoader(
                Samples(), batch_size=2, num_workers=2, multiprocessing_context="spawn")
            seen, workers = [], set()
            for x, loaded, pids in loader:
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                seen += loaded.tolist()
                workers |= set(pids.tolist())
            report({str(tmp_path / "trainer.json")!r}, worker_loaded=seen, workers=sorted(workers))
    """)
    run = _run(apply, tmp_path, "--strict", "--metrics-port", str(free_port), str(policy), "--", sys.executable, str(script))
    assert run.wait() == 0, run.stderr
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    assert len(trainer["workers"]) == 2 and trainer["pid"] not in trainer["workers"]
    assert trainer["worker_loaded"] == [False] * 8  # hookpolicy was never imported in a worker
    assert _governing_pids(run.stderr) == [trainer["pid"]]
    assert f"rank 0: metrics on http://127.0.0.1:{free_port}/metrics" in run.stderr
    assert "cannot serve metrics" not in run.stderr


HELPER = """\
import json, os, sys
import torch
from torch import nn

model = nn.Linear(4, 1)  # trained with its own optimizer: a model discovery would govern
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
with open(sys.argv[1], "w") as out:
    json.dump({"pid": os.getpid(), "hookpolicy": "hookpolicy.apply.child" in sys.modules}, out)
"""


@pytest.mark.slow
def test_a_helper_started_with_subprocess_is_not_governed_unless_asked(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    (tmp_path / "helper.py").write_text(HELPER)
    policy = write_policy(tmp_path, RULES)
    script = _script(tmp_path, f"""
        helper, folder = {str(tmp_path / "helper.py")!r}, {str(tmp_path)!r}
        plain = subprocess.Popen([sys.executable, helper, folder + "/plain.json"])  # before torch trains
        model = nn.Sequential(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step(model, opt)
        assert plain.wait() == 0
        subprocess.run([sys.executable, helper, folder + "/after.json"], check=True)
        asked = {{k: v for k, v in os.environ.items() if k != "HOOKPOLICY_PARENT"}}
        subprocess.run([sys.executable, helper, folder + "/asked.json"], env=asked, check=True)
        step(model, opt)
        report(folder + "/trainer.json")
    """)
    # not --strict: the helper asked to be governed trains a Linear, which the rule's "0" misses
    run = _run(apply, tmp_path, "--metrics-port", str(free_port), str(policy), "--", sys.executable, str(script))
    assert run.wait() == 0, run.stderr
    trainer, plain, after, asked = (json.loads((tmp_path / f"{n}.json").read_text())
                                    for n in ("trainer", "plain", "after", "asked"))
    assert not plain["hookpolicy"] and not after["hookpolicy"]
    assert asked["hookpolicy"]
    assert sorted(_governing_pids(run.stderr)) == sorted([trainer["pid"], asked["pid"]])


@pytest.mark.slow
def test_the_ranks_of_torch_multiprocessing_spawn_are_governed(apply: Callable[..., Run], tmp_path: Path) -> None:
    policy = write_policy(tmp_path, RULES)
    script = _script(tmp_path, f"""
        def rank(i):
            model = nn.Sequential(nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                step(model, opt)
            report({str(tmp_path)!r} + f"/rank{{i}}.json")

        if __name__ == "__main__":
            torch.multiprocessing.spawn(rank, nprocs=2)
            report({str(tmp_path / "parent.json")!r})
    """)
    run = _run(apply, tmp_path, "--strict", str(policy), "--", sys.executable, str(script))
    assert run.wait() == 0, run.stderr
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert all(r["hookpolicy"] for r in ranks)
    assert sorted(_governing_pids(run.stderr)) == sorted(r["pid"] for r in ranks)


def _bindable(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_a_forked_child_is_inert_keeps_no_socket_and_writes_no_record(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    log = tmp_path / "log.jsonl"
    release = tmp_path / "release"
    policy = write_policy(tmp_path, RULES)
    script = _script(tmp_path, f"""
        import time
        model = nn.Sequential(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            step(model, opt)
        model(torch.randn(2, 4)).sum().backward()  # step 3 is under way: its gradients are in
        helper = os.fork()
        if helper == 0:  # outlives the trainer; builds and trains a model of its own
            other = nn.Sequential(nn.Linear(4, 1))
            step(other, torch.optim.SGD(other.parameters(), lr=0.1))
            report({str(tmp_path / "helper.json")!r})
            for _ in range(600):
                if os.path.exists({str(release)!r}):
                    break
                time.sleep(0.05)
            sys.exit(0)  # a normal exit: atexit handlers run
        opt.step()
        report({str(tmp_path / "trainer.json")!r}, helper=helper)
    """)
    run = _run(apply, tmp_path, "--metrics-port", str(free_port), str(policy), "--", sys.executable, str(script))
    try:
        assert run.wait() == 0, run.stderr
        helper = json.loads((tmp_path / "trainer.json").read_text())["helper"]
        os.kill(helper, 0)  # still alive
        assert _bindable(free_port)  # the trainer ended: nothing holds its metrics port
    finally:
        release.touch()
    for _ in range(600):
        try:
            os.kill(helper, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    assert _governing_pids(run.stderr) == [trainer["pid"]]
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # one record a step: the helper wrote none of step 3's
