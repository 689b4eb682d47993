"""Write a step's new K/V into the paged cache through the slot mapping.

Kernel `_reshape_and_cache_kernel`
  grid:    (cdiv(num_tokens, BLOCK_T),)
  tiling:  each program copies BLOCK_T tokens; a token's heads and channels are one flat row of
           num_kv_heads * head_size elements (padded to a power of two, masked), so a program moves
           a [BLOCK_T, HD_PAD] tile of K and a [BLOCK_T, HDV_PAD] one of V (V's head size may
           differ from K's: HEAD_SIZE_V).
  layout:  key [T, Hkv, D] and value [T, Hkv, D_v] with any strides (a view of a fused qkv
           projection is fine); when a token's heads are packed (strides D, 1), the [Hkv * D]
           row is addressed as one contiguous run so loads and stores vectorise;
           k_cache [num_blocks, block_size, Hkv, D] and v_cache [..., D_v] with any strides, the
           same for both; slot s lands at block s // block_size, offset s % block_size. Slots
           of -1 (padding) are skipped.
  dtype:   values are cast to the cache's dtype; an fp8 e4m3 cache (passed as its uint8 bytes)
           stores K * k_inv_scale and V * v_inv_scale, rounded from float32 as torch's cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.ops.fp8 import fp32_to_e4m3_bits


@triton.jit
def _row_offsets(tok, row, stride_t, stride_h, stride_d, stride_ch, stride_cd,
                 HEAD_SIZE: tl.constexpr, HD_PAD: tl.constexpr, FLAT_SRC: tl.constexpr,
                 FLAT_DST: tl.constexpr):
    """Source and cache offsets of one tensor's rows (K or V: Hkv * HEAD_SIZE channels flat,
    padded to HD_PAD) for the tokens `tok` [BLOCK_T, 1] landing at cache rows `row`."""
    flat = tl.arange(0, HD_PAD)
    head = flat // HEAD_SIZE
    chan = flat % HEAD_SIZE
    if FLAT_SRC:  # heads packed in each token's row: the compiler sees contiguous runs
        src = tok * stride_t + flat
    else:
        src = tok * stride_t + head * stride_h + chan * stride_d
    if FLAT_DST:
        dst = row + flat
    else:
        dst = row + head * stride_ch + chan * stride_cd
    return src, dst


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens, k_inv_scale, v_inv_scale,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr, HDV: tl.constexpr, HDV_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, FP8: tl.constexpr, FLAT_SRC: tl.constexpr,
    FLAT_DST: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens, mask=in_range, other=-1).to(tl.int64)
    valid = slots >= 0
    tok = tokens.to(tl.int64)[:, None]
    row = ((slots // BLOCK_SIZE) * stride_cb + (slots % BLOCK_SIZE) * stride_cs)[:, None]
    k_src, k_dst = _row_offsets(tok, row, stride_kt, stride_kh, stride_kd, stride_ch,
                                stride_cd, HEAD_SIZE, HD_PAD, FLAT_SRC, FLAT_DST)
    v_src, v_dst = _row_offsets(tok, row, stride_vt, stride_vh, stride_vd, stride_ch,
                                stride_cd, HEAD_SIZE_V, HDV_PAD, FLAT_SRC, FLAT_DST)
    k_mask = valid[:, None] & (tl.arange(0, HD_PAD) < HD)[None, :]
    v_mask = valid[:, None] & (tl.arange(0, HDV_PAD) < HDV)[None, :]
    # Both loads before either store, so K's and V's reads are in flight together.
    k = tl.load(key_ptr + k_src, mask=k_mask)
    v = tl.load(value_ptr + v_src, mask=v_mask)
    if FP8:
        k = fp32_to_e4m3_bits(k.to(tl.float32) * k_inv_scale)
        v = fp32_to_e4m3_bits(v.to(tl.float32) * v_inv_scale)
    tl.store(k_cache_ptr + k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      block_t: int | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0, num_warps: int = 4) -> None:
    """Scatter key [T, Hkv, D] and value [T, Hkv, D_v] into k_cache [num_blocks, block_size,
    Hkv, D] and v_cache [..., D_v] (the same strides: K/V outermost, or the halves of one
    side-by-side buffer) at `slot_mapping` [T] (int32/int64, -1 = skip), storing K / k_scale
    and V / v_scale. Only the first len(slot_mapping) tokens are written. No host sync."""
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    elif k_cache.element_size() == 1:
        raise ValueError(f"reshape_and_cache writes fp8 caches as e4m3 only, not {k_cache.dtype}")
    elif k_scale != 1.0 or v_scale != 1.0:
        raise ValueError("k_scale/v_scale apply to an fp8 cache only")
    _, block_size, num_kv_heads, head_size = k_cache.shape
    head_size_v = v_cache.shape[3]
    hd, hdv = num_kv_heads * head_size, num_kv_heads * head_size_v
    hd_pad = triton.next_power_of_2(max(hd, hdv))
    if block_t is None:
        # ~8K elements per program on a GPU; the interpreter prefers few, large programs.
        block_t = 64 if key.device.type == "cpu" else max(1, min(64, 8192 // hd_pad))
    grid = (triton.cdiv(num_tokens, block_t),)
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, num_tokens, 1.0 / k_scale, 1.0 / v_scale,
        *key.stride(), *value.stride(), *k_cache.stride(),
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HD=hd, HD_PAD=triton.next_power_of_2(hd),
        HEAD_SIZE_V=head_size_v, HDV=hdv, HDV_PAD=triton.next_power_of_2(hdv),
        BLOCK_T=block_t, FP8=fp8, FLAT_SRC=_heads_packed(key) and _heads_packed(value),
        FLAT_DST=_heads_packed(k_cache) and _heads_packed(v_cache), num_warps=num_warps,
    )


def _heads_packed(x: torch.Tensor) -> bool:
    """A token's heads and channels form one contiguous row (strides D, 1 on the last dims), so
    the kernel can address [Hkv * D] as one run and vectorise its loads and stores."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
