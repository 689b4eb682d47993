"""Split-KV decode (flash-decoding): when a decode batch has too few (request, KV head) programs
to fill the GPU, each request's keys are cut into partitions attended by separate programs of
`unified_attention` (num_splits > 1), and a second small kernel merges their partial results.

Kernel `_reduce_split_kv_kernel`
  grid:    (num_tokens, num_heads)
  tiling:  one program merges the S_PAD (>= num_splits, masked) partials of one token and head:
           it loads the split maxima and sums [S_PAD] and the accumulators [S_PAD, D_PAD], rescales
           each by 2^(m_s - max m) and divides the summed accumulator by the summed weights.
           With USE_SINKS the head's sink logit joins here, exactly once: as one more "split"
           with sum 1 and no accumulator (the split programs leave it out).
  layout:  partials are flat fp32 buffers read as m, l [T, H, S] and acc [T, H, S, D_PAD] for the
           step's S (m in base-2 logits, acc not normalised), so one persistent allocation for
           the largest S serves every step; out [T, H, D], any strides. D here is the values'
           head size (D_v of a layer whose values differ from its keys): the partials and the
           output hold values only. An empty split has m = -inf, l = 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.ops.unified_attention import (
    TileConfig,
    padded_head_size,
    unified_attention,
)

MAX_SPLITS = 16
SPLIT_MIN_SEQ_LEN = 1024  # shorter contexts gain too little from splitting
MIN_TILES_PER_SPLIT = 2


def device_sm_count(device: torch.device) -> int:
    """SMs to fill; 0 off CUDA (the interpreter never splits unless a test asks it to)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def max_split_decodes(max_num_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """The most decodes `choose_num_splits` can split in one step (it splits only while
    decodes x KV heads < SMs): what the partial buffers are sized for; 0 without SMs."""
    if not num_sms:
        return 0
    return min(max_num_reqs, max(1, -(-num_sms // num_kv_heads)))


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      block_n: int) -> int:
    """Host heuristic, once per step: split only when the (request, KV head) programs cannot
    fill the SMs and the contexts are long; aim at about one program per SM."""
    programs = num_decodes * num_kv_heads
    if programs == 0 or programs >= num_sms or max_seq_len < SPLIT_MIN_SEQ_LEN:
        return 1
    by_length = max_seq_len // (MIN_TILES_PER_SPLIT * block_n)
    return max(1, min(MAX_SPLITS, triton.cdiv(num_sms, programs), by_length))


def allocate_partials(max_tokens: int, num_heads: int, value_head_size: int, num_splits: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat (m, l, acc) buffers for up to `max_tokens` decode tokens and `num_splits` splits;
    the accumulators hold values, so they are sized by the values' head size."""
    rows = max_tokens * num_heads * num_splits
    acc_numel = rows * padded_head_size(value_head_size)
    return (torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(acc_numel, dtype=torch.float32, device=device))


@triton.jit
def _reduce_split_kv_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sinks_ptr, v_scale,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, USE_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < NUM_SPLITS
    row = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + row, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_ok[:, None],
                  other=0.0)
    m_max = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # base 2, as m
        m_max = tl.maximum(m_max, sink)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(weight * l_s, 0)
    if USE_SINKS:
        total += tl.exp2(sink - m_max)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0) * v_scale
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)


def reduce_split_kv(partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    out: torch.Tensor, num_tokens: int, num_splits: int,
                    sinks: torch.Tensor | None = None, v_scale: float = 1.0) -> None:
    """Merge the partials of the first `num_tokens` tokens into out [T, H, D_v]; sinks [H]: the
    per-head sink logits, which the partials leave out; v_scale multiplies the result (an fp8
    cache's V scale)."""
    part_m, part_l, part_acc = partials
    num_heads, head_size = out.shape[1], out.shape[2]
    _reduce_split_kv_kernel[(num_tokens, num_heads)](
        part_m, part_l, part_acc, out, part_m if sinks is None else sinks, float(v_scale),
        *out.stride(),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
        S_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_SIZE=head_size,
        D_PAD=padded_head_size(head_size), USE_SINKS=sinks is not None, num_warps=4,
    )


def split_kv_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    qblock_req: torch.Tensor, qblock_start: torch.Tensor, num_decodes: int, block_m: int,
    scale: float, tiles: TileConfig, num_splits: int,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sliding_window: int | None = None, soft_cap: float | None = None,
    key: torch.Tensor | None = None, value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    v_scale: float = 1.0,
) -> None:
    """Decode attention (one query token per request) with each context split `num_splits`
    ways: the first launch writes the partial buffers (see `allocate_partials`), the second
    merges them into `out`. key/value/slot_mapping: as `unified_attention` (the first split
    writes the new K/V). sinks [H]: added by the merge, so once whatever the split count. out
    [T, H, D_v] and `partials` sized for D_v, the values' head size. v_scale: as
    `unified_attention`'s, applied by the merge."""
    unified_attention(query, k_cache, v_cache, out, block_table, query_start_loc, seq_lens,
                      qblock_req, qblock_start, num_decodes, 1, block_m, scale, tiles,
                      sliding_window, soft_cap, num_splits, partials, key, value, slot_mapping)
    reduce_split_kv(partials, out, num_decodes, num_splits, sinks, v_scale)
