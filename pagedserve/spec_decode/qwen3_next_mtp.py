"""Qwen3-Next's multi-token-prediction block as a draft head, loaded from the target's own
checkpoint (`mtp.*`, which the target's loader skips):

    x = fc(concat(pre_fc_norm_embedding(embed(token i + 1)),
                  pre_fc_norm_hidden(the target's final hidden state at i)))   # 2H -> H
    h = norm(layers.0(x))     # a gated full-attention decoder layer, its MLP a sparse MoE or
                              # dense as layer 0 of the target would have it (as vLLM builds it)
    draft = argmax(lm_head(h))

The norms are the model's zero-centred RMSNorms; the embedding and the head are the target's
own modules. Under tensor parallelism the block's layer splits like the target's (the one-layer
model is built at the ranks' size: q/k/v heads and experts per rank), its fc and norms stay
whole on every rank, and the embedding and head are the target's, already split over the
vocabulary; every rank runs the draft steps, their collectives meeting.
Later drafts feed back h (after `norm`, unlike DeepSeek's layer, whose head norm comes after the
feedback), and no position's embedding is masked. The decoder layer, its norm and the head are
built as a one-layer Qwen3-Next of full attention, so they load through the family's own names
and fused parts.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.qwen3_next import ZeroCenteredRMSNorm
from pagedserve.spec_decode.eagle_head import EagleHead

PREFIX = "mtp."
_OWN = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
        "norm.weight")


class Qwen3NextMtpHead(EagleHead):
    reads = "final"

    def __init__(self, stack: nn.Module, hidden_size: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.stack = stack  # the one-layer model: layers.0, norm, the target's head
        self.hidden_size = hidden_size
        self.layer = stack.model.layers[0]
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden_size, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden_size, eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)

    def combine(self, captured: torch.Tensor) -> torch.Tensor:
        return captured

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        embeds = self.pre_fc_norm_embedding(self.stack.model.embed_tokens(input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden)], dim=-1))
        out, residual = self.layer(positions, x, None, self.stack.model.rotary_emb)
        return self.stack.model.norm(out, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stack.compute_logits(hidden)


def load_qwen3_next_mtp(own: dict[str, torch.Tensor], target: nn.Module, dtype: torch.dtype,
                        device: torch.device) -> Qwen3NextMtpHead:
    """The head from the checkpoint's `mtp.*` tensors (`own`, the prefix dropped)."""
    from pagedserve.models.loader import build_model

    if not own:
        raise ValueError("speculative_config: method 'mtp': the target's checkpoint carries "
                         "no MTP block (no mtp.* tensors)")
    for name in _OWN:
        if name not in own:
            raise ValueError(f"speculative_config: method 'mtp': the target's checkpoint lacks "
                             f"{PREFIX}{name}")
    deeper = sorted({n.split(".")[1] for n in own if n.startswith("layers.")} - {"0"})
    if deeper:
        raise ValueError(f"speculative_config: method 'mtp': MTP layers {', '.join(deeper)} "
                         "past the first are not implemented (one layer only)")
    config = target.config
    stack = build_model(_stack_config(config), dtype, device,
                        _stack_weights(own, config, tied=target.lm_head is None))
    # The target's embedding and head in place of the placeholders: one copy, split as the
    # target's under tensor parallelism.
    stack.model.embed_tokens = target.model.embed_tokens
    stack.lm_head = target.lm_head
    head = Qwen3NextMtpHead(stack, config.hidden_size, config.rms_norm_eps)
    with torch.no_grad():
        for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            getattr(head, name).weight = nn.Parameter(own[f"{name}.weight"].to(dtype),
                                                      requires_grad=False)
    return head.to(device).eval()


def random_head(config: PretrainedConfig, dtype: torch.dtype,
                device: torch.device) -> Qwen3NextMtpHead:
    """A random-weight block (its own embedding and head) over a `random:` target, to time the
    path under synthetic acceptance."""
    from pagedserve.models.layers import build_rope_caches
    from pagedserve.models.random_models import init_random_weights
    from pagedserve.models.registry import get_model_cls

    stack_config = _stack_config(config)
    with torch.device("meta"):
        head = Qwen3NextMtpHead(get_model_cls(stack_config)(stack_config), config.hidden_size,
                                config.rms_norm_eps)
    head = head.to(dtype).to_empty(device=device)
    init_random_weights(head, seed=1)
    build_rope_caches(head, device, dtype)
    return head.eval()


def _stack_config(config: PretrainedConfig) -> PretrainedConfig:
    """One full-attention layer; its MLP sparse or dense as the target's layer 0 (vLLM numbers
    the MTP layer 0 when it decides)."""
    stack_config = copy.deepcopy(config)
    stack_config.num_hidden_layers = 1
    stack_config.layer_types = ["full_attention"]
    return stack_config


def _stack_weights(own: dict[str, torch.Tensor], config: PretrainedConfig, tied: bool
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The block's tensors under the one-layer model's names. The embedding and head get
    placeholders (a broadcast zero, no memory; the target's modules replace them), since the
    target's own are one rank's rows under tensor parallelism, not the checkpoint's whole."""
    placeholder = torch.zeros(()).expand(config.vocab_size, config.hidden_size)
    yield "model.embed_tokens.weight", placeholder
    if not tied:
        yield "lm_head.weight", placeholder
    yield "model.norm.weight", own["norm.weight"]
    for name, tensor in own.items():
        if name.startswith("layers.0."):
            yield "model." + name, tensor
