"""Qwen3-Next (`Qwen3NextForCausalLM`): a hybrid of gated delta net layers (linear attention
with a per-request state slot, the GDN_ATTN backend) and gated full-attention layers (paged
K/V), as `config.layer_types` lists them ("linear_attention" / "full_attention"); each
layer's MLP is dense or a sparse Mixture of Experts with a sigmoid-gated shared expert.

Tokens of every request in the step are packed into one batch, `input_ids` [T] and
`positions` [T]. The attention layers are indexed 0..Na-1 among themselves, the gated delta
net layers 0..Ns-1 among themselves, whatever their position in the stack.

What differs from Qwen3: the decoder's and q/k's RMSNorms are zero-centred (scaled by
1 + weight, in float32); the attention's q projection is twice as wide, each head's query
followed by its output gate (out * sigmoid(gate) before o_proj); the rotary embedding turns
only the leading `partial_rotary_factor` of each head. The gated delta net projects
hidden -> q, k, v, z (grouped per key head in the checkpoint) and b, a; q|k|v pass the causal
conv (SiLU), beta = sigmoid(b), the decay g = -exp(A_log) * softplus(a + dt_bias), and its
output is RMS-normed per value head and gated by SiLU(z) (weight not zero-centred).
`load_weights` reorders the grouped projection rows once, so the forward splits one fused
projection into contiguous q | k | v | z | b | a. The arithmetic follows transformers'
modeling code op for op (float32 where it upcasts) so greedy outputs agree.

Tensor parallelism splits both mixers by heads: the attention as Llama's (each query head with
its gate), the gated delta net by key-head groups (a rank holds whole groups: its key heads
and the value heads they serve, their rows of in_proj, conv1d, dt_bias and A_log, its columns
of out_proj, and so a state slot of its heads only); the experts split inside `FusedMoE`, the
shared expert as a dense MLP; the routers and the shared expert's gate run whole on every
rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.layer import Attention
from pagedserve.attention.linear.gdn_layer import GDNLayer
from pagedserve.distributed import tp_rank, tp_world_size
from pagedserve.models.layers import (
    GemmaRMSNorm,
    RotaryEmbedding,
    build_rope_caches,
    silu_and_mul,
)
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.moe import FusedMoE, TopKRouter
from pagedserve.models.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    Weight,
    divide,
    gather_vocab,
    materialize,
    narrow,
    rank_part,
)

# Zero-centred: checkpoints store weight - 1, the norm scales by (1 + weight) in float32,
# Gemma's rounding exactly.
ZeroCenteredRMSNorm = GemmaRMSNorm


class GatedRMSNorm(nn.Module):
    """RMSNorm of x (per value head) scaled by weight in the model dtype, times SiLU(gate) in
    float32, cast back."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


