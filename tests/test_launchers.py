"""Launchers and process trees under `hookpolicy apply` (issue 23.5): ranks without RANK,
SIGTERM to ranks stuck in a collective, a launcher killed with SIGKILL.

Real processes: `hookpolicy apply -- torchrun ...` and `apply -- python script.py` whose
script starts its ranks with `torch.multiprocessing.spawn`, on gloo.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from helpers import REPO
from helpers.policies import write_policy
from helpers.processes import Run, scrape, torchrun, value, wait_metrics

pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "helpers" / "dist_train.py")

RULES = """\
- name: norms
  match: {types: [Linear]}
  trigger: {at: step}
  target: grad
  actions:
    - capture: {stats: [l2_norm]}
"""

#: DDP on 2 ranks started by torch.multiprocessing.spawn: no RANK, LOCAL_RANK or WORLD_SIZE in their environment.
SPAWN_SCRIPT = """\
import os, sys, time
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, {examples!r})
from train_mlp import build_model, make_data
from train_ddp import leave


def rank_main(rank, port, hold):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_data(0)
    for step in range(3):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rank::2][step * 16:(step + 1) * 16]), y[rank::2][step * 16:(step + 1) * 16]).backward()
        optimizer.step()
    sys.stdout.write(f"rank {{rank}} trained\\n")
    sys.stdout.flush()
    deadline = time.monotonic() + 120
    while not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    leave(0)


if __name__ == "__main__":
    assert not any(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    torch.multiprocessing.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
"""


def test_spawned_ranks_are_labelled_and_served_by_their_rank(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    script, hold = tmp_path / "spawned.py", tmp_path / "hold"
    script.write_text(SPAWN_SCRIPT.format(examples=str(REPO / "examples")))
    policy = str(write_policy(tmp_path, RULES))
    metrics = free_port
    with socket.socket() as s:  # the process group's port: any free one but the two metrics ports
        s.bind(("127.0.0.1", 0))
        group_port = s.getsockname()[1]
    run = apply(policy, "--metrics-port", str(metrics), "--", sys.executable, str(script), str(group_port), str(hold))
    served = [wait_metrics(run, metrics + r, lambda s: value(s, "hookpolicy_steps_total", model="Sequential") == 3)
              for r in (0, 1)]
    hold.touch()
    assert run.wait(120) == 0, run.stderr
    for r, samples in enumerate(served):
        assert {lab["rank"] for _, lab, _ in samples if "rank" in lab} == {str(r)}
        # the gradients after DDP's all-reduce are the job's: exported by rank 0 alone
        assert (value(samples, "hookpolicy_grad_l2_norm", rule="norms", module="0", rank=str(r)) is not None) == (r == 0)
    assert "governing Sequential (rank 0, " in run.stderr and "governing Sequential (rank 1, " in run.stderr


def test_sigterm_ends_ranks_waiting_in_a_collective_without_the_launchers_grace_period(
    apply: Callable[..., Run], tmp_path: Path,
) -> None:
    """torchrun's grace period is 30 s; a job whose ranks wait in a collective ends well within it.

    Without hookpolicy the ranks die of SIGTERM at once; under `apply` each rank's handler
    cannot run inside the collective, so torchrun had to SIGKILL them after 30 s.
    """
    policy = str(write_policy(tmp_path, RULES))
    run = apply(policy, "--", *torchrun(), "--standalone", "--nproc_per_node", "2", SCRIPT, "--wrap", "ddp",
                "--steps", "2", "--stall")
    deadline = time.monotonic() + 120
    while run.stdout.count(" stalled") < 2:
        assert run.proc.poll() is None, run.stderr
        assert time.monotonic() < deadline, run.stderr
        time.sleep(0.1)
    time.sleep(0.5)  # both ranks inside recv
    run.proc.send_signal(signal.SIGTERM)
    status = run.wait(25)  # < torchrun's 30 s grace: the test fails if the ranks had to be killed
    assert "forcefully exiting via" not in run.stderr, run.stderr
    assert status != 0
    assert run.stderr.count("SIGTERM while the main thread waits outside Python") == 2, run.stderr


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the exporter binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ranks_release_their_metrics_ports_when_the_launcher_is_killed(
    apply: Callable[..., Run], tmp_path: Path, free_port: int,
) -> None:
    hold = tmp_path / "hold"
    policy = str(write_policy(tmp_path, RULES))
    run = apply(policy, "--metrics-port", str(free_port), "--", *torchrun(), "--standalone", "--nproc_per_node", "2",
                SCRIPT, "--wrap", "ddp", "--steps", "2", "--hold-file", str(hold))
    for r in (0, 1):
        wait_metrics(run, free_port + r, lambda s: value(s, "hookpolicy_steps_total") == 2, 120)
    (agent,) = _children(run.proc.pid)
    ranks = _children(agent)
    try:
        os.kill(agent, signal.SIGKILL)
        run.wait(30)
        deadline = time.monotonic() + 30
        while not all(_bindable(free_port + r) for r in (0, 1)):
            assert time.monotonic() < deadline, f"the orphaned ranks keep their ports\n{run.stderr}"
            time.sleep(0.2)
        assert all(Path(f"/proc/{pid}").exists() for pid in ranks)  # the ranks live on; their ports are free
        assert scrape(free_port) is None
        assert run.stderr.count(f"(pid {agent}) is gone: rank ") == 2, run.stderr
    finally:
        hold.touch()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
