"""A training script with the shape and defaults of nanoGPT's `train.py` (karpathy/nanoGPT), written here.

Not nanoGPT's code: what of it matters to hookpolicy, kept as it is there. A module-level
config of globals that `--key=value` arguments override (its configurator); random
micro-batches from a `uint16` memmap of `data/<dataset>/train.bin`; a GPT with a tied
`lm_head` and AdamW over two groups (weight decay on 2-D parameters only); the default
`dtype = 'float16'` off CUDA with `torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))`,
which disables itself on a machine without CUDA (and is made disabled for bfloat16 and
float32); gradient accumulation (`loss / gradient_accumulation_steps`,
`scaler.scale(loss).backward()`), `scaler.unscale_` and `clip_grad_norm_` when `grad_clip`,
`scaler.step`, `scaler.update`, `zero_grad(set_to_none=True)`; a warm-up and cosine lr set
on the groups each iteration; an evaluation under `torch.no_grad()` with `model.eval()` every
`eval_interval` (iteration 0 first), a checkpoint after it, and `--init_from=resume`, which
loads the model's and the optimizer's state; `--compile=True` compiles the model as nanoGPT does by default. It prints `iter N: loss L, ...` as nanoGPT does.
"""

import math
import os
import sys
import time
from ast import literal_eval
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# -- the config, overridden by --key=value ------------------------------------------------
out_dir, init_from, dataset, device, compile = "out", "scratch", "tiny", "cpu", False
eval_interval, eval_iters, log_interval = 25, 2, 1
gradient_accumulation_steps, batch_size, block_size = 2, 4, 32
n_layer, n_head, n_embd = 2, 2, 32
learning_rate, max_iters, weight_decay, beta1, beta2, grad_clip = 6e-4, 55, 1e-1, 0.9, 0.95, 1.0
warmup_iters, lr_decay_iters, min_lr = 5, 60, 6e-5
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
for arg in sys.argv[1:]:
    key, _, value = arg[2:].partition("=")
    if key not in globals():
        raise SystemExit(f"unknown config key {key}")
    try:
        globals()[key] = literal_eval(value)
    except (SyntaxError, ValueError):
        globals()[key] = value

torch.manual_seed(1337)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
data_dir = os.path.join("data", dataset)


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as in GPT-2

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


iter_num, best_val_loss = 0, 1e9
model = TinyGPT(64)
checkpoint = None
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device)
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()})
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
model.to(device)
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                               {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                              lr=learning_rate, betas=(beta1, beta2))
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None
if compile:
    model = torch.compile(model)  # nanoGPT's default (True there); its checkpoints then carry `_orig_mod.`


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            with ctx:
                losses[k] = model(*get_batch(split))[1].item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


os.makedirs(out_dir, exist_ok=True)
X, Y = get_batch("train")
t0 = time.time()
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if iter_num > 0:
            best_val_loss = min(best_val_loss, float(losses["val"]))
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num,
                        "best_val_loss": best_val_loss}, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    dt, t0 = time.time() - t0, time.time()
    if iter_num % log_interval == 0:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num > max_iters:
        break
