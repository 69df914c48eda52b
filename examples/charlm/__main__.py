"""Train the tiny character-level GPT: `python -m examples.charlm --steps 100`.

Prints `step N loss L` per optimizer step. `--save PATH` keeps the best model by
validation loss with `torch.save(model, f)`, as pytorch/examples' word_language_model does.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from . import batch, build_model, encode


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m examples.charlm", description="Train a tiny character-level GPT.")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step")
    p.add_argument("--hold-file", default=None, help="after training, wait (up to 120 s) until this file exists")
    p.add_argument("--save", default=None, metavar="PATH", help="torch.save the whole model here at each best validation loss")
    p.add_argument("--eval-every", type=int, default=10, metavar="N", help="steps between validations (with --save)")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    data = encode()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    val_x, val_y = batch(data, torch.arange(0, len(data) - args.context - 1, args.context), args.context)
    best = float("inf")
    for step in range(args.steps):
        x, y = batch(data, torch.randint(0, len(data) - args.context - 1, (args.batch,)), args.context)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        if args.save and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            model.eval()
            with torch.no_grad():
                val = model(val_x, val_y)[1].item()
            model.train()
            print(f"step {step} validation loss {val!r}", flush=True)
            if val < best:
                best = val
                with open(args.save, "wb") as f:
                    torch.save(model, f)
        if args.sleep:
            time.sleep(args.sleep)
    if args.hold_file:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)



if __name__ == "__main__":
    main()
