"""Tensor-parallel layers: each rank holds a slice of a weight and the layers meet with one
collective where a slice's partial result must become the whole.

- `ColumnParallelLinear` splits output features: its output stays sharded (the heads of an
  attention layer, the intermediate features of an MLP); `QKVParallelLinear` and
  `MergedColumnParallelLinear` are fused projections split part by part.
- `RowParallelLinear` splits input features, consumes a sharded input and sums the partial
  products over the ranks (one all-reduce), then adds its bias once.
- `VocabParallelEmbedding` and `ParallelLMHead` split the vocabulary, padded to a multiple of
  the ranks; the embedding sums (a token's row lives on one rank), the head gathers.

All are `nn.Linear`/`nn.Embedding` subclasses. A linear's product is its quantization method's
(`layer.quant_method.apply`, see `pagedserve.quantization`): the unquantized method is
`F.linear`, so the single-device path runs exactly what it ran before. Each knows which part of
a full checkpoint tensor it holds (`rank_slice` / `rank_part`); the tensor may be a `LazySlice`
that reads only that part from a safetensors file.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed import all_gather, all_reduce, tp_rank, tp_world_size
from pagedserve.quantization.unquantized import UNQUANTIZED


class LazySlice:
    """A safetensors tensor not yet read: `narrow` reads only the rows (or columns) asked for
    (`safe_open(...).get_slice`), `full` all of it."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.shape = torch.Size(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self.handle[tuple(index)]

    def full(self) -> torch.Tensor:
        return self.handle[:]


# A checkpoint tensor as a layer receives it; a GGUF weight kept in its blocks
# (`quantization/gguf_blocks.GGUFWeight`) narrows and pads as these do.
Weight = torch.Tensor | LazySlice


def materialize(tensor: Weight) -> torch.Tensor:
    return tensor.full() if isinstance(tensor, LazySlice) else tensor


def narrow(tensor: Weight, dim: int, start: int, length: int) -> torch.Tensor:
    return tensor.narrow(dim, start, length)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor parallelism over {parts} ranks needs {what} divisible by "
                         f"{parts}, got {total}")
    return total // parts


# (dim, start, length) of a full checkpoint tensor that this rank holds; None: all of it.
RankSlice = tuple[int, int, int] | None


class LinearBase(nn.Linear):
    """A linear whose product is its quantization method's (`quant_method`, set per layer by
    `pagedserve.quantization.attach_methods`; unquantized unless a config says otherwise)."""

    quant_method = UNQUANTIZED
    tp_size, tp_rank = 1, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def rank_slice(self, name: str, shard: str | None = None) -> RankSlice:
        """Which part of a full checkpoint weight (`name` weight or bias, fused part `shard`)
        this rank holds, as (dim, start, length) of the full tensor; None: all of it."""
        return None

    def rank_part(self, tensor: Weight, name: str, shard: str | None = None) -> torch.Tensor:
        part = self.rank_slice(name, shard)
        return materialize(tensor) if part is None else narrow(tensor, *part)


class ReplicatedLinear(LinearBase):
    """The same whole weight on every rank (DeepSeek's latent projections, any layer a family
    builds as a plain linear)."""


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's rows (output features) split over the ranks; y stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"),
                         bias=bias)

    def rank_slice(self, name: str, shard: str | None = None) -> RankSlice:
        n = self.out_features
        return (0, self.tp_rank * n, n) if self.tp_size > 1 else None


