"""SIGTERM under `apply` leaves what it leaves without hookpolicy, where unwinding would not.

Under `apply`, SIGTERM unwinds the script (so hooks come off and logs flush). Raised in
the middle of `torch.save`, that unwinding let the zip writer finish the archive: a
checkpoint that is a valid zip but does not load, which resume logic trusting "a valid
zip" picks. With DataLoader workers (which get the same SIGTERM), it printed PyTorch's
"worker is killed by signal" traceback from `DataLoader.__del__`. The reference is the
same script run without hookpolicy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from helpers.policies import write_policy
from helpers.processes import child_env

SCRIPT = """\
import os, signal, sys
import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


class Checkpoint:
    # A file whose 3rd write brings SIGTERM, as a launcher's stop lands mid-save.
    def __init__(self, path):
        self.file, self.writes = open(path, "wb"), 0

    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.file.write(data)

    def flush(self):
        self.file.flush()


out = Checkpoint(sys.argv[1])
torch.save({"model": model.state_dict(), "big": torch.zeros(1 << 16)}, out)
out.file.close()
print("saved")
"""


def _run(argv: list[str], tmp_path: Path) -> tuple[int, bytes]:
    checkpoint = tmp_path / "ckpt.pt"
    checkpoint.unlink(missing_ok=True)
    proc = subprocess.run(argv + [str(checkpoint)], env=child_env(HOOKPOLICY_OUTPUT_DIR=str(tmp_path)),
                          capture_output=True, timeout=120)
    return proc.returncode, checkpoint.read_bytes()


@pytest.mark.slow
def test_sigterm_mid_save_leaves_no_valid_zip_as_without_hookpolicy(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    policy = write_policy(tmp_path, """
        - name: grads
          match: {types: [Linear]}
          trigger: {at: step}
          target: grad
          actions:
            - capture: {stats: [l2_norm]}
    """)
    plain_status, plain = _run([sys.executable, str(script)], tmp_path)
    assert plain_status == -15  # killed by SIGTERM, mid-save
    applied_status, applied = _run(
        [sys.executable, "-m", "hookpolicy", "apply", str(policy), "--", sys.executable, str(script)], tmp_path)
    assert applied_status == 128 + 15
    for written in (plain, applied):
        with open(tmp_path / "check.pt", "wb") as f:
            f.write(written)
        assert not zipfile.is_zipfile(tmp_path / "check.pt")


LOADER = """\
import sys, time
import torch
from torch import nn

class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 10 ** 6
    def __getitem__(self, i):
        return torch.randn(4)

if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(Samples(), batch_size=4, num_workers=2, multiprocessing_context=sys.argv[2])
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, x in enumerate(loader):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 20:
            open(sys.argv[1], "w").close()
        time.sleep(0.01)
"""


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_sigterm_with_dataloader_workers_prints_no_traceback(tmp_path: Path, context: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(LOADER)
    ready = tmp_path / "ready"
    policy = write_policy(tmp_path, """
        - name: grads
          match: {types: [Linear]}
          trigger: {at: step}
          target: grad
          actions:
            - capture: {stats: [l2_norm]}
    """)
    argv = [sys.executable, "-m", "hookpolicy", "apply", str(policy), "--", sys.executable, str(script)]
    proc = subprocess.Popen(argv + [str(ready), context], env=child_env(HOOKPOLICY_OUTPUT_DIR=str(tmp_path)),
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert ready.exists(), proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)  # as a launcher stops a job
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + 15
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
