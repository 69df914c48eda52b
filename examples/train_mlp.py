"""Train a small MLP on a synthetic regression task: a real training script with no hookpolicy in it.

    python examples/train_mlp.py --steps 200
    hookpolicy apply policies/example-monitor.yaml --metrics-port 9400 -- python examples/train_mlp.py --steps 200

Prints one line per optimizer step, `step N loss L` (L in full precision), so runs with
and without hookpolicy can be compared line by line. Runs in a few seconds on a CPU.
The options beyond the usual ones exist to exercise hookpolicy's `apply` end to end:
gradient accumulation, CPU autocast, hand-written SGD, a NaN injected at a given step,
files that pause or stop the run, and `--save PATH`, which keeps the best model by
validation loss with `torch.save(model, f)`, as pytorch/examples' word_language_model does.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional, Sequence

import torch
from torch import nn


def build_model(width: int = 64) -> nn.Module:
    """The model: 8 features in, one value out."""
    return nn.Sequential(
        nn.Linear(8, width), nn.ReLU(inplace=True),
        nn.Linear(width, width), nn.GELU(),
        nn.Linear(width, 1),
    )


def make_data(seed: int, n: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--amp", action="store_true", help="CPU autocast with bfloat16")
    p.add_argument("--manual-sgd", action="store_true", help="update the parameters by hand, no torch.optim")
    p.add_argument("--nan-at", type=int, default=None, metavar="STEP", help="make the loss NaN at this step")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step")
    p.add_argument("--stop-file", default=None, help="stop early once this file exists")
    p.add_argument("--hold-file", default=None, help="after training, wait (up to 120 s) until this file exists")
    p.add_argument("--save", default=None, metavar="PATH", help="torch.save the whole model here at each best validation loss")
    p.add_argument("--eval-every", type=int, default=10, metavar="N", help="steps between validations (with --save)")
    return p.parse_args(argv)


def save_if_best(model: nn.Module, val: tuple[torch.Tensor, torch.Tensor], path: str, best: float, step: int) -> float:
    """Evaluate on the validation set; save the whole model when its loss is the best so far."""
    model.eval()
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(val[0]), val[1]).item()
    model.train()
    print(f"step {step} validation loss {loss!r}", flush=True)
    if loss < best:
        with open(path, "wb") as f:
            torch.save(model, f)
        return loss
    return best


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse(argv)
    torch.manual_seed(args.seed)
    model = build_model(args.width)
    x, y = make_data(args.seed)
    optimizer: Optional[torch.optim.Optimizer] = None
    if not args.manual_sgd:
        if args.optimizer == "adam":
            optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()
    batches = x.shape[0] // args.batch
    val = make_data(args.seed + 1000, n=256)
    best = float("inf")
    for step in range(args.steps):
        if args.stop_file and os.path.exists(args.stop_file):
            break
        total = 0.0
        for micro in range(args.accum):
            i = (step * args.accum + micro) % batches
            xb, yb = x[i * args.batch:(i + 1) * args.batch], y[i * args.batch:(i + 1) * args.batch]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                out = model(xb)
            loss = loss_fn(out.float(), yb) / args.accum
            if args.nan_at == step:
                loss = loss * float("nan")
            loss.backward()
            total += loss.item()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= args.lr * p.grad
                        p.grad = None
        print(f"step {step} loss {total!r}", flush=True)
        if args.save and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            best = save_if_best(model, val, args.save, best, step)
        if args.sleep:
            time.sleep(args.sleep)
    if args.hold_file:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
