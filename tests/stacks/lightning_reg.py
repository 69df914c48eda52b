"""A PyTorch Lightning regression script (no hookpolicy in it), for tests/test_stacks.py.

    python lightning_reg.py --steps 8 --accum 2 --clip-val 1.0 --nan-at 3 [--manual]

Automatic optimization by default (Lightning passes a closure to `optimizer.step`; while
accumulating it calls the closure itself, outside the step); `--manual` steps the
optimizer from `training_step`. `--nan-at N` makes the loss NaN at global_step N.
Writes Lightning's own global_step and the probe's measurements (probe.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe import Probe, finish  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--clip-val", type=float, default=None)
parser.add_argument("--nan-at", type=int, default=-1)
parser.add_argument("--manual", action="store_true")
parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
args = parser.parse_args()


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = not args.manual
        self.probe: Any = None
        self.losses: list[tuple[int, float]] = []  # (global_step, training_step's loss) per micro-batch

    def training_step(self, batch: Any, index: int) -> Any:
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean() * 10
        if self.global_step == args.nan_at:
            loss = loss * float("nan")
        self.log("train_loss", loss, on_step=True)
        self.losses.append((self.global_step, float(loss.detach())))
        if not args.manual:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if args.optimizer == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        self.probe = Probe(optimizer)
        return optimizer


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
model = Regressor()
trainer = pl.Trainer(
    max_steps=args.steps, accumulate_grad_batches=args.accum, gradient_clip_val=args.clip_val,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
finish({"optimizer": model.probe}, framework_steps=trainer.global_step, micro_losses=model.losses,
       callback_loss=float(trainer.callback_metrics["train_loss"]),
       finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
