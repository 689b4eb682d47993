"""Mamba-2 (`Mamba2ForCausalLM` checkpoints) for the engine, and the Mamba-2 mixer Bamba shares.

Tokens of every request in the step are packed into one batch, `input_ids` [T]; positions are
not needed (the state carries the order). The mixer keeps in_proj (split into the gate z, xBC and
dt), the gated RMSNorm and out_proj here and hands the two stateful parts, the causal conv over
xBC and the SSD scan, to `Mamba2Layer`, which runs them on the MAMBA2 backend against the
request's state slot. The arithmetic follows transformers' Mamba2 (RMSNorms in float32 then cast
back, the gate applied before the group-wise norm, residual stream in float32 when
`residual_in_fp32`, A = -exp(A_log) in float32, logits from the model-dtype matmul) so greedy
outputs agree.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.mamba import Mamba2Layer
from pagedserve.models.layers import RMSNorm


class GatedRMSNorm(nn.Module):
    """transformers' MambaRMSNormGated with norm_before_gate False: y * SiLU(z), then an RMSNorm
    over each of `n_groups` groups of channels, in float32, cast back before the weight."""

    def __init__(self, hidden_size: int, n_groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.n_groups = n_groups
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], self.n_groups, -1)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> (z, xBC, dt); conv + SiLU over xBC; SSD; gated norm with z; out_proj. Parameter
    names are transformers' (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, n_groups: int,
                 state_size: int, conv_kernel: int, chunk_size: int,
                 dt_limit: tuple[float, float], use_bias: bool, use_conv_bias: bool, eps: float,
                 layer_idx: int) -> None:
        super().__init__()
        self.intermediate_size = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        self.mamba = Mamba2Layer(num_heads, head_dim, n_groups, state_size, conv_kernel,
                                 chunk_size, dt_limit, layer_idx)
        conv_dim = self.mamba.conv_dim
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + conv_dim + num_heads,
                                 bias=use_bias)
        # Depthwise: weight [conv_dim, 1, K] as in checkpoints; only its parameters are used.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim,
                                padding=conv_kernel - 1, bias=use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        # A = -exp(A_log) in float32, computed once the weights are loaded.
        self.register_buffer("A", torch.empty(num_heads, dtype=torch.float32), persistent=False)
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(self.intermediate_size, n_groups, eps)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        gate, xbc, dt = self.in_proj(hidden).split(
            [self.intermediate_size, self.mamba.conv_dim, self.num_heads], dim=-1)
        xbc = self.mamba.conv(xbc, self.conv1d.weight[:, 0], self.conv1d.bias)
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        y = self.mamba.ssd(x.view(t, self.num_heads, self.head_dim), dt, self.A,
                           B.reshape(t, self.n_groups, self.state_size),
                           C.reshape(t, self.n_groups, self.state_size), self.D, self.dt_bias)
        y = self.norm(y.reshape(t, self.intermediate_size), gate)
        return self.out_proj(y.to(hidden.dtype))

    def finish_loading(self) -> None:
        self.A = -torch.exp(self.A_log.float())


def check_activation(config: PretrainedConfig) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"Mamba-2 hidden_act {config.hidden_act!r} is not supported (silu)")


class Mamba2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", True))
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        intermediate = int(config.expand * config.hidden_size)
        if config.num_heads * config.head_dim != intermediate:
            raise ValueError(f"Mamba-2 num_heads x head_dim ({config.num_heads} x "
                             f"{config.head_dim}) must equal expand x hidden_size "
                             f"({intermediate})")
        self.mixer = Mamba2Mixer(
            config.hidden_size, config.num_heads, config.head_dim, config.n_groups,
            config.state_size, config.conv_kernel, config.chunk_size,
            tuple(config.time_step_limit), config.use_bias, config.use_conv_bias,
            config.layer_norm_epsilon, layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden.float() if self.residual_in_fp32 else hidden
        return residual + self.mixer(self.norm(hidden.to(self.norm.weight.dtype)))


class Mamba2Model(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm_f(hidden)


class Mamba2ForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_activation(config)
        self.config = config
        self.backbone = Mamba2Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

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
        renamed = ((name.replace("backbone.embedding.", "backbone.embeddings."), tensor)
                   for name, tensor in weights)
        copy_weights(self, renamed, skip_head=self.lm_head is None)
        for layer in self.backbone.layers:
            layer.mixer.finish_loading()


def copy_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 skip_head: bool) -> None:
    """Copy tensors whose names are the model's parameter names; every parameter must be
    covered. `skip_head`: a tied model ignores a saved lm_head.weight."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name == "lm_head.weight" and skip_head:
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                             f"{type(model).__name__}")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        param.data.copy_(tensor)
        loaded.add(name)
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
