"""HF's GPT2LMHeadModel from a tiny GPT2Config, and its LoRA fine-tune as peft's
get_peft_model makes it (LoraConfig(r=4, target_modules=["c_attn"]))."""

from __future__ import annotations

import warnings
from typing import Any

import torch

VOCAB, BLOCK = 64, 8


def base_model(seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=BLOCK,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def lora_model(seed: int = 0) -> Any:
    """The tiny GPT-2 with LoRA on c_attn; B starts at zero in PEFT, so it is randomised here
    to give the adapter an output and A a gradient from the first step."""
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's fan_in_fan_out notice for GPT-2's Conv1D
        model = peft.get_peft_model(base_model(seed), peft.LoraConfig(r=4, target_modules=["c_attn"]))
    torch.manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model
