"""Mamba-1 (`MambaForCausalLM` checkpoints) for the engine.

Tokens of every request in the step are packed into one batch, `input_ids` [T]; positions are
not needed (the state carries the order). Each mixer keeps its projections here and hands the
two stateful parts, the causal conv and the selective scan, to `MambaLayer`, which runs them on
the MAMBA backend against the request's state slot. The arithmetic follows transformers' Mamba
(RMSNorm in float32, residual stream in float32 when `residual_in_fp32`, A = -exp(A_log) in
float32, logits from the model-dtype matmul) so greedy outputs agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.mamba import MambaLayer
from pagedserve.models.layers import RMSNorm


def _d_inner(config: PretrainedConfig) -> int:
    return int(getattr(config, "intermediate_size", None) or config.expand * config.hidden_size)


def _time_step_rank(config: PretrainedConfig) -> int:
    rank = config.time_step_rank
    return math.ceil(config.hidden_size / 16) if rank == "auto" else int(rank)


class MambaMixer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Mamba hidden_act {config.hidden_act!r} is not supported (silu)")
        d, n, k = _d_inner(config), config.state_size, config.conv_kernel
        self.d_inner, self.state_size = d, n
        self.time_step_rank = _time_step_rank(config)
        self.in_proj = nn.Linear(config.hidden_size, 2 * d, bias=config.use_bias)
        # Depthwise: weight [d, 1, K] as in checkpoints; only its parameters are used.
        self.conv1d = nn.Conv1d(d, d, k, groups=d, padding=k - 1, bias=config.use_conv_bias)
        self.x_proj = nn.Linear(d, self.time_step_rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(self.time_step_rank, d, bias=True)
        self.A_log = nn.Parameter(torch.empty(d, n))
        # A = -exp(A_log) in float32, computed once the weights are loaded.
        self.register_buffer("A", torch.empty(d, n, dtype=torch.float32), persistent=False)
        self.D = nn.Parameter(torch.empty(d))
        self.out_proj = nn.Linear(d, config.hidden_size, bias=config.use_bias)
        self.mamba = MambaLayer(d, k, n, layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        x = self.mamba.conv(x, self.conv1d.weight[:, 0], self.conv1d.bias)
        time_step, B, C = self.x_proj(x).split(
            [self.time_step_rank, self.state_size, self.state_size], dim=-1)
        dt = F.linear(time_step, self.dt_proj.weight)  # the bias joins inside the scan
        y = self.mamba.scan(x, dt, self.A, B, C, self.D, z, self.dt_proj.bias)
        return self.out_proj(y)


class MambaBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", True))
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = MambaMixer(config, layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden.float() if self.residual_in_fp32 else hidden
        return residual + self.mixer(self.norm(hidden.to(self.norm.weight.dtype)))


class MambaModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm_f(hidden)


class MambaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = MambaModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def mamba_layers(self) -> list[MambaLayer]:
        return [layer.mixer.mamba for layer in self.backbone.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, hidden] (float32 when the residual
        stream is)."""
        return self.backbone(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.backbone.embeddings.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden.to(weight.dtype), weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (older checkpoints say `embedding`); every
        parameter must be covered."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.replace("backbone.embedding.", "backbone.embeddings.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                                 f"{type(self).__name__}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
        for layer in self.backbone.layers:
            mixer = layer.mixer
            mixer.A = -torch.exp(mixer.A_log.float())
