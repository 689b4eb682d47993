"""Mixture-of-Experts: a router that picks each token's experts, and the experts' SwiGLU MLPs
held as two stacked weights. Routing and the expert computation are separate modules, so a new
routing rule (DeepSeek's grouped top-k, gpt-oss's biased logits) is a new router, not a new
expert kernel.

`torch_experts` is the vectorised torch path, and the reference: the (token, slot) pairs
sorted by expert, one pair of matmuls per expert that any token chose, a weighted
`index_add_` in expert order. It rounds as transformers' own expert loops do, so float32
greedy tokens agree. On CUDA `moe_kernels.fused_experts` (Triton grouped GEMMs over tokens
sorted by expert) computes the same thing without a host sync.

DeepSeek-V2/V3 add grouped routers (`GroupedTopKRouter`, `GroupLimitedSoftmaxRouter`: experts
in groups, only the best groups' experts eligible) and shared experts, a dense SwiGLU MLP every
token passes through (`SwiGLUMLP`, added to the routed sum); `SparseMoeBlock.deepseek(config)`
builds the whole block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve.distributed import all_reduce, tp_rank, tp_world_size
from pagedserve.models.layers import silu_and_mul
from pagedserve.models.parallel import Weight, divide, materialize, narrow
from pagedserve.quantization.unquantized import UNQUANTIZED_MOE


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
    (`moe_kernels.fused_experts`) runs them, elsewhere `torch_experts`.

    With tensor parallelism every rank holds every expert with its intermediate features
    split (I above is this rank's share): each expert's gate/up is column-parallel, its down
    row-parallel, and one all-reduce sums the routed output over the ranks. A gate/up bias
    splits with its rows; a down bias is rank 0's alone, so the sum adds it once.

    Its weights are held, loaded and run by its quantization method (`quant_method`, float
    unless a quantization config chooses another)."""

    quant_method = UNQUANTIZED_MOE

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: ExpertActivation = SILU, bias: bool = False) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        self.num_experts = num_experts
        self.full_intermediate_size = intermediate_size
        intermediate_size = divide(intermediate_size, self.tp_size, "the experts' size")
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
        out = self.quant_method.apply(self, x, weights, ids)
        return all_reduce(out) if self.tp_size > 1 else out

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                    ) -> torch.Tensor:
        """The experts on float weights: the Triton grouped GEMM on CUDA, else torch_experts."""
        experts = torch_experts
        if x.is_cuda:
            from pagedserve.models.moe_kernels import fused_experts as experts
        return experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.activation,
                       self.gate_up_proj_bias, self.down_proj_bias)

    def rank_part(self, tensor: Weight, name: str, shard: str | None = None) -> torch.Tensor:
        """This rank's share of a full checkpoint tensor: one expert's gate, up ([I, H]) or
        down ([H, I]) as `shard` says, or the stacked gate_up_proj [E, 2I, H], down_proj
        [E, H, I] or their biases [E, 2I] and [E, H] (`name`)."""
        part = self.rank_slice(name, shard)
        if part is not None:
            return narrow(tensor, *part)
        if self.tp_size == 1:
            return materialize(tensor)
        n, full = self.intermediate_size, self.full_intermediate_size
        start = self.tp_rank * n
        if name in ("gate_up_proj", "gate_up_proj_bias"):
            return torch.cat([narrow(tensor, 1, start, n), narrow(tensor, 1, full + start, n)],
                             dim=1)
        if name == "down_proj_bias":
            # Added once: rank 0 holds it, the others zeros, and the all-reduce sums them.
            bias = materialize(tensor)
            return bias if self.tp_rank == 0 else torch.zeros_like(bias)
        return narrow(tensor, 2, start, n)

    def rank_slice(self, name: str, shard: str | None = None
                   ) -> tuple[int, int, int] | None:
        """(dim, start, length) of one expert's full gate, up ([I, H]) or down ([H, I]) tensor
        that this rank holds; None: all of it (one rank, or the stacked tensors below)."""
        if self.tp_size == 1 or name in ("gate_up_proj", "down_proj", "gate_up_proj_bias",
                                         "down_proj_bias"):
            return None
        n = self.intermediate_size
        return (1 if shard == "down" else 0, self.tp_rank * n, n)

    def load_expert(self, expert: int, shard: str, tensor: Weight, name: str = "weight"
                    ) -> None:
        """One expert's full checkpoint tensor `name` (its weight, or a scale) into the stacked
        weights (this rank's share of it): `shard` is gate, up or down."""
        self.quant_method.load_expert(self, expert, shard, name, tensor)


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


