"""`hookpolicy apply` run for real: the process, its environment, its metrics scraped
while the script runs, and how to start torchrun."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import REPO


Samples = list[tuple[str, dict[str, str], float]]


class Run:
    """One `python -m hookpolicy apply ...` process; its stdout and stderr go to files."""

    def __init__(self, folder: Path, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.out_path = folder / "apply.stdout"
        self.err_path = folder / "apply.stderr"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hookpolicy", "apply", *args],
                cwd=cwd, env=env, stdout=out, stderr=err,
            )

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"apply did not finish in {timeout} s; stderr:\n{self.stderr}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # forwarded to the COMMAND's process group
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HOOKPOLICY_POLICY_DIRS", None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def scrape(port: int) -> Optional[Samples]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: Samples, name: str, **labels: str) -> Optional[float]:
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
    assert len(found) <= 1, f"{name}{labels} is ambiguous: {found}"
    return found[0] if found else None


def labels_of(samples: Samples, name: str) -> list[dict[str, str]]:
    return [lab for n, lab, _ in samples if n == name]


def wait_metrics(run: Run, port: int, ready: Callable[[Samples], bool], timeout: float = 90) -> Samples:
    """Scrape until `ready` holds, while the script still runs."""
    deadline = time.monotonic() + timeout
    samples: Optional[Samples] = None
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            pytest.fail(f"apply exited ({run.proc.returncode}) before the metrics were ready; stderr:\n{run.stderr}")
        samples = scrape(port)
        if samples is not None and ready(samples):
            assert run.proc.poll() is None  # read while the training script runs
            return samples
        time.sleep(0.1)
    pytest.fail(f"metrics on port {port} never got ready; last scrape: {samples}\nstderr:\n{run.stderr}")


def steps_are(n: int, rank: str = "0") -> Callable[[Samples], bool]:
    return lambda samples: value(samples, "hookpolicy_steps_total", rank=rank) == n


def losses(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"(rank \d+ )?step \d+ loss ", line)]


def torchrun() -> list[str]:
    """How to start torchrun: beside this Python, on PATH, or as `python -m torch.distributed.run`."""
    beside = Path(sys.executable).with_name("torchrun")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


class Proc:
    """A child process whose stdout and stderr go to files (no pipe can fill up and block it)."""

    def __init__(self, folder: Path, argv: list[str], env: dict[str, str]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = folder / "stdout", folder / "stderr"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, ready: Callable[[], bool], timeout: float = 60, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"exited ({self.proc.returncode}) before {what}; stderr:\n{self.stderr}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; stderr:\n{self.stderr}")
            time.sleep(0.05)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"did not finish in {timeout} s; stderr:\n{self.stderr}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_apply(procs: list[Proc], folder: Path, args: list[str], **env: str) -> Proc:
    """`python -m hookpolicy apply ARGS` as a `Proc` (unbuffered), stopped by the `procs` fixture."""
    proc = Proc(folder, [sys.executable, "-m", "hookpolicy", "apply", *args], child_env(PYTHONUNBUFFERED="1", **env))
    procs.append(proc)
    return proc


def scrape_text(port: int, timeout: float = 5) -> str:
    """The exporter's answer on `port`, as text (fails on anything but a 200)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        assert response.status == 200
        return response.read().decode("utf-8")


#: `end_training`'s ends and the status `apply` exits with at each.
END_STATUS = {"exit": 0, "halt": 3, "sigterm": 143}


def end_training(procs: list[Proc], folder: Path, end: str, options: list[str]) -> Proc:
    """`apply OPTIONS` on examples/train_mlp.py, 12 steps with a NaN gradient at step 4, ended by `end`:
    `exit` (the NaN skips its step), `halt` (it halts at step 4) or `sigterm` (after the 12 steps, while the
    script waits). Run with HOOKPOLICY_RUN_ID=attempt-7; returns the ended process, its status checked."""
    from .policies import HALT_ON_NAN, policy_text

    policy = folder / "guard.yaml"
    policy.write_text(policy_text(HALT_ON_NAN if end == "halt" else HALT_ON_NAN.replace("halt", "skip_step"),
                                  name="guard"))
    script = [sys.executable, str(REPO / "examples" / "train_mlp.py"), "--steps", "12", "--nan-at", "4"]
    if end == "sigterm":
        script += ["--hold-file", str(folder / "hold")]  # waits after training until SIGTERM
    proc = start_apply(procs, folder / "apply", [str(policy), *options, "--", *script], HOOKPOLICY_RUN_ID="attempt-7")
    if end == "sigterm":
        proc.wait_for(lambda: "step 11 loss " in proc.stdout, 120, "the 12 steps")
        proc.proc.send_signal(signal.SIGTERM)
    status = proc.wait(120)
    assert status == END_STATUS[end], proc.stderr
    return proc
