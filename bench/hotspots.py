"""Where variant 3's time goes: torch.profiler op tables and, when installed, py-spy frames.

`op_profile` profiles a few steps of the floor and of variant 3 with `torch.profiler`
and returns, per operator, the self CPU time per step each spends and the difference.
`frame_profile` runs this file as a child under `py-spy record` (sampling the Python
stack, 250 Hz) and returns the share of the timed steps spent under each hookpolicy
function (inclusive: the torch ops a function launches count towards it).

    python bench/hotspots.py --child --workload gpt --variant hp --steps 40   # the py-spy child
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from models import WORKLOADS
from variants import build_variants

__all__ = ["OpRow", "op_profile", "frame_profile"]


@dataclass
class OpRow:
    name: str
    calls_base: float
    calls_hp: float
    ms_base: float
    ms_hp: float


def _ops(step: object, steps: int, cuda: bool) -> dict[str, tuple[float, float]]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()  # type: ignore[operator]
    return {e.key: (e.count / steps, e.self_cpu_time_total / steps / 1e3) for e in prof.key_averages()}


def op_profile(workload: str, steps: int, device: torch.device) -> tuple[list[OpRow], float, float]:
    """Per-op self CPU ms per step, floor vs variant 3, the largest differences first."""
    floor, hp = build_variants(WORKLOADS[workload], device, ["floor", "hp"])
    for _ in range(3):
        floor.step()
        hp.step()
    cuda = device.type == "cuda"
    base = _ops(floor.step, steps, cuda)
    with_hp = _ops(hp.step, steps, cuda)
    hp.close()
    rows = [
        OpRow(name, base.get(name, (0.0, 0.0))[0], with_hp.get(name, (0.0, 0.0))[0],
              base.get(name, (0.0, 0.0))[1], with_hp.get(name, (0.0, 0.0))[1])
        for name in set(base) | set(with_hp)
    ]
    rows.sort(key=lambda r: r.ms_hp - r.ms_base, reverse=True)
    return rows, sum(v[1] for v in base.values()), sum(v[1] for v in with_hp.values())


def frame_profile(workload: str, steps: int, threads: int) -> tuple[dict[str, float], int] | None:
    """Share of the timed steps' samples under each hookpolicy function; None without py-spy."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        cmd = [exe, "record", "-r", "250", "-f", "raw", "-o", str(raw), "--",
               sys.executable, __file__, "--child", "--workload", workload, "--steps", str(steps),
               "--threads", str(threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent)
        if done.returncode != 0 or not raw.exists():
            print(f"py-spy failed ({done.returncode}): {done.stderr.strip()[-300:]}", file=sys.stderr)
            return None
        return _aggregate(raw.read_text())


def _aggregate(text: str) -> tuple[dict[str, float], int]:
    """Inclusive sample share per hookpolicy function, over samples inside `_timed_steps`."""
    per: dict[str, int] = defaultdict(int)
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if "_timed_steps" not in stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        seen: set[str] = set()
        for frame in stack.split(";"):
            # a frame reads "function (path/file.py:line)"
            func, _, where = frame.partition(" (")
            file = where.rsplit(":", 1)[0]
            if "hookpolicy" + os.sep in file or "/hookpolicy/" in file:
                key = f"{Path(file).stem}.{func}"
                if key not in seen:
                    seen.add(key)
                    per[key] += count
        if seen:
            per["(any hookpolicy frame)"] += count
    return {k: v / total for k, v in per.items()} if total else {}, total


def _timed_steps(step: object, steps: int) -> None:
    for _ in range(steps):
        step()  # type: ignore[operator]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--variant", default="hp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    (v,) = build_variants(WORKLOADS[args.workload], torch.device("cpu"), [args.variant])
    for _ in range(3):
        v.step()
    _timed_steps(v.step, args.steps)
    v.close()


if __name__ == "__main__":
    main()
