"""gpt-oss: a pre-norm decoder with biased q/k/v/o, learned attention sinks (a per-head logit
in every softmax denominator), alternating sliding-window and full layers, YaRN rope, and a
Mixture of Experts in every layer: a biased router whose softmax runs over the top-k logits,
experts with biases and a clamped SwiGLU. Norms scale in float32 before the cast back.

transformers stores the experts transposed with gate and up interleaved column by column
(gate_up_proj [E, H, 2I], down_proj [E, I, H]); `load_weights` turns them into our stacked
row layout ([E, 2I, H] gate rows then up rows, [E, H, I]). The MXFP4 checkpoints OpenAI
publishes store the experts as `*_blocks` / `*_scales` in the same order, rows before the
transpose ([E, 2I, in / 32, 16] with gate and up rows interleaved, [E, H, ...]): they are split
into each expert's gate, up and down tensors for the MXFP4 method (`quantization/mxfp4.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.distributed import tp_rank, tp_world_size
from pagedserve.models.checkpoint_loading import llama_hf_parts
from pagedserve.models.layers import Float32ScaledRMSNorm
from pagedserve.models.llama import LlamaForCausalLM, window_by_layer_type
from pagedserve.models.moe import ExpertActivation, FusedMoE, SparseMoeBlock, TopKSoftmaxRouter
from pagedserve.models.parallel import divide, materialize


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate, up alternating -> [..., 2I] gate half then up half."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `_deinterleave`: gate half then up half -> gate, up alternating."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


class GptOssForCausalLM(LlamaForCausalLM):
    norm_cls = Float32ScaledRMSNorm
    reads_mxfp4_experts = True

    sliding_window_for_layer = staticmethod(window_by_layer_type)

    @staticmethod
    def has_sinks(config: PretrainedConfig) -> bool:
        return True

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        # Older transformers (5.17) keep alpha in the experts, not in the config.
        activation = ExpertActivation("swiglu_clamped", getattr(config, "swiglu_alpha", 1.702),
                                      config.swiglu_limit)
        experts = FusedMoE(config.num_local_experts, config.hidden_size,
                           config.intermediate_size, activation, bias=True)
        router = TopKSoftmaxRouter(config.hidden_size, config.num_local_experts,
                                   config.num_experts_per_tok)
        return SparseMoeBlock(router, experts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._our_layout(weights))

    def hf_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameter `name` of a one-rank model as transformers' gpt-oss tensors (the inverse
        of `_our_layout`): the router and sinks under their names, the experts transposed
        with gate and up interleaved, q/k/v split as Llama's."""
        if name.endswith(".experts.gate_up_proj"):
            yield name, _interleave(tensor.transpose(1, 2))
        elif name.endswith(".experts.gate_up_proj_bias"):
            yield name, _interleave(tensor)
        elif name.endswith(".experts.down_proj"):
            yield name, tensor.transpose(1, 2)
        elif name.endswith(".self_attn.attn.sinks"):
            yield name.replace(".self_attn.attn.sinks", ".self_attn.sinks"), tensor
        elif ".mlp.gate." in name:
            yield name.replace(".mlp.gate.", ".mlp.router."), tensor
        else:
            yield from llama_hf_parts(self, name, tensor)

    @staticmethod
    def _our_layout(weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(("_blocks", "_scales")) and ".experts." in name:
                yield from _mxfp4_experts(name, tensor)
                continue
            name = name.replace(".mlp.router.", ".mlp.gate.")
            if name.endswith(".self_attn.sinks"):
                name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
                tensor = _rank_heads(tensor)
            # Read whole (a rank's lazy slice would not deinterleave); FusedMoE cuts its part.
            if name.endswith(".experts.gate_up_proj"):
                tensor = _deinterleave(materialize(tensor)).transpose(1, 2)
            elif name.endswith(".experts.gate_up_proj_bias"):
                tensor = _deinterleave(materialize(tensor))
            elif name.endswith(".experts.down_proj"):
                tensor = materialize(tensor).transpose(1, 2)
            yield name, tensor


def _rank_heads(sinks: torch.Tensor) -> torch.Tensor:
    """The sinks [heads] of this tensor-parallel rank's query heads."""
    sinks = materialize(sinks)
    size = tp_world_size()
    if size == 1:
        return sinks
    n = divide(sinks.shape[0], size, "attention heads")
    return sinks.narrow(0, tp_rank() * n, n)


def _mxfp4_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`...experts.gate_up_proj_blocks` [E, 2I, ...] (gate, up rows alternating) or
    `...experts.down_proj_blocks` [E, H, ...] (and their `_scales`) -> each expert's
    `...experts.<e>.gate_proj.blocks` etc., rows as our layout holds them."""
    tensor = materialize(tensor)
    stacked, _, leaf = name.rpartition("_")
    prefix, _, proj = stacked.rpartition(".")
    if proj not in ("gate_up_proj", "down_proj") or tensor.dim() < 3:
        raise ValueError(f"checkpoint tensor {name!r} is not gpt-oss's stacked MXFP4 "
                         "gate_up_proj / down_proj (experts, rows, ...)")
    for expert in range(tensor.shape[0]):
        rows = tensor[expert]
        if proj == "down_proj":
            yield f"{prefix}.{expert}.down_proj.{leaf}", rows
        else:
            yield f"{prefix}.{expert}.gate_proj.{leaf}", rows[0::2]
            yield f"{prefix}.{expert}.up_proj.{leaf}", rows[1::2]
