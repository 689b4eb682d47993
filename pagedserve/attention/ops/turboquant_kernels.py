"""Triton kernels of the TurboQuant KV cache (format: turboquant_format.py, the reference).

Kernel `_tq_store_kernel`
  grid:    (cdiv(num_tokens, BLOCK_T), num_kv_heads)
  tiling:  a program takes BLOCK_T new tokens of one KV head: it loads their K and V [BLOCK_T, D],
           rotates them with one tl.dot against the explicit rotation matrix (fp32, ieee), takes
           the norms (or min/max for uniform codes), quantizes every coordinate (a compare per
           Lloyd-Max boundary, an fp8 cast, or rounding), packs the codes into whole-byte groups
           (a weighted sum of shifted codes per group) and writes codes and fp16 meta bytes into
           the token's slot. Slots of -1 are skipped.

Kernel `_tq_attention_kernel`
  grid:    (num_kv_heads, num_query_blocks)
  tiling:  as unified_attention: a program takes BLOCK_Q consecutive new tokens of one request
           and all query heads of its KV group (BLOCK_M rows). Two phases:
             1. the cached context [lo, context): the query is rotated once (tl.dot with R^T),
                each BLOCK_N-key tile is read from the packed pages through the block table and
                decoded in registers (8- and 4-bit codes as one contiguous run of bytes per
                record; codes -> codebook levels), scored against the rotated query with each
                key's scale applied to its scores (and each value's to its probabilities, not
                to every element); online softmax (base 2, fp32) accumulates the rotated-domain
                values. Then the accumulator is rotated back (one tl.dot with R).
             2. the step's new tokens [context, seq_len) at full precision, read from the key and
                value inputs (they are attended exactly, never through the cache), causally.
           No full-precision copy of the cache exists anywhere.
  layout:  query/key/value/out [T, H or Hkv, D] (any strides); cache uint8
           [num_blocks, Hkv, block_size, slot_bytes]; slot = [K codes | K meta | V codes | V meta].
  dtypes:  fp32/fp16/bf16 activations. UPCAST keeps the dots in fp32 (fp32 models and the
           interpreter, whose bf16 is broken); otherwise tiles go to the input dtype for tensor
           cores with fp32 accumulation. Rotations always run in fp32 (ieee).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.attention.ops.fp8 import fp32_to_e4m3_bits
from pagedserve.attention.ops.turboquant_format import (
    KVPreset,
    VectorCodec,
    codebook_boundaries,
    codebook_levels,
    rotation_matrix,
)
from pagedserve.attention.ops.unified_attention import TileConfig

KIND_LLOYD_MAX, KIND_FP8, KIND_UNIFORM = 0, 1, 2
_KIND_IDS = {"lloyd_max": KIND_LLOYD_MAX, "fp8": KIND_FP8, "uniform": KIND_UNIFORM}

DECODE_TILES = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
PREFILL_TILES = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
INTERPRETER_TILES = TileConfig(block_m=16, block_n=32, num_warps=1, num_stages=1)


@dataclass
class FormatTensors:
    """Device-resident constants of a preset at one head size."""

    rot: torch.Tensor  # R [d, d]: y = R x
    rot_t: torch.Tensor  # R^T, contiguous
    k_levels: torch.Tensor
    v_levels: torch.Tensor
    k_bounds: torch.Tensor
    v_bounds: torch.Tensor


def format_tensors(preset: KVPreset, head_size: int, device: torch.device) -> FormatTensors:
    rot = rotation_matrix(head_size, device=device)

    def table(t: torch.Tensor) -> torch.Tensor:  # never empty: kernels take a pointer
        return (t if t.numel() else torch.zeros(1)).to(device=device, dtype=torch.float32)

    return FormatTensors(rot, rot.T.contiguous(),
                         table(codebook_levels(preset.key)), table(codebook_levels(preset.value)),
                         table(codebook_boundaries(preset.key)),
                         table(codebook_boundaries(preset.value)))


def _codec_args(prefix: str, codec: VectorCodec, head_size: int,
                packing: bool = False) -> dict[str, int]:
    args = {f"{prefix}_KIND": _KIND_IDS[codec.kind], f"{prefix}_BITS": codec.bits,
            f"{prefix}_CODE_BYTES": codec.code_bytes(head_size)}
    if packing:
        args[f"{prefix}_GROUP"] = 8 // math.gcd(8, codec.bits)
    return args


# ---- store ------------------------------------------------------------------------------------

@triton.jit
def _store_fp16_bytes(ptr, x, mask):
    bits = x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    tl.store(ptr, (bits & 255).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, ((bits >> 8) & 255).to(tl.uint8), mask=mask)


@triton.jit
def _quantize_pack_store(
    x, rec_ptr, ok, rot_t, bounds_ptr,
    HEAD_SIZE: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
    CODE_BYTES: tl.constexpr, G: tl.constexpr, ROTATED: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """x [BLOCK_T, D] fp32; rec_ptr [BLOCK_T] pointers to each token's record. G: codes per
    whole-byte group (8 bits: 1, 4 bits: 2, 3 bits: 8)."""
    if KIND == 2:  # uniform between the vector's min and max
        lo = tl.min(x, 1)
        hi = tl.max(x, 1)
        scale = ((hi - lo) / ((1 << BITS) - 1)).to(tl.float16).to(tl.float32)
        lo = lo.to(tl.float16).to(tl.float32)
        safe = tl.where(scale > 0.0, scale, 1.0)
        q = tl.floor((x - lo[:, None]) / safe[:, None] + 0.5)
        codes = tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1).to(tl.int32)
        _store_fp16_bytes(rec_ptr + CODE_BYTES, scale, ok)
        _store_fp16_bytes(rec_ptr + CODE_BYTES + 2, lo, ok)
    else:
        if ROTATED:
            y = tl.dot(x, rot_t, input_precision="ieee")
        else:
            y = x
        norm = tl.sqrt(tl.sum(y * y, 1))
        unit = y * (tl.sqrt(float(HEAD_SIZE)) / tl.maximum(norm, 1e-30))[:, None]
        if KIND == 1:
            codes = fp32_to_e4m3_bits(unit)
        else:
            codes = tl.zeros([BLOCK_T, HEAD_SIZE], dtype=tl.int32)
            for i in tl.static_range((1 << BITS) - 1):
                codes += (unit > tl.load(bounds_ptr + i)).to(tl.int32)
        _store_fp16_bytes(rec_ptr + CODE_BYTES, tl.minimum(norm, 65504.0), ok)

    # Whole-byte groups: G codes make NB bytes (8 bits: 1/1, 4: 2/1, 3: 8/3).
    NB: tl.constexpr = G * BITS // 8
    groups = tl.arange(0, HEAD_SIZE // G)
    if G == 1:
        word = codes
    else:
        shifts = tl.arange(0, G) * BITS
        word = tl.sum(tl.reshape(codes, [BLOCK_T, HEAD_SIZE // G, G]) << shifts[None, None, :],
                      2)
    for k in tl.static_range(NB):
        tl.store(rec_ptr[:, None] + groups[None, :] * NB + k,
                 ((word >> (8 * k)) & 255).to(tl.uint8), mask=ok[:, None])


@triton.jit
def _tq_store_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, rot_t_ptr, k_bounds_ptr, v_bounds_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ch, stride_cs,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    ROTATED: tl.constexpr, V_OFF: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr, K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_CODE_BYTES: tl.constexpr, V_GROUP: tl.constexpr,
):
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    ok = slots >= 0
    offs_d = tl.arange(0, HEAD_SIZE)
    tok = tokens.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok * stride_kt + head * stride_kh + offs_d[None, :] * stride_kd,
                mask=ok[:, None], other=0.0).to(tl.float32)
    v = tl.load(value_ptr + tok * stride_vt + head * stride_vh + offs_d[None, :] * stride_vd,
                mask=ok[:, None], other=0.0).to(tl.float32)
    rot_t = tl.load(rot_t_ptr + offs_d[:, None] * HEAD_SIZE + offs_d[None, :])
    rec = cache_ptr + (slots // BLOCK_SIZE) * stride_cb + head * stride_ch \
        + (slots % BLOCK_SIZE) * stride_cs
    _quantize_pack_store(k, rec, ok, rot_t, k_bounds_ptr, HEAD_SIZE, K_KIND, K_BITS,
                         K_CODE_BYTES, K_GROUP, ROTATED, BLOCK_T)
    _quantize_pack_store(v, rec + V_OFF, ok, rot_t, v_bounds_ptr, HEAD_SIZE, V_KIND, V_BITS,
                         V_CODE_BYTES, V_GROUP, ROTATED, BLOCK_T)


def tq_store(preset: KVPreset, tensors: FormatTensors, key: torch.Tensor, value: torch.Tensor,
             kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_t: int = 16) -> None:
    """Rotate, quantize and pack key/value [T, Hkv, D] into kv_cache [blocks, Hkv, block_size,
    slot_bytes] at slot_mapping [T] (-1 = skip). Only the first len(slot_mapping) tokens."""
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _tq_store_kernel[grid](
        key, value, kv_cache, slot_mapping, tensors.rot_t, tensors.k_bounds, tensors.v_bounds,
        num_tokens, *key.stride(), *value.stride(),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_SIZE=kv_cache.shape[2], HEAD_SIZE=head_size, BLOCK_T=block_t,
        ROTATED=preset.rotated, V_OFF=preset.value_offset(head_size),
        **_codec_args("K", preset.key, head_size, packing=True),
        **_codec_args("V", preset.value, head_size, packing=True),
        num_warps=4,
    )


# ---- attention --------------------------------------------------------------------------------

@triton.jit
def _load_fp16_bytes(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_codes(rec, ok, HEAD_SIZE: tl.constexpr, BITS: tl.constexpr,
                CODE_BYTES: tl.constexpr):
    """rec [BLOCK_N] pointers to records -> codes [BLOCK_N, D] int32 in channel order. 8- and
    4-bit codes load each record's code bytes once as one contiguous run (vectorisable; a
    4-bit byte is split into its two nibbles and interleaved back into channel order); other
    widths load, per channel, the byte (or two) holding its code."""
    if BITS == 8:
        offs = tl.arange(0, HEAD_SIZE)
        codes = tl.load(rec[:, None] + offs[None, :], mask=ok[:, None], other=0).to(tl.int32)
    elif BITS == 4:
        offs = tl.arange(0, CODE_BYTES)
        b = tl.load(rec[:, None] + offs[None, :], mask=ok[:, None], other=0).to(tl.int32)
        codes = tl.interleave(b & 15, b >> 4)
    else:
        offs_d = tl.arange(0, HEAD_SIZE)
        byte = offs_d * BITS // 8
        shift = offs_d * BITS % 8
        word = tl.load(rec[:, None] + byte[None, :], mask=ok[:, None], other=0).to(tl.int32)
        if 8 % BITS != 0:  # a code may straddle two bytes
            nxt = tl.load(rec[:, None] + byte[None, :] + 1,
                          mask=ok[:, None] & (byte + 1 < CODE_BYTES)[None, :], other=0)
            word = word | (nxt.to(tl.int32) << 8)
        codes = (word >> shift[None, :]) & ((1 << BITS) - 1)
    return codes


@triton.jit
def _load_dequantized(
    rec, ok, levels_ptr,
    HEAD_SIZE: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, CODE_BYTES: tl.constexpr,
):
    """rec [BLOCK_N] pointers to records -> (values [BLOCK_N, D] fp32, scale [BLOCK_N] fp32):
    the storage-domain vectors are values * scale[:, None]. Scaled codecs (Lloyd-Max, fp8)
    return the unit codes and the per-vector scale, which the caller folds into the scores (K)
    or the probabilities (V) instead of multiplying every element; uniform codes return the
    dequantized vectors and a scale of 1."""
    codes = _load_codes(rec, ok, HEAD_SIZE, BITS, CODE_BYTES)
    if KIND == 1:
        unit = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        unit = tl.load(levels_ptr + codes)
    first = _load_fp16_bytes(rec + CODE_BYTES, ok)
    if KIND == 2:
        lo = _load_fp16_bytes(rec + CODE_BYTES + 2, ok)
        return unit * first[:, None] + lo[:, None], tl.full(first.shape, 1.0, tl.float32)
    return unit, first * (1.0 / tl.sqrt(float(HEAD_SIZE)))


@triton.jit
def _softmax_step(acc, l_i, m_i, q, k, k_scale, v, v_scale, seen, sm_scale, soft_cap,
                  USE_SOFT_CAP: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax tile: q [M, D], k/v [N, D] fp32 scaled per key by k_scale/v_scale
    [N] (the keys are k * k_scale[:, None]), seen [M, N]."""
    if UPCAST:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = s * k_scale[None, :]
    if USE_SOFT_CAP:
        s = soft_cap * (2.0 * tl.sigmoid(2.0 * s * (sm_scale / soft_cap)) - 1.0) \
            * 1.4426950408889634
    else:
        s = s * (sm_scale * 1.4426950408889634)
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    p = p * v_scale[None, :]
    if UPCAST:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
    return acc, l_i, m_new


