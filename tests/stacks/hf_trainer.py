"""A transformers `Trainer` script (no hookpolicy in it), for tests/test_stacks.py.

    python hf_trainer.py --arch gpt2|llama --steps 6 --accum 2 --nan-at 3

A tiny causal LM built from a config (nothing downloaded), trained on random tokens
through the Trainer (accelerate underneath) with `max_grad_norm=1.0`; the loss is NaN
at global_step `--nan-at`. Writes the Trainer's own `state.global_step` and the probe's
measurements (probe.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe import Probe, finish  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--nan-at", type=int, default=-1)
args = parser.parse_args()

torch.manual_seed(0)
if args.arch == "gpt2":
    model: Any = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
else:
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (256, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class NanTrainer(Trainer):
    probe: Any = None
    losses: list[tuple[int, float]] = []  # (global_step, the loss compute_loss returned) per micro-batch

    def create_optimizer(self, *a: Any, **k: Any) -> Any:
        optimizer = super().create_optimizer(*a, **k)
        if self.probe is None:
            self.probe = Probe(optimizer)
        return optimizer

    def compute_loss(self, *a: Any, **k: Any) -> Any:
        loss = super().compute_loss(*a, **k)
        if self.state.global_step == args.nan_at:
            loss = loss * float("nan")
        self.losses.append((self.state.global_step, float(loss.detach())))
        return loss


with tempfile.TemporaryDirectory() as out:
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accum, learning_rate=1e-2, max_grad_norm=1.0, use_cpu=True,
        report_to="none", save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = NanTrainer(model=model, args=training, train_dataset=Tokens())
    trainer.train()
finish({"optimizer": trainer.probe}, framework_steps=trainer.state.global_step, micro_losses=trainer.losses,
       logged_losses=[[h["step"], h["loss"]] for h in trainer.state.log_history if "loss" in h],
       finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
