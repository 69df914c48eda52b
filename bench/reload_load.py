"""What validating a 1 MB reload costs the training thread (issue 15, fault 3), a minute or so.

    python bench/reload_load.py
    python bench/reload_load.py --kb 256 --rounds 3

A training loop (an MLP, one torch thread) runs on the main thread and records each
step's duration; meanwhile the reload watcher's work runs on a background thread, as
under `hookpolicy apply --watch`: a policy file of `--kb` KiB of small rules (the
loader's worst case per byte) is loaded and validated, either in the training process
(`in-process`: what the watcher did before) or in a child process
(`apply/validate.load_elsewhere`: what it does now). Reported: steps/s without a reload,
steps/s while the reload runs, the longest step, and how long the validation took.
Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import torch

from hookpolicy.apply.validate import load_elsewhere
from hookpolicy.policy.sources import load_sources

RULE = textwrap.dedent("""\
    - name: r{i}
      match: {{modules: ["**"]}}
      trigger: {{at: step}}
      actions:
        - capture: {{stats: [l2_norm]}}
""")


def big_policy(path: Path, size: int) -> None:
    parts = ["apiVersion: hookpolicy/v1\nkind: HookPolicy\nmetadata: {name: big}\nspec:\n  rules:\n"]
    total, i = len(parts[0]), 0
    while total < size:
        part = textwrap.indent(RULE.format(i=i), "    ")
        parts.append(part)
        total += len(part)
        i += 1
    path.write_text("".join(parts))


def measure(how: str, path: Path, quiet_s: float = 2.0) -> dict[str, float]:
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 64)
    times: list[tuple[float, float]] = []
    done = threading.Event()
    took: list[float] = []

    def validate() -> None:
        start = time.perf_counter()
        (load_sources if how == "in-process" else load_elsewhere)([str(path)])
        took.append(time.perf_counter() - start)
        done.set()

    end_quiet = time.monotonic() + quiet_s
    started = False
    while not done.is_set():
        if not started and time.monotonic() > end_quiet:
            threading.Thread(target=validate, daemon=True).start()
            started = True
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append((time.monotonic(), time.perf_counter() - start))
    quiet = [dt for t, dt in times if t <= end_quiet]
    loaded = [dt for t, dt in times if t > end_quiet]
    during = end_quiet, times[-1][0]
    return {
        "steps_per_s_quiet": len(quiet) / quiet_s,
        "steps_per_s_during": len(loaded) / max(1e-9, during[1] - during[0]),
        "median_step_ms_during": 1000 * statistics.median(loaded) if loaded else float("nan"),
        "longest_step_ms": 1000 * max(loaded) if loaded else float("nan"),
        "validation_s": took[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kb", type=int, default=1000, help="size of the reloaded policy file, KiB")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "big.yaml")
        big_policy(path, args.kb * 1024)
        print(f"{path.stat().st_size} bytes of policy")
        for index in range(args.rounds):
            for how in ("in-process", "child-process"):
                result = measure(how, path)
                print(f"round {index + 1} {how:14s} " + " ".join(f"{k}={v:.3g}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
