"""The files hookpolicy writes: a log rotates before it passes max_bytes and keeps the newest,
writers sharing a log follow each other's rotations, a symlink put in place of a log or its
folder is not written through, and a run killed mid-write leaves no partial tensor file. The
guarantees are in docs/reliability.md.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.outputs import json_lines
from helpers.policies import policy_text
from helpers.processes import Proc, child_env
from hookpolicy.export import sinks
from hookpolicy.policy.model import LogSink


# =========================================================================== logs: rotation and symlinks


def rotating(root: Path, max_bytes: int, keep: int) -> "sinks.JsonLines":
    return sinks.JsonLines(root, LogSink(path="logs/x.jsonl", max_bytes=max_bytes, keep=keep))


def record(step: int) -> dict[str, Any]:
    return {"step": step, "stats": {"l2_norm": 1.0}}  # 40 bytes a line


def test_a_log_rotates_before_it_would_pass_max_bytes_and_keeps_the_newest(tmp_path: Path) -> None:
    log = rotating(tmp_path, max_bytes=100, keep=2)
    for step in range(20):
        log.write([record(step)])
    log.close()
    names = ["x.jsonl.2", "x.jsonl.1", "x.jsonl"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted(names)
    files = [tmp_path / "logs" / name for name in names]
    assert [f.stat().st_size for f in files] == [80, 80, 80]  # two 40-byte lines; a third would pass 100
    assert [r["step"] for f in files for r in json_lines(f)] == list(range(14, 20))


def test_keep_zero_starts_the_log_over(tmp_path: Path) -> None:
    log = rotating(tmp_path, max_bytes=100, keep=0)
    for step in range(5):
        log.write([record(step)])
    log.close()
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["x.jsonl"]
    assert [r["step"] for r in json_lines(tmp_path / "logs" / "x.jsonl")] == [4]


def test_a_record_larger_than_max_bytes_is_written_whole_in_a_file_of_its_own(tmp_path: Path) -> None:
    log = rotating(tmp_path, max_bytes=10, keep=1)
    log.write([record(0)])
    log.write([record(1)])
    log.close()
    assert [r["step"] for r in json_lines(tmp_path / "logs" / "x.jsonl.1")] == [0]
    assert [r["step"] for r in json_lines(tmp_path / "logs" / "x.jsonl")] == [1]


def test_writers_sharing_a_log_follow_each_others_rotations(tmp_path: Path) -> None:
    """Like two ranks (or two rules) appending to one path: the bound holds, nothing is written to a rotated file."""
    first, second = rotating(tmp_path, max_bytes=200, keep=1), rotating(tmp_path, max_bytes=200, keep=1)
    for step in range(0, 40, 2):
        first.write([record(step)])
        second.write([record(step + 1)])
    first.close()
    second.close()
    files = [tmp_path / "logs" / name for name in ("x.jsonl.1", "x.jsonl")]
    assert all(f.stat().st_size <= 200 for f in files)
    assert [r["step"] for f in files for r in json_lines(f)] == list(range(30, 40))


def test_a_symlink_put_in_place_of_an_open_log_is_not_written_through(tmp_path: Path) -> None:
    log = rotating(tmp_path, max_bytes=1000, keep=1)
    log.write([record(0)])
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "logs" / "x.jsonl").unlink()
    (tmp_path / "logs" / "x.jsonl").symlink_to(victim)
    with pytest.raises(sinks.SinkError, match="symbolic link"):
        log.write([record(1)])
    log.close()
    assert victim.read_text() == "precious\n"


def test_a_log_folder_turned_into_a_symlink_is_not_followed_when_the_log_rotates(tmp_path: Path) -> None:
    root, outside = tmp_path / "out", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    log = rotating(root, max_bytes=50, keep=1)
    log.write([record(0)])
    (root / "logs").rename(root / "moved")
    (root / "logs").symlink_to(outside, target_is_directory=True)
    (outside / "x.jsonl").write_text("precious\n" * 10)  # full: it would be rotated, outside
    with pytest.raises(sinks.SinkError, match="outside the output folder"):
        log.write([record(1)])  # the file at the path is another: it would be opened anew, through the link
    log.close()
    assert [p.name for p in outside.iterdir()] == ["x.jsonl"]
    assert (outside / "x.jsonl").read_text() == "precious\n" * 10


# --------------------------------------------------------------------------- atomic writes

KILLED_SCRIPT = """\
import sys, torch, hookpolicy
torch.set_num_threads(1)
model = torch.nn.Linear(1024, 1024)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
with hookpolicy.load(sys.argv[1]).attach(model):
    step = 0
    while True:
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
        print(step, flush=True)
        step += 1
"""

DUMP_WEIGHTS = """\
- name: dump
  match: {root: true, params: [weight]}
  trigger: {at: step}
  target: weight
  actions:
    - capture: {stats: [l2_norm, mean], per: tensor, tensors: {dir: tensors, max_files: 100000},
                log: {path: dump.jsonl}}
"""


@pytest.mark.slow
def test_a_run_killed_mid_write_leaves_no_partial_tensor_file(tmp_path: Path, procs: list[Proc]) -> None:
    """SIGKILL a process that writes 4 MiB tensor files back to back; only complete files have final names."""
    policy = tmp_path / "dump.yaml"
    policy.write_text(policy_text(DUMP_WEIGHTS, name="dump"))
    script = tmp_path / "writer.py"
    script.write_text(KILLED_SCRIPT)
    leftovers = partial_lines = 0
    for attempt, delay in enumerate((0.0, 0.013)):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        proc = Proc(tmp_path / f"proc{attempt}", [sys.executable, str(script), str(policy)],
                    child_env(PYTHONUNBUFFERED="1", HOOKPOLICY_OUTPUT_DIR=str(out)))
        procs.append(proc)
        folder = out / "tensors"
        proc.wait_for(lambda: folder.is_dir() and len(list(folder.glob("step*.pt"))) >= 4, what="four tensor files")
        time.sleep(delay)
        proc.proc.send_signal(signal.SIGKILL)
        assert proc.proc.wait(10) == -signal.SIGKILL
        finals = sorted(folder.glob("step*.pt"))
        others = sorted(set(folder.iterdir()) - set(finals))
        assert len(finals) >= 4
        for file in finals:  # each one complete
            loaded = torch.load(file, weights_only=True)
            assert loaded.shape == (1024, 1024), file
        for file in others:  # at most a temporary file, never with a final name or a .pt suffix
            assert file.name.startswith(sinks.TEMP_PREFIX) and not file.name.endswith(".pt"), file
        assert sorted(folder.glob("*.pt")) == finals  # a `*.pt` glob finds complete files only
        leftovers += len(others)
        # the log: whole lines, each one written with a single flush
        text = (out / "dump.jsonl").read_text()
        complete = text[: text.rfind("\n") + 1]
        records = [json.loads(line) for line in complete.splitlines()]
        assert len(records) >= len(finals)
        partial_lines += text != complete
    print(f"\nkilled mid-run twice: {leftovers} temporary file(s) left behind, no partial .pt, "
          f"{partial_lines} log(s) ending in a partial line")
    assert partial_lines == 0
