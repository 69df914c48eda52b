"""What a rule asleep costs (issue 37.2): the same training loop, CPU time per step, three ways.

    python bench/wake.py [--steps 300] [--rounds 3]

The bench's tiny GPT (`instability.py`'s model and corpus, AdamW) under: no policy;
loss-spike-guard alone; loss-spike-guard with debug-after-spike (its two rules asleep: no
spike in the run, so no alert wakes them); and, for scale, with debug-after-spike's rules
awake at every step (the same rules without `after`). CPU time (`time.thread_time`, one
torch thread) so that a busy machine's preemption does not count; the variants run in turns,
`--rounds` times each, and the median per step is printed with the machine's load. Also
counted: the module hooks torch holds on the model's modules at the last step (asleep:
the guard's root hooks only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import hookpolicy  # noqa: E402
from instability import CONTEXT, SYMBOLS, TinyGPT, batch, corpus  # noqa: E402

POLICIES = ROOT / "policies"


def awake_copy(folder: Path) -> Path:
    """debug-after-spike.yaml without its `after`: the same rules, awake at every step."""
    text = (POLICIES / "debug-after-spike.yaml").read_text()
    path = folder / "debug-awake.yaml"
    path.write_text(text.replace("        after: {alert: loss-spike-guard/loss-spike, steps: 50}\n", ""))
    return path


def run(files: list[Path], steps: int) -> tuple[float, int]:
    """CPU seconds per step of `steps` steps under `files` (none: no policy), and the hooks on the model at the end."""
    data = corpus(0)
    torch.manual_seed(0)
    model = TinyGPT(SYMBOLS, context=CONTEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    batches = [batch(data, torch.randint(0, len(data) - CONTEXT - 1, (16,), generator=g), CONTEXT)
               for _ in range(steps)]
    criterion = torch.nn.CrossEntropyLoss()
    attached = hookpolicy.load([str(f) for f in files]).attach(model, registry=CollectorRegistry(), rank=0) \
        if files else None
    try:
        start = time.thread_time()
        for x, y in batches:
            logits, _ = model(x)
            criterion(logits.reshape(-1, SYMBOLS), y.reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        spent = time.thread_time() - start
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    finally:
        if attached is not None:
            attached.remove()
    return spent / steps, hooks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        os.environ["HOOKPOLICY_OUTPUT_DIR"] = folder
        guard = POLICIES / "loss-spike-guard.yaml"
        variants = {
            "no policy": [],
            "loss-spike-guard": [guard],
            "+ debug-after-spike asleep": [guard, POLICIES / "debug-after-spike.yaml"],
            "+ the same rules awake": [guard, awake_copy(Path(folder))],
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        hooks: dict[str, int] = {}
        load = os.getloadavg()[0]
        for _ in range(args.rounds):
            for name, files in variants.items():
                spent, hooks[name] = run(files, args.steps)
                seconds[name].append(spent)
    base = statistics.median(seconds["loss-spike-guard"])
    print(f"CPU ms per step, median of {args.rounds} rounds of {args.steps} steps (load {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after)")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"  {name:28s} {1e3 * median:7.3f} ms  x{median / base:.3f} of the guard alone  "
              f"(rounds {', '.join(f'{1e3 * v:.3f}' for v in values)}; module hooks at the end: {hooks[name]})")


if __name__ == "__main__":
    main()
