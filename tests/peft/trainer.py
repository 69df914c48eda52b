"""An HF `Trainer` + PEFT (LoRA) fine-tuning script with no hookpolicy in it, for tests/test_peft_stack.py.

    python trainer.py --steps 6 --nan-at 3

GPT2LMHeadModel from a tiny config (nothing downloaded) with LoRA (r=4) on c_attn,
trained on random tokens through the Trainer (accelerate underneath) with its own
clipping off (max_grad_norm=0), the loss scaled by 1000 (so the adapter's gradient norm
is far above any max_norm) and NaN at global_step `--nan-at`. The script measures for
itself, with tests/stacks/probe.py's `Probe` on the torch optimizer: the norm of the
adapter gradients each step applies, and whether the step left the adapter and the
optimizer state bit for bit as they were. `finish` writes those, the Trainer's
`state.global_step` and its own hookpolicy metrics (scraped from
HOOKPOLICY_METRICS_PORT) as JSON to $STACK_OUT.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stacks"))
from probe import Probe, finish  # noqa: E402  (the stack scripts' own measurements)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--nan-at", type=int, default=-1)
args = parser.parse_args()

torch.manual_seed(0)
base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0))
model = get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"]))
adapter = [p for p in model.parameters() if p.requires_grad]


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (256, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class NanTrainer(Trainer):
    probe: Any = None

    def create_optimizer(self, *a: Any, **k: Any) -> Any:
        optimizer = super().create_optimizer(*a, **k)
        if self.probe is None:  # the torch optimizer over the adapter (accelerate wraps it later)
            self.probe = Probe(getattr(optimizer, "optimizer", optimizer))
        return optimizer

    def compute_loss(self, *a: Any, **k: Any) -> Any:
        loss = super().compute_loss(*a, **k) * 1000
        return loss * float("nan") if self.state.global_step == args.nan_at else loss


with tempfile.TemporaryDirectory() as out:
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3, max_grad_norm=0,
        use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = NanTrainer(model=model, args=training, train_dataset=Tokens())
    trainer.train()

finish({"optimizer": trainer.probe}, global_step=trainer.state.global_step,
       finite=all(bool(torch.isfinite(p).all()) for p in adapter))
