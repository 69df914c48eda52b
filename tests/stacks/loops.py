"""Plain PyTorch training loops (no hookpolicy in them), one per `--case`, for tests/test_stacks.py.

    python loops.py --case closure-sgd|closure-adam|lbfgs|compile|grad-scaler|checkpoint|gan --nan-at 3

Each trains a small MLP for `--steps` optimizer steps with a NaN loss at step `--nan-at`
and writes the loop's own step count and the probe's measurements (probe.py). `gan`
trains two models (a generator and a discriminator, both `Sequential`), each with its
own optimizer and probe.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe import Probe, finish  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--nan-at", type=int, default=-1)
args = parser.parse_args()

torch.manual_seed(0)
x, y = torch.randn(32, 4), torch.randn(32, 1)


def mlp(width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


def poisoned(loss: torch.Tensor, step: int) -> torch.Tensor:
    return loss * float("nan") if step == args.nan_at else loss * 10


#: per step, the loss the script backpropagated (the first closure call's, for a closure)
losses: list[float] = []


def closure_loop(model: nn.Module, optimizer: torch.optim.Optimizer, forward: Callable[[], torch.Tensor]) -> int:
    for step in range(args.steps):
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = poisoned((forward() - y).pow(2).mean(), step)
            loss.backward()
            if len(losses) == step:
                losses.append(float(loss.detach()))
            return loss
        optimizer.step(closure)
    return args.steps


def plain_loop(model: nn.Module, optimizer: torch.optim.Optimizer, forward: Callable[[], torch.Tensor],
               scaler: Any = None) -> int:
    for step in range(args.steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
            loss = poisoned((forward().float() - y).pow(2).mean(), step)
        losses.append(float(loss.detach()))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return args.steps


model = mlp()
facts: dict[str, Any] = {}
if args.case == "gan":
    generator, discriminator = mlp(), nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    g_opt = torch.optim.SGD(generator.parameters(), lr=0.05)
    d_opt = torch.optim.SGD(discriminator.parameters(), lr=0.05)
    probes = {"generator": Probe(g_opt), "discriminator": Probe(d_opt)}
    for step in range(args.steps):
        d_opt.zero_grad()
        fake = generator(x).detach()
        d_loss = (discriminator(fake) - discriminator(y)).pow(2).mean() * 10
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad()
        g_loss = poisoned(discriminator(generator(x)).pow(2).mean() * 100, step)
        g_loss.backward()
        g_opt.step()
    finish(probes, framework_steps=args.steps)
    raise SystemExit(0)

if args.case == "closure-sgd":
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = Probe(optimizer)
    steps = closure_loop(model, optimizer, lambda: model(x))
elif args.case == "closure-adam":
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    probe = Probe(optimizer)
    steps = closure_loop(model, optimizer, lambda: model(x))
elif args.case == "lbfgs":
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.05, max_iter=1)
    probe = Probe(optimizer)
    steps = closure_loop(model, optimizer, lambda: model(x))
elif args.case == "lbfgs-iterations":
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.05, max_iter=4)
    probe = Probe(optimizer)
    steps = closure_loop(model, optimizer, lambda: model(x))
elif args.case == "compile":
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = Probe(optimizer)
    steps = plain_loop(compiled, optimizer, lambda: compiled(x))
elif args.case == "grad-scaler":
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = Probe(optimizer)
    steps = plain_loop(model, optimizer, lambda: model(x), scaler=torch.amp.GradScaler("cpu"))
    facts["scaler_steps"] = len(probe.norms)
elif args.case == "checkpoint":
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = Probe(optimizer)
    steps = plain_loop(model, optimizer, lambda: checkpoint(model, x, use_reentrant=False))
else:
    raise SystemExit(f"unknown case {args.case}")
finish({"optimizer": probe}, framework_steps=steps, losses=losses,
       finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()), **facts)
