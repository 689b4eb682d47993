"""Phi-3: a Llama-family decoder whose checkpoints already hold q/k/v and gate/up fused (the
names `qkv_proj` and `gate_up_proj` load as they are), an optional window on every layer, and
LongRoPE (one factor set per engine: the long factors when it serves sequences past the
original context, else the short ones; see `layers._rope_table`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedserve.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window_for_layer(config: PretrainedConfig, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)
