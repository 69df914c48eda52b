"""Guardrails on a real instability (issue 13): does a policy let a run survive a loss spike?

    python bench/instability.py                      # the runs and a table (about 2-4 minutes on 2 cores)
    python bench/instability.py --out docs/instability.md
    python bench/instability.py train [--corrupt]    # one run: the unmodified script the policies govern

The bundled tiny GPT (`examples.charlm.TinyGPT`) learns a seeded random bigram language
(a Markov chain over 24 symbols with peaked transition rows: a loss floor the model reaches in a few hundred steps,
so a missing step costs little and damage shows). A corrupted shard comes round once per
epoch of 100 steps: batches 80-87 of each epoch have scrambled targets (random labels),
which sends the loss from about 1.7 to about 10 and the gradient norm up 5-10x; AdamW's
second moments remember that for hundreds of steps.

Runs, all from the same seed and drawing the same batches:

- clean: no corruption, no policy;
- unguarded: the corrupted shard, no policy;
- guarded (`policies/loss-spike-guard.yaml`): the same corrupted script under
  `hookpolicy apply`, which skips the steps whose loss is a spike;
- zclip (`policies/zclip.yaml`): the same, under adaptive gradient clipping.

Each training step is reported by the script itself, not by hookpolicy: the loss, the
gradient norm before `optimizer.step()`, the gradient norm the update saw (from an
optimizer step pre-hook the script registers, which runs after hookpolicy's), and whether
the parameters changed. The final number is the loss on held-out text after the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.charlm import TinyGPT  # noqa: E402

SYMBOLS = 24
CONTEXT = 32
EPOCH = 100
#: batches of each epoch whose targets are scrambled with --corrupt
CORRUPT = range(80, 88)


def corpus(seed: int, length: int = 30_000) -> torch.Tensor:
    """A seeded random bigram chain: each symbol's successor drawn from a peaked random row."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.softmax(3.0 * torch.randn(SYMBOLS, SYMBOLS, generator=g), dim=1)
    out = torch.empty(length, dtype=torch.long)
    out[0] = 0
    draws = torch.rand(length, generator=g)
    cdf = rows.cumsum(dim=1)
    for i in range(1, length):
        out[i] = min(int(torch.searchsorted(cdf[out[i - 1]], draws[i])), SYMBOLS - 1)
    return out


def windows(data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([data[s:s + CONTEXT] for s in starts])
    y = torch.stack([data[s + 1:s + CONTEXT + 1] for s in starts])
    return x, y


def train(args: argparse.Namespace) -> None:
    """One run; a JSON line per step and a final one. No hookpolicy here."""
    data = corpus(args.seed)
    split = int(len(data) * 0.8)
    torch.manual_seed(args.seed)
    model = TinyGPT(SYMBOLS, context=CONTEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    batches = torch.Generator().manual_seed(args.seed + 1)
    scrambles = torch.Generator().manual_seed(args.seed + 2)
    seen: dict[str, float] = {}

    def update_norm(opt: torch.optim.Optimizer, *_: Any) -> None:
        # registered on this optimizer, so it runs after hookpolicy's global step pre-hook:
        # the gradient the update is about to use
        seen["update"] = total_norm(model)

    optimizer.register_step_pre_hook(update_norm)
    probe = model.lm_head.weight
    for step in range(args.steps):
        x, y = windows(data, torch.randint(0, split - CONTEXT - 1, (args.batch,), generator=batches))
        scrambled = torch.randint(0, SYMBOLS, y.shape, generator=scrambles)
        corrupt = args.corrupt and step % EPOCH in CORRUPT
        if corrupt:
            y = scrambled
        logits, _ = model(x)  # the script's own criterion computes the loss (a loss module)
        loss = criterion(logits.reshape(-1, SYMBOLS), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        before = total_norm(model)
        seen.pop("update", None)
        old = probe.detach().clone()
        optimizer.step()
        print(json.dumps({
            "step": step, "corrupt": corrupt, "loss": loss.item(), "grad_norm": before,
            "update_norm": seen.get("update"), "updated": not torch.equal(old, probe.detach()),
        }), flush=True)
    model.eval()
    with torch.no_grad():
        vx, vy = windows(data, torch.arange(split, len(data) - CONTEXT - 1, 97))
        val = criterion(model(vx)[0].reshape(-1, SYMBOLS), vy.reshape(-1)).item()
    print(json.dumps({"final": True, "val_loss": val}), flush=True)


def total_norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0


@dataclass
class Run:
    name: str
    policy: Optional[str]
    corrupt: bool
    steps: list[dict[str, Any]]
    val_loss: float
    seconds: float

    @property
    def skipped(self) -> int:
        return sum(1 for s in self.steps if not s["updated"])

    @property
    def clipped(self) -> int:
        """Steps whose update saw a smaller gradient than backward produced (beyond float noise)."""
        return sum(1 for s in self.steps if _clipped(s))

    @property
    def corrupt_steps(self) -> int:
        return sum(1 for s in self.steps if s["corrupt"])

    @property
    def caught(self) -> int:
        """Corrupted steps that were skipped or clipped."""
        return sum(1 for s in self.steps if s["corrupt"] and (not s["updated"] or _clipped(s)))


def _clipped(step: dict[str, Any]) -> bool:
    """An applied step whose update saw a smaller gradient norm than backward produced."""
    return bool(step["updated"] and step["update_norm"] is not None and step["update_norm"] < step["grad_norm"] * (1 - 1e-4))


def run(name: str, policy: Optional[str], corrupt: bool, steps: int, seed: int) -> Run:
    script = [sys.executable, str(Path(__file__).resolve()), "train", "--steps", str(steps), "--seed", str(seed)]
    if corrupt:
        script.append("--corrupt")
    command = script if policy is None else [sys.executable, "-m", "hookpolicy", "apply", str(ROOT / policy), "--", *script]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    final = next(r for r in records if r.get("final"))
    return Run(name, policy, corrupt, [r for r in records if "step" in r], final["val_loss"], seconds)


RUNS = (
    ("clean", None, False),
    ("unguarded", None, True),
    ("guarded: loss-spike-guard", "policies/loss-spike-guard.yaml", True),
    ("guarded: zclip", "policies/zclip.yaml", True),
)


def table(runs: list[Run]) -> str:
    clean = runs[0].val_loss
    lines = [
        "| run | final held-out loss | vs clean | corrupted steps | skipped | clipped | caught | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | {r.val_loss:.4f} | {100 * (r.val_loss / clean - 1):+.2f}% | {r.corrupt_steps} | "
            f"{r.skipped} | {r.clipped} | {r.caught}/{r.corrupt_steps} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="one run (the script the policies govern)")
    for q in (p, t):
        q.add_argument("--steps", type=int, default=300)
        q.add_argument("--seed", type=int, default=0)
    t.add_argument("--corrupt", action="store_true", help="scramble the targets of batches 80-87 of every 100")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="also write the table as markdown here")
    args = p.parse_args()
    if args.command == "train":
        train(args)
        return
    runs = []
    for name, policy, corrupt in RUNS:
        runs.append(run(name, policy, corrupt, args.steps, args.seed))
        print(f"{name}: held-out loss {runs[-1].val_loss:.4f} ({runs[-1].seconds:.0f} s)", file=sys.stderr, flush=True)
    text = table(runs)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
