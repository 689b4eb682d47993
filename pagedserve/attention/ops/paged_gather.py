"""Gather each request's context pages from the paged cache into contiguous varlen K and V.

Used by attention kernels that take packed `[total_k, Hkv, D]` K/V with `cu_seqlens_k` and no
block table (PyTorch's own FlashAttention-2). Request `r` copies its tokens
`page_start[r] * block_size .. seq_lens[r]` to rows `cu_seqlens_k[r] ..` of the output, so
`cu_seqlens_k[r + 1] - cu_seqlens_k[r] == seq_lens[r] - page_start[r] * block_size`. A
`page_start` above 0 skips pages a sliding window can no longer see.

Kernel `_paged_gather_kernel`
  grid:    (max_pages, num_reqs, cdiv(Hkv * D, BLOCK_W)); program (p, r, c) copies page
           `page_start[r] + p` of request r (its valid rows only) for row elements
           [c * BLOCK_W, (c + 1) * BLOCK_W); pages past a request's end return at once, so the grid
           may be sized for the longest request (or a fixed maximum, for CUDA-graph capture).
           Pages are on axis 0, the only one not limited to 65,535 programs (block size 1).
  tiling:  a [BLOCK_ROWS, BLOCK_W] tile, BLOCK_ROWS = block_size rounded up to a power of two;
           a token's heads and channels are one contiguous row of Hkv * D elements.
  layout:  caches [num_blocks, block_size, Hkv, D] with (Hkv, D) contiguous, any block and row
           strides (K/V-outermost views of one cache tensor are fine); outputs [rows, Hkv, D]
           with (Hkv, D) contiguous. block_table [B, max_blocks] int32 (entries past a
           request's pages are never read), seq_lens/page_start/cu_seqlens_k int32.
  Values are only loaded and stored, never computed on, so every dtype copies bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_gather_kernel(
    k_cache_ptr, v_cache_ptr, k_out_ptr, v_out_ptr,
    block_table_ptr, seq_lens_ptr, page_start_ptr, cu_seqlens_k_ptr,
    stride_cache_block, stride_cache_row, stride_out_row, stride_table_row,
    BLOCK_SIZE: tl.constexpr, ROW_WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr, HAS_PAGE_START: tl.constexpr,
):
    page = tl.program_id(0)
    req = tl.program_id(1)
    chunk = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + req)
    first_page = 0
    if HAS_PAGE_START:
        first_page = tl.load(page_start_ptr + req)
    token0 = (first_page + page) * BLOCK_SIZE
    if token0 < seq_len:
        block_id = tl.load(block_table_ptr + req.to(tl.int64) * stride_table_row
                           + first_page + page).to(tl.int64)
        out_row0 = tl.load(cu_seqlens_k_ptr + req).to(tl.int64) + page * BLOCK_SIZE

        rows = tl.arange(0, BLOCK_ROWS)
        cols = chunk * BLOCK_W + tl.arange(0, BLOCK_W)
        row_ok = (rows < BLOCK_SIZE) & (token0 + rows < seq_len)
        mask = row_ok[:, None] & (cols < ROW_WIDTH)[None, :]
        src = block_id * stride_cache_block + rows[:, None].to(tl.int64) * stride_cache_row \
            + cols[None, :]
        dst = (out_row0 + rows[:, None]) * stride_out_row + cols[None, :]
        tl.store(k_out_ptr + dst, tl.load(k_cache_ptr + src, mask=mask), mask=mask)
        tl.store(v_out_ptr + dst, tl.load(v_cache_ptr + src, mask=mask), mask=mask)


def _check_rows_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        raise ValueError(f"{name}: its (num_kv_heads, head_size) dims must be contiguous, got "
                         f"shape {tuple(t.shape)} strides {t.stride()}")


def paged_gather(k_cache: torch.Tensor, v_cache: torch.Tensor, k_out: torch.Tensor,
                 v_out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_pages: int,
                 page_start: torch.Tensor | None = None) -> None:
    """Copy the context of `len(seq_lens)` requests from k_cache/v_cache
    [num_blocks, block_size, Hkv, D] into k_out/v_out [rows, Hkv, D] at the row offsets
    `cu_seqlens_k` [B+1] (see the module docstring). `max_pages` bounds the pages any request
    copies (ceil((seq_len - page_start * block_size) / block_size)); a larger bound only
    costs empty programs. No host sync; the caller guarantees k_out holds cu_seqlens_k[B]
    rows."""
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_pages <= 0:
        return
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_out.stride() != v_out.stride():
        raise ValueError("k_out and v_out must have the same strides")
    if k_out.dtype != k_cache.dtype or v_out.dtype != v_cache.dtype:
        raise ValueError("gather outputs must have the cache's dtype")
    for name, t in (("k_cache", k_cache), ("k_out", k_out)):
        _check_rows_contiguous(name, t)
    _, block_size, num_kv_heads, head_size = k_cache.shape
    row_width = num_kv_heads * head_size
    block_rows = triton.next_power_of_2(block_size)
    # About 4K elements a program: enough bytes in flight per program, no register spills.
    block_w = max(16, min(triton.next_power_of_2(row_width), 4096 // block_rows))
    grid = (max_pages, num_reqs, triton.cdiv(row_width, block_w))
    has_page_start = page_start is not None
    _paged_gather_kernel[grid](
        k_cache, v_cache, k_out, v_out,
        block_table, seq_lens, page_start if has_page_start else seq_lens, cu_seqlens_k,
        k_cache.stride(0), k_cache.stride(1), k_out.stride(0), block_table.stride(0),
        BLOCK_SIZE=block_size, ROW_WIDTH=row_width, BLOCK_ROWS=block_rows, BLOCK_W=block_w,
        HAS_PAGE_START=has_page_start, num_warps=4,
    )
