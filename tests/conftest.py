"""The tests' fixtures and pytest hooks: free ports, the output folder, one intra-op
thread, `hookpolicy apply` run for real, child processes stopped at a test's end, the soak test deselected unless asked for, and
the autouse check that every test leaves the process as it found it.

Shared helpers are in tests/helpers/, imported by name (`from helpers.models import tiny`).
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch

from hookpolicy.engine.hooks import contain
from helpers import REPO
from helpers.hooks import process_wide_state
from helpers.processes import Proc, Run, child_env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The 10,000-step soak test runs only when a `-m` expression names `soak`.

    Not pyproject's `addopts = -m 'not soak'`: a `-m` on the command line (the README's
    `-m 'not slow'`) replaces that one, and the soak test would run in the quick loop.
    """
    if "soak" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("soak") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("soak")])
        items[:] = kept


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def free_port() -> int:
    """A free TCP port whose successor is free too (for rank 1).

    Drawn below Linux's ephemeral range (32768-60999), where the OS hands out ports to
    `bind(0)`, gloo and torchrun's rendezvous, so none of them takes it meanwhile.
    """
    for _ in range(200):
        port = random.randrange(20000, 32700)
        if _bindable(port) and _bindable(port + 1):
            return port
    raise RuntimeError("no free pair of ports")


@pytest.fixture(autouse=True)
def _process_left_as_found() -> Iterator[None]:
    """Every test leaves the process as it found it, so no test depends on which ran before it.

    A test that detaches everything it attached passes this; one that leaves a hook, a
    subscriber or a thread behind fails here, not in whichever test happens to run next.
    """
    before, off = process_wide_state(), contain.switched_off()
    yield
    after = process_wide_state()
    assert after == before, f"process-wide state left behind: {before} -> {after}"
    # a process-wide part switched off by its faults stays off for the process, by design (`hooks.contain`):
    # a test that forces them gives the count back, or every later test would see the patch call through
    assert contain.switched_off() == off, f"process-wide parts left switched off: {off} -> {contain.switched_off()}"


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The output folder for logs and tensor files (HOOKPOLICY_OUTPUT_DIR)."""
    folder = tmp_path / "out"
    folder.mkdir()
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(folder))
    return folder


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Files a policy writes land in a fresh folder."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOOKPOLICY_OUTPUT_DIR", str(out))
    return out


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread, and a busy CI machine cannot slow them 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def apply(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def start(*args: str, env: Optional[dict[str, str]] = None, cwd: Path = REPO) -> Run:
        folder = tmp_path / f"run{len(runs)}"
        folder.mkdir()
        run = Run(folder, list(args), env or child_env(), cwd)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.stop()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Child processes a test starts (`Proc`, `start_apply`): SIGTERM then kill at its end."""
    started: list[Proc] = []
    yield started
    for proc in started:
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGTERM)
            try:
                proc.proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
