"""Train the MLP of train_mlp.py with DistributedDataParallel on gloo (CPU): no hookpolicy in it.

    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps 50
    hookpolicy apply policies/example-monitor.yaml --metrics-port 9400 -- \
        torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps 50

Each rank trains on its own slice of the data; DDP averages the gradients, so every
rank's gradients (and its step-time statistics) are equal after the all-reduce. Prints
`rank R step N loss L` per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_mlp import build_model, make_data  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--nan-at", type=int, default=None, metavar="STEP", help="make rank 0's loss NaN at this step")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step")
    p.add_argument("--hold-file", default=None, help="after training, wait (up to 120 s) until this file exists")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    x, y = make_data(args.seed)
    x, y = x[rank::world], y[rank::world]
    batches = x.shape[0] // args.batch
    loss_fn = nn.MSELoss()
    for step in range(args.steps):
        i = step % batches
        loss = loss_fn(model(x[i * args.batch:(i + 1) * args.batch]), y[i * args.batch:(i + 1) * args.batch])
        if args.nan_at == step and rank == 0:
            loss = loss * float("nan")  # the all-reduce spreads it to every rank's gradients
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # One write per line: the ranks share stdout, and print() writes the newline
        # separately when Python runs unbuffered (PYTHONUNBUFFERED), so lines would interleave.
        sys.stdout.write(f"rank {rank} step {step} loss {loss.item()!r}\n")
        sys.stdout.flush()
        if args.sleep:
            time.sleep(args.sleep)
    if args.hold_file:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
