"""An HF `Trainer` + PEFT (LoRA) fine-tuning script with no hookpolicy in it, for tests/test_peft_stack.py.

    python trainer.py --steps 6 --nan-at 3

GPT2LMHeadModel from a tiny config (nothing downloaded) with LoRA (r=4) on c_attn,
trained on random tokens through the Trainer (accelerate underneath) with its own
clipping off (max_grad_norm=0), the loss scaled by 1000 (so the adapter's gradient norm
is far above any max_norm) and NaN at global_step `--nan-at`. The script measures for
itself, with an optimizer step pre-hook and post-hook on the torch optimizer: the norm
of the adapter gradients each step applies, and whether the step left the adapter and
the optimizer state bit for bit as they were. It writes those, the Trainer's
`state.global_step` and its own hookpolicy metrics (scraped from
HOOKPOLICY_METRICS_PORT) as JSON to $STACK_OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import urllib.request
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

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


def snapshot(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [t for p in adapter for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in adapter] + [t.clone() for t in state]


norms: list[float] = []
unchanged: list[bool] = []
before: list[list[torch.Tensor]] = []


def pre(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in adapter if p.grad is not None])))
    before.append(snapshot(optimizer))


def post(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    after = snapshot(optimizer)
    old = before[-1]
    unchanged.append(len(old) == len(after) and all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
                                                    for a, b in zip(old, after)))


class NanTrainer(Trainer):
    hooked = False

    def create_optimizer(self, *a: Any, **k: Any) -> Any:
        optimizer = super().create_optimizer(*a, **k)
        if not self.hooked:
            self.hooked = True
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it later; hook the torch one
            inner.register_step_pre_hook(pre)
            inner.register_step_post_hook(post)
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

port = os.environ.get("HOOKPOLICY_METRICS_PORT")
metrics = ""
if port:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        metrics = answer.read().decode()
with open(os.environ["STACK_OUT"], "w", encoding="utf-8") as f:
    json.dump({"global_step": trainer.state.global_step, "norms": norms, "unchanged": unchanged,
               "metrics": metrics, "finite": all(bool(torch.isfinite(p).all()) for p in adapter)}, f)
