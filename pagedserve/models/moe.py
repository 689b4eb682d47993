"""Mixture-of-Experts: a router that picks each token's experts, and the experts' SwiGLU MLPs
held as two stacked weights. Routing and the expert computation are separate modules, so a new
routing rule (DeepSeek's grouped top-k, gpt-oss's biased logits) is a new router, not a new
expert kernel.

`FusedMoE.forward` is the vectorised torch path, and the reference: the (token, slot) pairs
sorted by expert, one pair of matmuls per expert that any token chose, a weighted
`index_add_` in expert order. It rounds as transformers' own expert loop does, so float32
greedy tokens agree.
"""

from __future__ import annotations

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


class FusedMoE(nn.Module):
    """E experts, each silu(x W_gate^T) * (x W_up^T) W_down^T, stacked: gate_up_proj [E, 2I, H]
    (gate rows, then up rows) and down_proj [E, H, I], transformers' own layout."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H], weights and ids [T, k] -> [T, H]: each token's experts, weighted."""
        out = torch.zeros_like(x)
        k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
        tokens, slots = order // k, order % k
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            token, slot = tokens[start:start + count], slots[start:start + count]
            start += count
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

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


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as a Mixture of Experts: `gate` routes, `experts` compute."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 intermediate_size: int, renormalize: bool, float32_weights: bool) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize, float32_weights)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)
