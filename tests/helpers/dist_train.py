"""The distributed tests' training script: the MLP of examples/train_mlp.py under DDP or FSDP2, on gloo.

    torchrun --standalone --nproc_per_node 2 tests/helpers/dist_train.py --wrap fsdp --steps 4

No hookpolicy in it: the tests run it under `hookpolicy apply`. Each rank prints one line
per step, written once (the ranks share stdout):

    rank R step N loss L params P norm G [clipdiff D]

- `params`: a digest of this rank's parameters (its FSDP2 shards) after the step, so a
  skipped step shows as the same digest twice in a row;
- `norm`: the norm of the gradients the optimizer used, read by an optimizer step
  pre-hook registered here, which runs after hookpolicy's global one; `none` when the
  optimizer saw no gradients (a skipped step);
- `clipdiff` (with `--clip-ref MAX`): the largest difference between those gradients and
  `torch.nn.utils.clip_grad_norm_(..., MAX)` applied to a copy of the gradients taken
  before `optimizer.step()`.

`--nan-at S --nan-rank R --nan-in grad|input|loss` puts a NaN on rank R only at step S:
in its first gradient (its own shard, after the backward pass), in its batch (so its
activations are NaN), or in its loss. `--stall` makes each rank, after training, print
`rank R stalled` and wait in a collective its peer never joins (a `recv` from it), as
ranks do when the job is stopped in the middle of one. Each rank ends with `rank R exit NAME` (`ok`, or the
exception it raised), and after `ok` with `examples/train_ddp.py`'s `leave()`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from train_ddp import leave  # noqa: E402
from train_mlp import build_model, make_data  # noqa: E402


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def wrap(model: nn.Module, how: str) -> nn.Module:
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def say(rank: int, text: str) -> None:
    sys.stdout.write(f"rank {rank} {text}\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrap", choices=["ddp", "fsdp"], default="fsdp")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--nan-at", type=int, default=None)
    p.add_argument("--nan-rank", type=int, default=0)
    p.add_argument("--nan-in", choices=["grad", "input", "loss"], default="grad")
    p.add_argument("--clip-ref", type=float, default=None)
    p.add_argument("--hold-file", default=None)
    p.add_argument("--stall", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        train(args, rank, world)
    except BaseException as exc:
        say(rank, f"exit {type(exc).__name__}")
        raise
    if args.stall:
        say(rank, "stalled")
        dist.recv(torch.zeros(1), src=1 - rank)  # the peer sends nothing: only a signal ends this
    say(rank, "exit ok")
    if args.hold_file:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    leave(0)  # not through interpreter finalization: see train_ddp.leave


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = wrap(build_model(), args.wrap)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    used: dict[str, Any] = {}
    reference: list[Optional[torch.Tensor]] = []

    def read_gradients(opt: torch.optim.Optimizer, a: Any, k: Any) -> None:
        grads = [q.grad for q in params if q.grad is not None]
        used["norm"] = float(full(torch.nn.utils.get_total_norm(grads)).item()) if grads else None
        if grads and reference:
            used["clipdiff"] = max(float((full(q.grad) - full(r)).abs().max().item())
                                   for q, r in zip(params, reference) if q.grad is not None and r is not None)

    optimizer.register_step_pre_hook(read_gradients)
    x, y = make_data(0)
    x, y = x[rank::world], y[rank::world]
    for step in range(args.steps):
        nan_here = args.nan_at == step and args.nan_rank == rank
        i = step % (len(x) // 32) * 32  # the data again from the start after 16 steps
        xb, yb = x[i:i + 32], y[i:i + 32]
        if nan_here and args.nan_in == "input":
            xb = xb * float("nan")
        loss = nn.functional.mse_loss(model(xb), yb)
        if nan_here and args.nan_in == "loss":
            loss = loss * float("nan")
        optimizer.zero_grad()
        loss.backward()
        if nan_here and args.nan_in == "grad":
            grad = params[0].grad
            assert grad is not None
            local(grad).view(-1)[0] = float("nan")
        if args.clip_ref is not None:
            reference[:] = [q.detach().clone() for q in params]
            for r, q in zip(reference, params):
                r.grad = None if q.grad is None else q.grad.clone()
            torch.nn.utils.clip_grad_norm_(reference, args.clip_ref)
            reference[:] = [r.grad for r in reference]
        used.clear()
        optimizer.step()
        digest = hashlib.sha1(b"".join(local(q).detach().numpy().tobytes() for q in params)).hexdigest()[:16]
        line = f"step {step} loss {loss.item()!r} params {digest} norm {used.get('norm')!r}"
        if "clipdiff" in used:
            line += f" clipdiff {used['clipdiff']!r}"
        say(rank, line)
        if args.sleep:
            time.sleep(args.sleep)


if __name__ == "__main__":
    main()
