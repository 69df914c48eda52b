"""Train the MLP of train_mlp.py with DistributedDataParallel on gloo (CPU): no hookpolicy in it.

    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps 50
    hookpolicy apply policies/example-monitor.yaml --metrics-port 9400 -- \
        torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps 50

Each rank trains on its own slice of the data; DDP averages the gradients, so every
rank's gradients (and its step-time statistics) are equal after the all-reduce. Prints
`rank R step N loss L` per step.

Each rank ends with `leave()`: the exit handlers run, the interpreter is not finalized
(a gloo worker thread still freeing a collective then aborts the process under torch
2.13 on CPython < 3.14; see docs/compatibility.md, "A gloo rank that aborts at exit").
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from typing import NoReturn

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
    p.add_argument("--finalize", action="store_true",
                   help="exit through interpreter finalization, not leave() (to reproduce the gloo abort)")
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
    if not args.finalize:
        leave(0)


def leave(status: int) -> NoReturn:
    """End this process now: run the exit handlers, flush, and exit without finalizing the interpreter.

    With torch 2.13 on gloo, a worker thread of the process group may still be freeing a
    finished collective when the main thread returns: the work holds Python objects (its
    tensors, the context autograd stashes during backward, pytorch/pytorch#190489), the
    thread takes the GIL to release them, and once the interpreter is finalizing, CPython
    before 3.14 ends that thread inside a C++ destructor, which aborts the process
    ("terminate called without an active exception"). Not finalizing leaves no window for
    that; the exit handlers (logging's, `hookpolicy apply`'s flush) still run first.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
