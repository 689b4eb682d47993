"""A tiny random Llama and PEFT adapters over it, saved to disk (shared by the LoRA tests)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# name -> (rank, alpha, rsLoRA)
ADAPTERS = {"r8": (8, 16, False), "r16": (16, 8, True), "r32": (32, 32, False)}


def save_base(path: Path, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, **overrides}),
                                             attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(path)
    return model.eval()


def save_adapter(base: torch.nn.Module, path: Path, rank: int, alpha: int, rslora: bool,
                 seed: int, **extra) -> torch.nn.Module:
    """A PEFT adapter on every linear layer with random (not zero) B; the PeftModel."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules="all-linear",
                        init_lora_weights=False, **extra)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # factors large enough that every adapter moves the logits
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)
    peft_model.save_pretrained(path)
    return peft_model.eval()