class _Float32Router(nn.Module):
    """A router whose parameters stay float32 whatever the model's dtype: transformers keeps
    DeepSeek's gate weight and correction bias in float32 (`_keep_in_fp32_modules_strict`), and
    the bias tips choices between experts whose sigmoid scores differ in the third decimal,
    which bfloat16 would blur. Device moves still apply; only dtype casts skip these tensors."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.num_experts = num_experts
        self.top_k = top_k

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> _Float32Router:
        def keep_float32(t: torch.Tensor) -> torch.Tensor:
            applied = fn(t)
            if applied.dtype == t.dtype:
                return applied
            return t.to(device=applied.device)  # the unrounded tensor, moved as asked

        return super()._apply(keep_float32, recurse)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] in any dtype -> float32 router logits [T, E], as transformers computes them
        (both operands cast to float32 first)."""
        return F.linear(x.float(), self.weight.float())


def _experts_of_best_groups(group_scores: torch.Tensor, topk_group: int,
                            group_size: int) -> torch.Tensor:
    """group_scores [T, G] -> bool [T, G * group_size]: True for the experts of each token's
    `topk_group` best groups."""
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.repeat_interleave(group_size, dim=1)


# transformers' (and DeepSeek's) guard against an all-zero sum when renormalising.
_RENORM_EPS = 1e-20


class GroupedTopKRouter(_Float32Router):
    """DeepSeek-V3 ("noaux_tc"): sigmoid scores of the float32 logits; for the choice only, the
    learned `e_score_correction_bias` is added; the experts form `n_group` equal groups, each
    scored by the sum of its two best corrected scores, and only the `topk_group` best groups'
    experts may be chosen; the top k of those. Weights are the uncorrected scores of the chosen
    experts, renormalised to sum to one when `norm_topk_prob`, times `routed_scaling_factor`;
    they come out in float32 (the experts multiply in float32 and round once, as transformers
    does).

    The bias is a checkpoint tensor (`mlp.gate.e_score_correction_bias`), so it is a frozen
    parameter (requires_grad False) rather than a buffer: the loader fills whatever
    `named_parameters()` names."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, n_group: int,
                 topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float) -> None:
        super().__init__(hidden_size, num_experts, top_k)
        _check_groups(num_experts, n_group, topk_group)
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (float32 weights [T, k], expert ids [T, k])."""
        scores = self.logits(x).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:  # otherwise every group stays: nothing to mask
            size = self.num_experts // self.n_group
            grouped = choice.view(-1, self.n_group, size)
            group_scores = grouped.topk(min(2, size), dim=-1).values.sum(dim=-1)
            keep = _experts_of_best_groups(group_scores, self.topk_group, size)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS)
        return weights * self.routed_scaling_factor, ids


