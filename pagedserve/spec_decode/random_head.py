"""A random-weight EAGLE-3 head for a target's shape, written in the published format: with
`rejection_sample_method: "synthetic"` it times the head's path (its pass after each step and
K draft steps) at a chosen acceptance length without a trained head."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PretrainedConfig


def write_random_eagle3_head(path: str | Path, target: PretrainedConfig,
                             draft_vocab_size: int | None = None, seed: int = 0,
                             dtype: torch.dtype = torch.bfloat16) -> str:
    """`path` gets config.json and model.safetensors of an EAGLE-3 head over `target` (its
    hidden, head and MLP sizes, as the published heads take them; a draft vocabulary of the
    target's first `draft_vocab_size` ids, all of them by default)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    h, heads = target.hidden_size, target.num_attention_heads
    kv = getattr(target, "num_key_value_heads", None) or heads
    d = getattr(target, "head_dim", None) or h // heads
    inter, vocab = target.intermediate_size, target.vocab_size
    draft = draft_vocab_size or vocab
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    weights = {"fc.weight": w(h, 3 * h), "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
               "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
               "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
               "midlayer.self_attn.o_proj.weight": w(h, heads * d),
               "midlayer.mlp.gate_proj.weight": w(inter, h),
               "midlayer.mlp.up_proj.weight": w(inter, h),
               "midlayer.mlp.down_proj.weight": w(h, inter), "lm_head.weight": w(draft, h),
               "d2t": torch.zeros(draft, dtype=torch.int64)}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm",
                 "midlayer.post_attention_layernorm", "norm"):
        weights[f"{norm}.weight"] = torch.ones(h, dtype=dtype)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": d, "num_hidden_layers": 1,
              "vocab_size": vocab, "draft_vocab_size": draft, "hidden_act": "silu",
              "rms_norm_eps": getattr(target, "rms_norm_eps", 1e-5),
              "max_position_embeddings": target.max_position_embeddings,
              "rope_theta": getattr(target, "rope_theta", 10000.0),
              "rope_scaling": getattr(target, "rope_scaling", None),
              "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors"))
    return str(path)
