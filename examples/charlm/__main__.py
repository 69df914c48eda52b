"""Train the tiny character-level GPT: `python -m examples.charlm --steps 100`.

Prints `step N loss L` per optimizer step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.nn import functional as F

from . import TEXT, build_model, vocabulary


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m examples.charlm", description="Train a tiny character-level GPT.")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step")
    p.add_argument("--hold-file", default=None, help="after training, wait (up to 120 s) until this file exists")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    stoi = {c: i for i, c in enumerate(vocabulary())}
    data = torch.tensor([stoi[c] for c in TEXT])
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch,))
        x = torch.stack([data[s:s + args.context] for s in starts])
        y = torch.stack([data[s + 1:s + args.context + 1] for s in starts])
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    if args.hold_file:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