class GroupLimitedSoftmaxRouter(_Float32Router):
    """DeepSeek-V2: softmax scores of the float32 logits; `topk_method` "greedy" takes the top
    k of all experts, "group_limited_greedy" first keeps the `topk_group` of `n_group` groups
    with the highest single score (the others' scores zeroed). Weights are the chosen scores
    times `routed_scaling_factor`, in float32.

    `norm_topk_prob` (with k > 1) renormalises the weights to sum to one *instead of* scaling
    them, as DeepSeek's own V2 code does; transformers 5.x ignores the flag for V2. Every
    released V2 checkpoint sets it false, where both agree."""

    METHODS = ("greedy", "group_limited_greedy")

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, topk_method: str,
                 n_group: int | None, topk_group: int | None, norm_topk_prob: bool,
                 routed_scaling_factor: float) -> None:
        super().__init__(hidden_size, num_experts, top_k)
        if topk_method not in self.METHODS:
            raise ValueError(f"DeepSeek-V2 topk_method {topk_method!r} is not one of "
                             f"{self.METHODS}")
        self.group_limited = topk_method == "group_limited_greedy"
        if self.group_limited:
            _check_groups(num_experts, n_group, topk_group)
        self.n_group = n_group
        self.topk_group = topk_group
        self.renormalize = norm_topk_prob and top_k > 1
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (float32 weights [T, k], expert ids [T, k])."""
        scores = torch.softmax(self.logits(x), dim=-1)
        if self.group_limited:
            size = self.num_experts // self.n_group
            group_scores = scores.view(-1, self.n_group, size).amax(dim=-1)
            keep = _experts_of_best_groups(group_scores, self.topk_group, size)
            # Zero, not -inf, as DeepSeek does: softmax scores are positive, so the kept
            # experts still rank first.
            scores = scores.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        if self.renormalize:
            return weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS), ids
        return weights * self.routed_scaling_factor, ids


def _check_groups(num_experts: int, n_group: int | None, topk_group: int | None) -> None:
    if not n_group or not topk_group or num_experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"{num_experts} experts cannot form n_group={n_group} equal groups "
                         f"with topk_group={topk_group} kept")


class SwiGLUMLP(nn.Module):
    """A dense down(silu(gate(x)) * up(x)) with gate and up as one fused projection (gate rows,
    then up rows): DeepSeek's shared experts. Defined here rather than taken from llama.py,
    which imports this module."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))

    def gate_up_shard(self, shard: str, name: str = "weight") -> torch.Tensor:
        """Where a checkpoint's separate gate_proj or up_proj tensor (`shard` "gate" or "up";
        `name` "weight" or "bias") goes in the fused projection: a view to copy into."""
        if shard not in ("gate", "up"):
            raise ValueError(f"gate_up shard {shard!r} is not gate or up")
        n = self.intermediate_size
        return getattr(self.gate_up_proj, name).data.narrow(0, 0 if shard == "gate" else n, n)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as a Mixture of Experts: `gate` routes, `experts` compute, and the
    optional `shared_experts` (DeepSeek), which every token passes through, is added to the
    routed sum (routed + shared, both in the model's dtype, as transformers adds them)."""

    def __init__(self, gate: nn.Module, experts: FusedMoE,
                 shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts

    @classmethod
    def softmax_top_k(cls, hidden_size: int, num_experts: int, top_k: int,
                      intermediate_size: int, renormalize: bool,
                      float32_weights: bool) -> SparseMoeBlock:
        """Mixtral's and Qwen3-MoE's block: `TopKRouter` over SiLU experts."""
        return cls(TopKRouter(hidden_size, num_experts, top_k, renormalize, float32_weights),
                   FusedMoE(num_experts, hidden_size, intermediate_size))

    @classmethod
    def deepseek(cls, config: PretrainedConfig) -> SparseMoeBlock:
        """DeepSeek-V2's or -V3's block from its config: the router by `topk_method` ("noaux_tc",
        V3's default when the config has none: `GroupedTopKRouter`; "greedy" or
        "group_limited_greedy": `GroupLimitedSoftmaxRouter`), `n_routed_experts` SiLU experts
        of `moe_intermediate_size`, and `n_shared_experts` shared experts as one `SwiGLUMLP`
        of n_shared_experts * moe_intermediate_size (none when 0)."""
        if config.hidden_act != "silu":
            raise ValueError(f"DeepSeek MoE with hidden_act {config.hidden_act!r}: only silu")
        experts = FusedMoE(config.n_routed_experts, config.hidden_size,
                           config.moe_intermediate_size)
        shared = None
        if n_shared := getattr(config, "n_shared_experts", None):
            shared = SwiGLUMLP(config.hidden_size, config.moe_intermediate_size * n_shared,
                               bias=bool(getattr(config, "mlp_bias", False)))
        return cls(_deepseek_router(config), experts, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _deepseek_router(config: PretrainedConfig) -> nn.Module:
    """The router a DeepSeek config asks for (see `SparseMoeBlock.deepseek`)."""
    method = getattr(config, "topk_method", None) or "noaux_tc"
    scoring = getattr(config, "scoring_func", None)
    common = dict(hidden_size=config.hidden_size, num_experts=config.n_routed_experts,
                  top_k=config.num_experts_per_tok, n_group=config.n_group,
                  topk_group=config.topk_group, norm_topk_prob=bool(config.norm_topk_prob),
                  routed_scaling_factor=float(config.routed_scaling_factor))
    if method == "noaux_tc" and scoring in (None, "sigmoid"):
        return GroupedTopKRouter(**common)
    if method in GroupLimitedSoftmaxRouter.METHODS and scoring in (None, "softmax"):
        return GroupLimitedSoftmaxRouter(topk_method=method, **common)
    raise ValueError(f"DeepSeek routing topk_method={method!r} with scoring_func={scoring!r} "
                     "is not supported")
