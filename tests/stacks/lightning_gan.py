"""A PyTorch Lightning GAN: manual optimization, two optimizers, no hookpolicy in it (tests/test_stacks.py).

    python lightning_gan.py --steps 8 --nan-at 3

One LightningModule holds a generator and a discriminator; `training_step` takes
`opt_g, opt_d = self.optimizers()` and steps each after its own backward pass, as
Lightning's GAN example does (the generator is the module's `forward`; the
discriminator's loss sees a detached fake), without `toggle_optimizer`: the generator's
loss leaves gradients on the discriminator, which each optimizer's `zero_grad()` clears
only before its own backward pass. `--nan-at N` makes the discriminator's loss NaN at
global_step N (Lightning counts every optimizer step: the generator's are even, the
discriminator's odd). `--in-place`: both optimizers zero with `zero_grad(set_to_none=False)`,
so every step finds the same `.grad` tensors. Writes Lightning's global_step and both probes' measurements.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn.functional import softplus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe import Probe, finish  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--nan-at", type=int, default=-1)
parser.add_argument("--in-place", action="store_true")
args = parser.parse_args()


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = False
        self.probes: dict[str, Probe] = {}

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, index: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        opt_g.zero_grad(set_to_none=not args.in_place)
        self.manual_backward(softplus(-self.discriminator(self(z))).mean() * 10)
        opt_g.step()
        opt_d.zero_grad(set_to_none=not args.in_place)
        d_loss = (softplus(self.discriminator(self(z).detach())).mean() + softplus(-self.discriminator(real)).mean()) * 10
        if self.global_step == args.nan_at:
            d_loss = d_loss * float("nan")
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=0.01)
        self.probes = {"generator": Probe(opt_g), "discriminator": Probe(opt_d)}
        return opt_g, opt_d


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(256, 4) + 2, torch.randn(256, 2))
model = GAN()
trainer = pl.Trainer(max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
finish(model.probes, framework_steps=trainer.global_step,
       finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