class QKVParallelLinear(LinearBase):
    """q, k and v as one projection with the heads split over the ranks. With fewer K/V heads
    than ranks each K/V head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, self.tp_size, "attention heads")
        if num_kv_heads >= self.tp_size:
            self.num_kv_heads = divide(num_kv_heads, self.tp_size, "key/value heads")
            self.kv_head_start = self.tp_rank * self.num_kv_heads
        else:
            divide(self.tp_size, num_kv_heads, "the ranks (fewer K/V heads than ranks)")
            self.num_kv_heads = 1
            self.kv_head_start = self.tp_rank // (self.tp_size // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)

    def rank_slice(self, name: str, shard: str | None = None) -> RankSlice:
        if self.tp_size == 1:
            return None
        if shard == "q":
            return (0, self.tp_rank * self.q_size, self.q_size)
        return (0, self.kv_head_start * self.head_dim, self.kv_size)


class MergedColumnParallelLinear(LinearBase):
    """gate and up as one projection, each split over the ranks: a rank holds its gate rows
    then its up rows, so silu(gate) * up stays local."""

    def __init__(self, in_features: int, intermediate_size: int, bias: bool = False) -> None:
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        self.local_size = divide(intermediate_size, self.tp_size, "the intermediate size")
        super().__init__(in_features, 2 * self.local_size, bias=bias)

    def rank_slice(self, name: str, shard: str | None = None) -> RankSlice:
        n = self.local_size
        return (0, self.tp_rank * n, n) if self.tp_size > 1 else None


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x_r W_r^T, + b: W's columns (input features) split, the input
    sharded as a column-parallel layer left it; the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size, self.tp_rank = tp_world_size(), tp_rank()
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features,
                         bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def rank_slice(self, name: str, shard: str | None = None) -> RankSlice:
        if self.tp_size == 1 or name == "bias":
            return None
        n = self.in_features
        return (1, self.tp_rank * n, n)


def _vocab_rows(vocab_size: int) -> tuple[int, int]:
    """(rows per rank, this rank's first row) of a vocabulary padded to a multiple of the
    ranks."""
    per_rank = -(-vocab_size // tp_world_size())
    return per_rank, tp_rank() * per_rank


def _vocab_part(tensor: Weight, vocab_size: int, per_rank: int, start: int) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] tensor, zero rows past the vocabulary."""
    if tp_world_size() == 1:
        return materialize(tensor)
    rows = max(0, min(per_rank, vocab_size - start))
    part = narrow(tensor, 0, start, rows)
    if rows == per_rank:
        return part
    if not isinstance(part, torch.Tensor):  # a GGUF head's blocks pad with zero bytes
        return part.with_zero_rows(per_rank - rows)
    pad = torch.zeros(per_rank - rows, *part.shape[1:], dtype=part.dtype)
    return torch.cat([part, pad.to(part.device)])


class VocabParallelEmbedding(nn.Embedding):
    """The embedding's rows split over the ranks: a rank looks up the tokens it holds, zeros
    the others, and the all-reduce assembles every token's row."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.tp_size = tp_world_size()
        self.vocab_size = vocab_size
        self.rows_per_rank, self.vocab_start = _vocab_rows(vocab_size)
        super().__init__(self.rows_per_rank, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def rank_part(self, tensor: Weight, name: str, shard: str | None = None) -> torch.Tensor:
        return _vocab_part(tensor, self.vocab_size, self.rows_per_rank, self.vocab_start)


def gather_vocab(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each rank's logits over its vocabulary rows -> every token's logits [N, vocab] on every
    rank (all ranks then run the same step code; only rank 0 samples)."""
    if tp_world_size() == 1 or local_logits.shape[-1] >= vocab_size:  # (a whole layer's)
        return local_logits
    return all_gather(local_logits, dim=-1)[..., :vocab_size]


class ParallelLMHead(LinearBase):
    """The output projection with the vocabulary split like `VocabParallelEmbedding`; its
    forward returns the full logits, gathered."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.tp_size = tp_world_size()
        self.vocab_size = vocab_size
        self.rows_per_rank, self.vocab_start = _vocab_rows(vocab_size)
        super().__init__(hidden_size, self.rows_per_rank, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden, None)
        return logits if self.tp_size == 1 else gather_vocab(logits, self.vocab_size)

    def rank_slice(self, name: str, shard: str | None = None) -> RankSlice:
        if self.tp_size == 1:
            return None
        raise ValueError("a quantized lm_head is not tensor-parallel yet (its padded vocabulary "
                         "rows); list lm_head among the ignored layers")

    def rank_part(self, tensor: Weight, name: str, shard: str | None = None) -> torch.Tensor:
        return _vocab_part(tensor, self.vocab_size, self.rows_per_rank, self.vocab_start)


def rank_part(module: nn.Module, tensor: Weight, name: str, shard: str | None = None
              ) -> torch.Tensor:
    """What of a full checkpoint tensor (parameter `name` of `module`, fused part `shard`)
    this rank holds: a parallel layer's slice, all of it for any other module."""
    part = getattr(module, "rank_part", None)
    return part(tensor, name, shard) if part is not None else materialize(tensor)
