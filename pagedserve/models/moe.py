"""Mixture-of-Experts: a router that picks each token's experts, and the experts' SwiGLU MLPs
held as two stacked weights. Routing and the expert computation are separate modules, so a new
routing rule (DeepSeek's grouped top-k, gpt-oss's biased logits) is a new router, not a new
expert kernel.

`torch_experts` is the vectorised torch path, and the reference: the (token, slot) pairs
sorted by expert, one pair of matmuls per expert that any token chose, a weighted
`index_add_` in expert order. It rounds as transformers' own expert loops do, so float32
greedy tokens agree. On CUDA `moe_kernels.fused_experts` (Triton grouped GEMMs over tokens
sorted by expert) computes the same thing without a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Softmax over the experts' logits (in float32), the top k; `renormalize` rescales the k
    to sum to one (Mixtral always, Qwen3-MoE with norm_topk_prob). `float32_weights`: keep the
    weights in float32 (Mixtral) rather than the model's dtype (Qwen3-MoE)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 float32_weights: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalize = renormalize
        self.float32_weights = float32_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        return weights, ids


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert combines its gate and up projections. `silu`: silu(gate) * up (Mixtral,
    Qwen3-MoE); `swiglu_clamped`: gpt-oss's gate clamped above at `limit`, up clamped to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "swiglu_clamped"):
            raise ValueError(f"expert activation {self.kind!r} is not silu or swiglu_clamped")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SILU = ExpertActivation()


def torch_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  activation: ExpertActivation = SILU,
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference expert computation. x [T, H]; gate_up_proj [E, 2I, H] (gate rows, then up
    rows), down_proj [E, H, I], optional biases [E, 2I] and [E, H]; weights and ids [T, k] ->
    [T, H]: the (token, slot) pairs sorted by expert, one pair of matmuls per expert that any
    token chose, a weighted `index_add_` in expert order. It syncs with the host once (the
    per-expert counts), so it is the CPU path; CUDA runs `moe_kernels.fused_experts`."""
    out = torch.zeros_like(x)
    k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=gate_up_proj.shape[0]).tolist()
    tokens, slots = order // k, order % k
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        token, slot = tokens[start:start + count], slots[start:start + count]
        start += count
        gate_up = F.linear(x[token], gate_up_proj[expert],
                           None if gate_up_bias is None else gate_up_bias[expert])
        y = F.linear(activation(*gate_up.chunk(2, dim=-1)), down_proj[expert],
                     None if down_bias is None else down_bias[expert])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """E experts, each act(x W_gate^T, x W_up^T) W_down^T, stacked: gate_up_proj [E, 2I, H]
    (gate rows, then up rows) and down_proj [E, H, I], transformers' own layout for Mixtral and
    Qwen3-MoE; optional biases (gpt-oss). On CUDA the Triton grouped GEMM
    (`moe_kernels.fused_experts`) runs them, elsewhere `torch_experts`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: ExpertActivation = SILU, bias: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = (nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
                                  if bias else None)
        self.down_proj_bias = (nn.Parameter(torch.empty(num_experts, hidden_size))
                               if bias else None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H], weights and ids [T, k] -> [T, H]: each token's experts, weighted."""
        experts = torch_experts
        if x.is_cuda:
            from pagedserve.models.moe_kernels import fused_experts as experts
        return experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.activation,
                       self.gate_up_proj_bias, self.down_proj_bias)

    def load_expert(self, expert: int, shard: str, tensor: torch.Tensor) -> None:
        """One expert's checkpoint tensor into the stacked weights: `shard` is gate, up or
        down."""
        n = self.intermediate_size
        if shard == "down":
            dst = self.down_proj.data[expert]
        else:
            dst = self.gate_up_proj.data[expert].narrow(0, 0 if shard == "gate" else n, n)
        if dst.shape != tensor.shape:
            raise ValueError(f"expert {expert}'s {shard} weight has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(dst.shape)}")
        dst.copy_(tensor)


class TopKSoftmaxRouter(nn.Module):
    """gpt-oss: biased logits, the top k of the logits, a softmax over those k (in the logits'
    dtype)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as a Mixture of Experts: `gate` routes, `experts` compute."""

    def __init__(self, gate: nn.Module, experts: FusedMoE) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts

    @classmethod
    def softmax_top_k(cls, hidden_size: int, num_experts: int, top_k: int,
                      intermediate_size: int, renormalize: bool,
                      float32_weights: bool) -> SparseMoeBlock:
        """Mixtral's and Qwen3-MoE's block: `TopKRouter` over SiLU experts."""
        return cls(TopKRouter(hidden_size, num_experts, top_k, renormalize, float32_weights),
                   FusedMoE(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)