@triton.jit
def _tq_attention_kernel(
    q_ptr, key_ptr, value_ptr, cache_ptr, out_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr, qblock_req_ptr, qblock_start_ptr,
    rot_ptr, rot_t_ptr, k_levels_ptr, v_levels_ptr,
    sm_scale, soft_cap, window,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_ch, stride_cs, stride_bt,
    QPK: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, UPCAST: tl.constexpr,
    ROTATED: tl.constexpr, V_OFF: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_CODE_BYTES: tl.constexpr,
):
    kv_head = tl.program_id(0)
    qblock = tl.program_id(1)
    req = tl.load(qblock_req_ptr + qblock)
    q_off = tl.load(qblock_start_ptr + qblock)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_off + rows // QPK
    head = kv_head * QPK + rows % QPK
    row_ok = (rows < BLOCK_Q * QPK) & (q_idx < q_len)
    q_pos = context + q_idx
    offs_d = tl.arange(0, HEAD_SIZE)
    offs_n = tl.arange(0, BLOCK_N)
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_first = context + q_off
    hi = tl.minimum(q_first + BLOCK_Q, seq_len)
    if USE_WINDOW:
        lo = tl.maximum(q_first - window + 1, 0)
    else:
        lo = 0

    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # Phase 1: the quantized context, scored against the rotated query.
    if ROTATED:
        rot_t = tl.load(rot_t_ptr + offs_d[:, None] * HEAD_SIZE + offs_d[None, :])
        q_ctx = tl.dot(q, rot_t, input_precision="ieee")
    else:
        q_ctx = q
    if not UPCAST:
        q_ctx = q_ctx.to(q_ptr.dtype.element_ty)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_base = cache_ptr + kv_head * stride_ch
    for tile in range((lo // BLOCK_N) * BLOCK_N, context, BLOCK_N):
        k_pos = tile + offs_n
        k_ok = (k_pos < context) & (k_pos >= lo)
        page = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        rec = head_base + page.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
        k, k_scale = _load_dequantized(rec, k_ok, k_levels_ptr, HEAD_SIZE, K_KIND, K_BITS,
                                       K_CODE_BYTES)
        v, v_scale = _load_dequantized(rec + V_OFF, k_ok, v_levels_ptr, HEAD_SIZE, V_KIND,
                                       V_BITS, V_CODE_BYTES)
        seen = k_ok[None, :]
        if USE_WINDOW:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q_ctx, k, k_scale, v, v_scale, seen,
                                      sm_scale, soft_cap, USE_SOFT_CAP, UPCAST)
    if ROTATED:
        rot = tl.load(rot_ptr + offs_d[:, None] * HEAD_SIZE + offs_d[None, :])
        acc = tl.dot(acc, rot, input_precision="ieee")

    # Phase 2: this step's own tokens at full precision, causally.
    ones = tl.full([BLOCK_N], 1.0, tl.float32)
    q_new = q
    if not UPCAST:
        q_new = q.to(q_ptr.dtype.element_ty)
    for tile in range(tl.maximum(context, lo), hi, BLOCK_N):
        k_pos = tile + offs_n
        k_ok = k_pos < hi
        kv_tok = (q_start + k_pos - context).to(tl.int64)
        k = tl.load(key_ptr + kv_tok[:, None] * stride_kt + kv_head * stride_kh
                    + offs_d[None, :] * stride_kd, mask=k_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(value_ptr + kv_tok[:, None] * stride_vt + kv_head * stride_vh
                    + offs_d[None, :] * stride_vd, mask=k_ok[:, None], other=0.0).to(tl.float32)
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q_new, k, ones, v, ones, seen, sm_scale,
                                      soft_cap, USE_SOFT_CAP, UPCAST)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def select_tiles(device: torch.device, decode_only: bool) -> TileConfig:
    if device.type == "cpu":
        return INTERPRETER_TILES
    return DECODE_TILES if decode_only else PREFILL_TILES


def tq_attention(
    preset: KVPreset, tensors: FormatTensors, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, qblock_req: torch.Tensor,
    qblock_start: torch.Tensor, num_qblocks: int, block_q: int, block_m: int, scale: float,
    tiles: TileConfig, sliding_window: int | None = None, soft_cap: float | None = None,
) -> None:
    """Attention of query [T, H, D] over the packed cache (context) and key/value [T, Hkv, D]
    (the step's new tokens, full precision) into out [T, H, D]. qblock_req/qblock_start: the
    per-step map of unified_attention.query_block_map. All sizes are host ints: no sync."""
    if num_qblocks == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[1]
    upcast = query.dtype == torch.float32 or query.device.type == "cpu"
    _tq_attention_kernel[(num_kv_heads, num_qblocks)](
        query, key, value, kv_cache, out,
        block_table, query_start_loc, seq_lens, qblock_req, qblock_start,
        tensors.rot, tensors.rot_t, tensors.k_levels, tensors.v_levels,
        scale, soft_cap or 0.0, sliding_window or 0,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0),
        QPK=num_heads // num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        UPCAST=upcast, ROTATED=preset.rotated, V_OFF=preset.value_offset(head_size),
        **_codec_args("K", preset.key, head_size), **_codec_args("V", preset.value, head_size),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
