"""hookpolicy's own lines reach stderr whole: one write per line, so processes sharing a pipe never split one."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from hookpolicy.say import say

from helpers import REPO
from helpers.processes import child_env


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_a_line_is_one_write_with_its_line_break(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    say("reloaded policies at step 14 of Sequential (rank 0): p@5bc4fce37a41")
    assert stream.writes == ["hookpolicy: reloaded policies at step 14 of Sequential (rank 0): p@5bc4fce37a41\n"]


def test_every_line_of_a_block_is_prefixed_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    say("reload failed; keeping the current policies:\np.yaml:3:1: $.spec: missing rules\nhookpolicy: said twice")
    assert stream.writes == ["hookpolicy: reload failed; keeping the current policies:\n"
                             "hookpolicy: p.yaml:3:1: $.spec: missing rules\nhookpolicy: said twice\n"]


HALT = """\
apiVersion: hookpolicy/v1
kind: HookPolicy
metadata: {name: halter}
spec:
  rules:
    - name: nan-halt
      match: {modules: ["**"]}
      trigger: {at: step}
      target: grad
      actions:
        - capture: {stats: [nonfinite]}
        - alert: {if: "nonfinite > 0", severity: critical, then: halt}
"""


@pytest.mark.slow
def test_every_line_apply_writes_on_stderr_starts_with_the_prefix(tmp_path: Path) -> None:
    """Real runs of `hookpolicy apply` whose script writes nothing on stderr: the bundled example
    (alerts, the summary, a report), a halt, SIGTERM, an invalid policy; every stderr line is hookpolicy's."""
    (tmp_path / "halt.yaml").write_text(HALT)
    (tmp_path / "bad.yaml").write_text(HALT.replace("at: step", "at: later"))
    train = [sys.executable, str(REPO / "examples" / "train_mlp.py"), "--steps", "12"]
    runs = {
        "example": ([str(REPO / "policies" / "example-monitor.yaml"), str(REPO / "policies" / "observe.yaml"),
                     "--report", "r.html", "--", *train, "--nan-at", "3"], 0),
        "halt": (["halt.yaml", "--", *train, "--nan-at", "5"], 3),
        "sigterm": (["halt.yaml", "--", sys.executable, "-c",
                     "import os, signal, torch; m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), 0.1)\n"
                     "for s in range(5):\n m(torch.ones(1, 2)).sum().backward(); o.step()\n"
                     "os.kill(os.getpid(), signal.SIGTERM)"], 143),
        "invalid": (["bad.yaml", "--", *train], 1),
    }
    env = child_env(PYTHONPATH=str(REPO))
    for name, (args, status) in runs.items():
        done = subprocess.run([sys.executable, "-m", "hookpolicy", "apply", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == status, f"{name}:\n{done.stderr[-3000:]}"
        lines = done.stderr.splitlines()
        assert len(lines) >= 2 and all(line.startswith("hookpolicy: ") for line in lines), f"{name}:\n{done.stderr}"
        said = {"example": "hookpolicy: CRITICAL example-monitor/", "halt": "hookpolicy: halted by halter/nan-halt",
                "sigterm": "hookpolicy: run summary (rank 0): Linear 5 steps", "invalid": "hookpolicy: bad.yaml:8:21: $.spec.rules[0].trigger.at:"}[name]
        assert any(line.startswith(said) or said in line for line in lines), f"{name}:\n{done.stderr}"
