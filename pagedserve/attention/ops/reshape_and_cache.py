"""Write a step's new K/V into the paged cache through the slot mapping.

Kernel `_reshape_and_cache_kernel`
  grid:    (cdiv(num_tokens, BLOCK_T),)
  tiling:  each program copies BLOCK_T tokens; a token's heads and channels are one flat row of
           num_kv_heads * head_size elements (padded to a power of two, masked), so a program moves
           a [BLOCK_T, HD_PAD] tile of K and one of V.
  layout:  key/value [T, Hkv, D] with any strides (a view of a fused qkv projection is fine);
           k_cache/v_cache [num_blocks, block_size, Hkv, D] with any strides; slot s lands at
           block s // block_size, offset s % block_size. Slots of -1 (padding) are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens, mask=in_range, other=-1).to(tl.int64)
    valid = slots >= 0
    flat = tl.arange(0, HD_PAD)
    head = flat // HEAD_SIZE
    chan = flat % HEAD_SIZE
    mask = valid[:, None] & (flat < HD)[None, :]
    tok = tokens.to(tl.int64)[:, None]

    k = tl.load(key_ptr + tok * stride_kt + head * stride_kh + chan * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + head * stride_vh + chan * stride_vd, mask=mask)
    block = slots // BLOCK_SIZE
    offset = slots % BLOCK_SIZE
    dst = (block * stride_cb + offset * stride_cs)[:, None] + head * stride_ch + chan * stride_cd
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      block_t: int | None = None) -> None:
    """Scatter key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] at
    `slot_mapping` [T] (int32/int64, -1 = skip). Only the first len(slot_mapping) tokens are
    written. No host sync."""
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    _, block_size, num_kv_heads, head_size = k_cache.shape
    hd = num_kv_heads * head_size
    hd_pad = triton.next_power_of_2(hd)
    if block_t is None:
        # ~8K elements per program on a GPU; the interpreter prefers few, large programs.
        block_t = 64 if key.device.type == "cpu" else max(1, min(64, 8192 // hd_pad))
    grid = (triton.cdiv(num_tokens, block_t),)
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        *key.stride(), *value.stride(), *k_cache.stride(),
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HD=hd, HD_PAD=hd_pad, BLOCK_T=block_t,
        num_warps=4,
    )
