"""The low-rank term of a LoRA layer, each token through its own adapter only.

Factors of every slot are stacked: A [slots, P * R, in] (the P fused parts' A side by side,
each padded to R = --max-lora-rank rows) and B [slots, out, R] (output row n holds the factors
of the part it belongs to; `bounds` [P + 1] are the parts' first rows). For a token of slot s
and an output row n of part p: y[n] += B[s, n] . (A[s, pR:(p+1)R] x).

`lora_torch` is the vectorised torch path (the CPU's, and the reference of the Triton kernels
in `kernels.py`, which CUDA runs): the step's tokens are grouped by slot on the host
(`LoRABatch.groups`), so the work is one shrink and P expands per adapter in the step, each a
matmul over that adapter's tokens, never over the other slots; a step of a few tokens over
many adapters (decode) goes through `lora_torch_masked` instead, fewer and larger ops.
`add_lora` picks the path.
"""

from __future__ import annotations

import torch

from pagedserve.lora.batch import LoRABatch


def lora_torch(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               bounds: list[int], groups: list[tuple[int, slice | torch.Tensor]]) -> None:
    """y [T, out] += each group's tokens of x [T, in] through its slot's factors (in place).
    Shrink output rounds to the factors' dtype, as PEFT's lora_A output does."""
    rank = lora_b.shape[-1]
    for slot, rows in groups:
        xs = x[rows].to(lora_a.dtype)
        shrunk = xs @ lora_a[slot].t()  # [n, P * R]
        delta = torch.empty(xs.shape[0], y.shape[1], dtype=lora_a.dtype, device=x.device)
        for p in range(len(bounds) - 1):
            lo, hi = bounds[p], bounds[p + 1]
            delta[:, lo:hi] = shrunk[:, p * rank:(p + 1) * rank] @ lora_b[slot, lo:hi].t()
        if isinstance(rows, slice):
            y[rows] += delta.to(y.dtype)
        else:
            y.index_add_(0, rows, delta.to(y.dtype))


def lora_torch_masked(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor,
                      lora_b_t: torch.Tensor, bounds: list[int], token_slots: torch.Tensor
                      ) -> None:
    """The torch path for a few tokens over many adapters (a decode step): every token through
    every slot, the other slots' terms zeroed, with B transposed ([slots, R, out], kept beside
    B on the CPU) so each part's expand is one matmul over a view. A fixed handful of ops
    where `lora_torch` costs a handful per adapter (benchmarks/lora_cpu.py)."""
    t, rank, parts = x.shape[0], lora_b_t.shape[1], len(bounds) - 1
    slots = lora_a.shape[0]
    shrunk = (x.to(lora_a.dtype) @ lora_a.view(-1, x.shape[1]).t()).view(t, slots, parts, rank)
    own = token_slots[:t, None] == torch.arange(slots, device=x.device)[None, :]  # [T, slots]
    shrunk = shrunk * own.to(shrunk.dtype)[:, :, None, None]
    b_rows = lora_b_t.view(slots * rank, -1)
    for p in range(parts):
        lo, hi = bounds[p], bounds[p + 1]
        y[:, lo:hi] += (shrunk[:, :, p].reshape(t, -1) @ b_rows[:, lo:hi]).to(y.dtype)


def masked_pays(num_tokens: int, num_adapters: int, num_slots: int) -> bool:
    """Whether `lora_torch_masked` beats `lora_torch` on the CPU: many of the slots in use, few
    tokens each (benchmarks/lora_cpu.py)."""
    return num_adapters >= max(2, num_slots // 2) and num_tokens <= 8 * num_adapters


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             lora_b_t: torch.Tensor | None, bounds: list[int], bounds_device: torch.Tensor,
             batch: LoRABatch) -> None:
    """y [T, out] += the LoRA term of x [T, in] for the step in `batch` (in place): Triton's
    shrink and expand on CUDA over the tokens grouped by slot, the torch paths elsewhere
    (`lora_b_t`: B transposed, kept off CUDA only)."""
    if not batch.use_kernels:
        if lora_b_t is not None and masked_pays(x.shape[0], len(batch.groups),
                                                lora_a.shape[0]):
            lora_torch_masked(x, y, lora_a, lora_b_t, bounds, batch.token_slots)
        else:
            lora_torch(x, y, lora_a, lora_b, bounds, batch.groups)
        return
    from pagedserve.lora import kernels  # triton: imported on the first CUDA step

    # Under a graph the grid covers every block a replay's step may have (the rest empty).
    num_blocks = batch.grid_blocks(x.shape[0]) if batch.graph_mode else batch.num_blocks
    kernels.grouped(x, y, lora_a, lora_b, bounds, bounds_device, batch.sorted_rows,
                    batch.blocks, num_blocks)