class Qwen3NextAttention(nn.Module):
    """Gated full attention: q (with its per-head output gate), k, v as one fused projection;
    zero-centred q/k norms per head; partial rotary; paged attention; out * sigmoid(gate)."""

    def __init__(self, config: PretrainedConfig, attn_idx: int) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        divide(num_heads, tp_world_size(), "attention heads")
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        bias = bool(getattr(config, "attention_bias", False))
        # Rows: [query, gate] of each head (2 * q_size), then k, then v: as a projection of
        # twice the heads, so a rank's share of the query rows is whole (query, gate) heads.
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, 2 * num_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size,
                                        bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, attn_idx)

    def shard_rows(self, shard: str) -> tuple[int, int]:
        """(first row, rows) of a checkpoint projection (this rank's part) in the fused
        qkv_proj."""
        q2 = 2 * self.q_size
        return {"q": (0, q2), "k": (q2, self.kv_size), "v": (q2 + self.kv_size, self.kv_size)}[
            shard]

    def checkpoint_rows(self, shard: str, tensor: Weight, name: str
                        ) -> tuple[int, torch.Tensor]:
        """(first row in qkv_proj, this rank's rows) of a checkpoint's q_proj, k_proj or
        v_proj weight or bias (`name`)."""
        start, _ = self.shard_rows(shard)
        return start, self.qkv_proj.rank_part(tensor, name, shard)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(hidden).split(
            [2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        q = self.q_norm(q_gate[..., :d])
        k = self.k_norm(k.view(t, self.num_kv_heads, d))
        q, k = rotary(positions, q, k)
        out = self.attn(q.reshape(t, self.q_size), k.reshape(t, self.kv_size), v)
        out = out * torch.sigmoid(q_gate[..., d:].reshape(t, self.q_size))
        return self.o_proj(out)


class Qwen3NextGatedDeltaNet(nn.Module):
    """The linear-attention mixer: projections, gates and the output norm here; the causal conv
    and the gated delta rule, which read and write the request's state slot, in `GDNLayer`."""

    def __init__(self, config: PretrainedConfig, state_idx: int) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Qwen3-Next's conv activation {config.hidden_act!r}: only silu")
        # This rank's key heads and the value heads they serve (all of them at one rank).
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        nk = divide(config.linear_num_key_heads, self.tp_size, "linear-attention key heads")
        nv = config.linear_num_value_heads // self.tp_size
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        kernel = config.linear_conv_kernel_dim
        self.gdn = GDNLayer(nk, nv, dk, dv, kernel, state_idx)
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = nk, nv, dk, dv
        self.key_dim, self.value_dim = nk * dk, nv * dv
        self.conv_dim = self.gdn.conv_dim
        # Rows after load_weights' reordering: q | k | v | z (in_proj_qkvz), b | a (in_proj_ba).
        self.qkvz_size = 2 * self.key_dim + 2 * self.value_dim
        self.in_proj = nn.Linear(config.hidden_size, self.qkvz_size + 2 * nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim,
                                padding=kernel - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.norm = GatedRMSNorm(dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(config.linear_num_value_heads * dv,
                                          config.hidden_size, bias=False)

    def checkpoint_rows(self, shard: str, tensor: Weight) -> tuple[int, torch.Tensor]:
        """A checkpoint's in_proj_qkvz or in_proj_ba (`shard` "qkvz" or "ba"; rows grouped per
        key head: q, k, v, z of the head's value heads / b, a) as (first row in in_proj, rows
        reordered to q | k | v | z / b | a). A rank reads its key heads' groups, contiguous in
        the checkpoint."""
        nk, group = self.num_k_heads, self.num_v_heads // self.num_k_heads
        rows = tensor.shape[0] // (nk * self.tp_size)  # one key head's group
        tensor = narrow(tensor, 0, self.tp_rank * nk * rows, nk * rows)
        if shard == "qkvz":
            dk, vz = self.head_k_dim, group * self.head_v_dim
            parts = tensor.reshape(nk, 2 * dk + 2 * vz, -1).split([dk, dk, vz, vz], dim=1)
            start = 0
        else:
            parts = tensor.reshape(nk, 2 * group, -1).split([group, group], dim=1)
            start = self.qkvz_size
        return start, torch.cat([p.reshape(-1, tensor.shape[-1]) for p in parts])

    def checkpoint_tensors(self, in_proj: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inverse of `checkpoint_rows` at one rank: in_proj's q | k | v | z | b | a rows
        as the checkpoint's in_proj_qkvz and in_proj_ba, grouped per key head."""
        nk, group = self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, vz = self.head_k_dim, group * self.head_v_dim
        q, k, v, z, b, a = in_proj.split([self.key_dim, self.key_dim, self.value_dim,
                                          self.value_dim, self.num_v_heads, self.num_v_heads])
        per_head = [t.reshape(nk, n, -1) for t, n in ((q, dk), (k, dk), (v, vz), (z, vz))]
        return {"qkvz": torch.cat(per_head, dim=1).reshape(-1, in_proj.shape[-1]),
                "ba": torch.cat([b.reshape(nk, group, -1), a.reshape(nk, group, -1)],
                                dim=1).reshape(-1, in_proj.shape[-1])}

    def rank_part(self, tensor: Weight, name: str, shard: str | None = None) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor `name` (relative to this module) other
        than the fused projections: conv1d's rows of its q, k and v channels, its value heads'
        dt_bias and A_log, its columns of out_proj; the norm (per value head) whole."""
        if self.tp_size == 1:
            return materialize(tensor)
        if name == "conv1d.weight":
            key, value, r = self.key_dim, self.value_dim, self.tp_rank
            full_key = key * self.tp_size
            return torch.cat([narrow(tensor, 0, r * key, key),
                              narrow(tensor, 0, full_key + r * key, key),
                              narrow(tensor, 0, 2 * full_key + r * value, value)])
        if name in ("dt_bias", "A_log"):
            return narrow(tensor, 0, self.tp_rank * self.num_v_heads, self.num_v_heads)
        if name == "out_proj.weight":
            return self.out_proj.rank_part(tensor, "weight")
        return materialize(tensor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        t, nv = hidden.shape[0], self.num_v_heads
        mixed_qkv, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_dim, nv, nv], dim=-1)
        mixed_qkv = self.gdn.conv(mixed_qkv, self.conv1d.weight[:, 0])
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.sigmoid()
        # In float32: in 16 bits exp(A_log) could overflow.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = self.gdn.delta_rule(q.reshape(t, self.num_k_heads, self.head_k_dim),
                                  k.reshape(t, self.num_k_heads, self.head_k_dim),
                                  v.reshape(t, nv, self.head_v_dim), g, beta)
        out = self.norm(out, z.reshape(t, nv, self.head_v_dim))
        return self.out_proj(out.reshape(t, self.value_dim))


class SharedExpert(nn.Module):
    """down(silu(gate(x)) * up(x)), its intermediate features split over the ranks like a dense
    MLP's (gate/up column-parallel, down row-parallel: the all-reduce makes it whole before
    the sigmoid gate scales it)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, intermediate_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Qwen3NextSparseMoeBlock(nn.Module):
    """Softmax top-k routed SiLU experts plus a shared expert every token passes through, scaled
    by sigmoid(shared_expert_gate(x)); both in the model dtype, added as transformers adds
    them."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = TopKRouter(hidden, config.num_experts, config.num_experts_per_tok,
                               renormalize=bool(config.norm_topk_prob), float32_weights=False)
        self.experts = FusedMoE(config.num_experts, hidden, config.moe_intermediate_size)
        self.shared_expert = SharedExpert(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = self.experts(x, weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, mixer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen3NextGatedDeltaNet(config, mixer_idx)
        elif self.layer_type == "full_attention":
            self.self_attn = Qwen3NextAttention(config, mixer_idx)
        else:
            raise ValueError(f"Qwen3-Next layer type {self.layer_type!r} is not supported")
        self.mlp = (Qwen3NextSparseMoeBlock(config) if is_sparse_layer(config, layer_idx)
                    else LlamaMLP(config))
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size,
                                                            config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): the add is
        fused into the next norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.layer_type == "linear_attention":
            hidden = self.linear_attn(hidden)
        else:
            hidden = self.self_attn(positions, hidden, rotary)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        counts = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for i, kind in enumerate(config.layer_types[:config.num_hidden_layers]):
            layers.append(Qwen3NextDecoderLayer(config, i, counts.get(kind, 0)))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        self.rotary_emb = RotaryEmbedding(config, head_dim)
        # An EAGLE-3 head's taps, as LlamaModel keeps them: the residual stream entering
        # these layers, each step (none unless a head asks).
        self.tap_layers: tuple[int, ...] = ()
        self.tapped: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            if i in self.tap_layers:
                self.tapped[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, self.rotary_emb)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# One expert's weight in a per-expert checkpoint: (experts module, expert, projection).
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Checkpoint name part -> (our fused parameter's name part, shard).
_FUSED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    ".linear_attn.in_proj_qkvz.": (".linear_attn.in_proj.", "qkvz"),
    ".linear_attn.in_proj_ba.": (".linear_attn.in_proj.", "ba"),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", "gate"),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", "up"),
    ".shared_expert.gate_proj.": (".shared_expert.gate_up_proj.", "gate"),
    ".shared_expert.up_proj.": (".shared_expert.gate_up_proj.", "up"),
}
_SHARDS = {".qkv_proj.": ("q", "k", "v"), ".in_proj.": ("qkvz", "ba"),
           ".gate_up_proj.": ("gate", "up")}


class Qwen3NextForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3NextModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (None if self.tie_word_embeddings
                        else ParallelLMHead(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (the matmul in the model dtype;
        with tensor parallelism each rank's vocabulary rows, gathered)."""
        if self.lm_head is None:  # tied
            logits = F.linear(hidden, self.model.embed_tokens.weight)
            return gather_vocab(logits, self.config.vocab_size).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused, reordered) parameters; experts one
        by one or stacked. The multi-token-prediction head (`mtp.*`) is not served. Every
        parameter must be covered; then the rope cache is built."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("mtp.") or "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if expert := _EXPERT.match(name):
                prefix, index, proj = expert.groups()
                shard = proj.removesuffix("_proj")
                self.get_submodule(prefix).load_expert(int(index), shard, tensor)
                loaded.add(f"{prefix}:{index}:{shard}")
                continue
            target, shard = name, None
            for hf_part, (ours, shard_id) in _FUSED.items():
                if hf_part in name:
                    target, shard = name.replace(hf_part, ours), shard_id
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                                 f"{type(self).__name__}")
            param = params[target]
            if shard is None:
                dst, tensor = param.data, self._rank_part(target, tensor)
            else:
                dst, tensor = self._shard(target, param, shard, tensor)
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.update([f"{target}:{shard}"] if shard else self._coverage_keys(target))
        missing = [key for n in params for key in self._coverage_keys(n) if key not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
        emb = self.model.embed_tokens.weight
        build_rope_caches(self, emb.device, emb.dtype)

    def _shard(self, target: str, param: torch.Tensor, shard: str,
               tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows of `param` a checkpoint shard fills, this rank's part of the tensor as they
        hold it)."""
        module_name, _, leaf = target.rpartition(".")
        module = self.get_submodule(module_name.rsplit(".", 1)[0])
        if isinstance(module, Qwen3NextAttention):
            start, tensor = module.checkpoint_rows(shard, tensor, leaf)
        elif isinstance(module, Qwen3NextGatedDeltaNet):
            start, tensor = module.checkpoint_rows(shard, tensor)
        else:  # gate rows, then up rows, of a dense MLP or the shared expert
            tensor = rank_part(self.get_submodule(module_name), tensor, leaf, shard)
            start = 0 if shard == "gate" else param.shape[0] // 2
        return param.data.narrow(0, start, tensor.shape[0]), tensor

    def _rank_part(self, target: str, tensor: Weight) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor of parameter `target` (not fused)."""
        if ".linear_attn." in target:
            prefix, _, rest = target.partition(".linear_attn.")
            return self.get_submodule(prefix + ".linear_attn").rank_part(tensor, rest)
        module_name, _, leaf = target.rpartition(".")
        return rank_part(self.get_submodule(module_name), tensor, leaf)

    def hf_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameter `name` of a one-rank model (`tensor`) as checkpoint tensors: the fused
        projections split back into their parts (so `random:` weights load at N ranks as one
        rank draws them)."""
        for hf_part, (ours, shard) in _FUSED.items():
            if ours not in name:
                continue
            module_name = name.rpartition(".")[0].rsplit(".", 1)[0]
            module = self.get_submodule(module_name)
            if isinstance(module, Qwen3NextGatedDeltaNet):
                part = module.checkpoint_tensors(tensor)[shard]
            elif isinstance(module, Qwen3NextAttention):
                start, _ = module.shard_rows(shard)
                size = {"q": 2 * module.q_size}.get(shard, module.kv_size)
                part = tensor.narrow(0, start, size)
            else:
                n = tensor.shape[0] // 2
                part = tensor.narrow(0, 0 if shard == "gate" else n, n)
            yield name.replace(ours, hf_part), part
        if not any(part in name for part in _SHARDS):
            yield name, tensor

    def _coverage_keys(self, name: str) -> list[str]:
        """What a complete checkpoint fills of parameter `name`: each fused shard, each expert's
        projection (experts one by one or stacked)."""
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            prefix, _, stacked = name.rpartition(".")
            shards = ("gate", "up") if stacked == "gate_up_proj" else ("down",)
            experts = self.get_submodule(prefix).num_experts
            return [f"{prefix}:{e}:{s}" for e in range(experts) for s in shards]
        for part, shards in _SHARDS.items():
            if part in name:
                return [f"{name}:{s}" for s in shards]
        return [name]
