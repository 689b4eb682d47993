"""Triton kernels of the TurboQuant KV cache (format: turboquant_format.py, the reference).

Cache layout (turboquant_format): uint8 [num_blocks, Hkv, block_size, slot_bytes], where each
(block, KV head) region of block_size * slot_bytes bytes is a structure of arrays:
  [K code rows: block_size x K code bytes][V code rows][K metas: fp16 x block_size][V metas]
(uniform codes have two fp16 metas per token: scale, min). Code rows are 16-byte aligned for the
usual shapes (block_size * slot_bytes and the code bytes per row multiples of 16, e.g. d128 and
block size 16), so a row is read with 16-byte vector loads; metas are read as fp16 through a
float16 view of the same cache.

Kernel `_tq_store_kernel`
  grid:    (cdiv(num_tokens, BLOCK_T), num_kv_heads)
  tiling:  a program takes BLOCK_T new tokens of one KV head: it loads their K and V [BLOCK_T, D],
           rotates them (`_hadamard`: tensor-core products with the +-1 Hadamard matrix), takes
           the norms (or min/max for uniform codes), quantizes every coordinate (a compare per
           Lloyd-Max boundary, an fp8 cast, or rounding), packs the codes into whole-byte groups
           (a weighted sum of shifted codes per group) and writes each token's code row into the
           K (V) code plane and its fp16 meta into the K (V) meta plane. Slots of -1 are skipped.

Kernel `_tq_attention_kernel`
  grid:    (num_kv_heads, num_query_blocks, num_splits)
  tiling:  as unified_attention: a program takes BLOCK_Q consecutive new tokens of one request
           and all query heads of its KV group (BLOCK_M rows). Two phases:
             1. the cached context [lo, context): the query is rotated once (q R^T), each
                BLOCK_N-key tile is read from the planes through the block table: per key
                one contiguous code row (8 and 4 bits: one vector load run; 3 bits: three
                strided byte loads, one per byte of the 8-code groups) and one fp16 meta. Codes
                are unpacked in registers (the packed words replicated to channel order with
                tl.interleave, then shifted and masked) and mapped to codebook levels by
                LOOKUP: 0 (table) loads the level from a 2^bits-entry table in the dot dtype
                (an L1-resident gather: 64-bit address + load per element), 1 (select) picks it
                from the levels with a binary tree of selects on the code bits (registers only;
                3 and 4 bits, else the table), 2 (gather) uses tl.gather on the levels
                broadcast over the tile's rows (warp shuffles; up to 4 bits, else the table),
                3 (prmt, Lloyd-Max 3 and 4 bits) reads each row as words of 8 codes and looks
                the levels up with PTX byte permutes of the codebook held in registers (~3
                integer ops per code, no shuffles or shared memory; in the interpreter, which
                has no inline PTX, the same path with loads for lookups). fp8 codes are
                bitcast, uniform codes converted and scaled. Each key's scale is
                applied to its scores, each value's to its probabilities (not to every
                element). Scores against the rotated query, online softmax (base 2, fp32), the
                values accumulate in the rotated domain; the accumulator is rotated back once.
                Both rotations are products with the +-1 Hadamard matrix H (R = H D / sqrt(d),
                D the sign diagonal) on tensor cores, H exact in fp16 and the operand split into
                two fp16 terms (`_hadamard`: fp32 accuracy, no [d, d] fp32 operand in
                registers).
             2. the step's new tokens [context, seq_len) at full precision, read from the key and
                value inputs (they are attended exactly, never through the cache), causally.
                MERGE_NEW (prefill steps): a dense kernel (unified_attention) has attended the
                new tokens already, writing out and each row's base-2 log-sum-exp; phase 2 is
                skipped and the context's (m, l, acc) merge into out by their weights
                (rows of requests without context are left alone).
           Split-KV decode (num_splits > 1, block_q 1): the context tiles are cut into
           num_splits whole-tile ranges, one per program; each rotates its accumulator back
           and writes its (m, l, acc) partials, the last split alone also attending the new
           tokens, and decode_split_kv.reduce_split_kv merges them.
           Register prefetch (TQTiles.prefetch, the decode default): phase 1's loop issues
           the next tile's code and meta loads (`_load_raw`) before computing the current
           one (`_decode_vectors`) and the page numbers two tiles ahead; only the page-number
           loads are masked (keys past the context read page 0, their scores -inf and value
           scales 0). In that loop fp8 rows are int32 words converted by cvt.f16x2.e4m3x2
           and 3-bit rows int32 words of 12-byte chunks, whose levels come in a chunk order
           (`_prmt3_chunks`) that the query takes once and the accumulator undoes after it.
           No full-precision copy of the cache exists anywhere. Launch shape: `TQTiles`
           (block_m, block_n, num_warps, num_stages, lookup, max_regs, prefetch);
           `TQTiles.parse("16/32/4/1/prmt/128/1")`.
  layout:  query/key/value/out [T, H or Hkv, D] (any strides); cache as above (its
           [block_size, slot_bytes] plane contiguous).
  dtypes:  fp32/fp16/bf16 activations. UPCAST keeps the dots in fp32 (fp32 models and the
           interpreter, whose bf16 is broken); otherwise the level tables are in the input dtype
           and tiles go to it for tensor cores with fp32 accumulation. Rotations have fp32
           accuracy whatever the dtype.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from pagedserve.attention.ops.fp8 import fp32_to_e4m3_bits
from pagedserve.attention.ops.turboquant_format import (
    KVPreset,
    VectorCodec,
    codebook_boundaries,
    codebook_levels,
    fwht,
    hadamard_signs,
)

KIND_LLOYD_MAX, KIND_FP8, KIND_UNIFORM = 0, 1, 2
_KIND_IDS = {"lloyd_max": KIND_LLOYD_MAX, "fp8": KIND_FP8, "uniform": KIND_UNIFORM}
# The attention kernel's codebook lookup (module docstring).
LOOKUPS = {"table": 0, "select": 1, "gather": 2, "prmt": 3}
PRMT_STAND_IN = 4  # 'prmt' where there is no inline PTX: the same code path, loads for lookups


@dataclass(frozen=True)
class TQTiles:
    """Launch shape of the attention kernel. block_m: target rows per program (query tokens x
    heads of one KV group; decode uses one token); block_n: keys per tile; lookup: 'table',
    'select', 'gather' or 'prmt' (module docstring); max_regs: a cap on the registers per
    thread (ptxas .maxnreg; 0: the compiler's choice), e.g. 128 at 8 warps for 2 programs
    per SM; prefetch: 1 loads each context tile's codes and metas one tile ahead into
    registers (and the page numbers two ahead), 0 leaves the loads to Triton's pipeliner
    (num_stages). Written and parsed as
    "block_m/block_n/warps/stages[/lookup[/max_regs[/prefetch]]]"."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    lookup: str = "table"
    max_regs: int = 0
    prefetch: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TQTiles.{name} must be a power of two, got {value}")
        if self.block_n < 16 or self.num_stages < 1:
            raise ValueError(f"TQTiles needs block_n >= 16 and num_stages >= 1: {self}")
        if self.lookup not in LOOKUPS:
            raise ValueError(f"TQTiles.lookup is one of {', '.join(LOOKUPS)}, got "
                             f"{self.lookup!r}")
        if self.max_regs and not 24 <= self.max_regs <= 255:
            raise ValueError(f"TQTiles.max_regs is 0 or 24..255, got {self.max_regs}")
        if self.prefetch not in (0, 1):
            raise ValueError(f"TQTiles.prefetch is 0 or 1, got {self.prefetch}")

    def __str__(self) -> str:
        text = f"{self.block_m}/{self.block_n}/{self.num_warps}/{self.num_stages}/{self.lookup}"
        if self.prefetch:
            return f"{text}/{self.max_regs}/{self.prefetch}"
        return f"{text}/{self.max_regs}" if self.max_regs else text

    @classmethod
    def parse(cls, text: str) -> TQTiles:
        """"16/64/4/2", "16/64/4/2/select", "16/64/8/2/prmt/128" or "16/32/4/1/prmt/128/1"
        -> TQTiles."""
        parts = text.strip().split("/")
        if len(parts) not in (4, 5, 6, 7):
            raise ValueError(f"tile config {text!r}: want "
                             f"block_m/block_n/warps/stages[/lookup[/max_regs[/prefetch]]]")
        try:
            numbers = [int(x) for x in parts[:4]]
            extra = [int(x) for x in parts[5:]]
        except ValueError:
            raise ValueError(f"tile config {text!r}: the first four fields, max_regs and "
                             f"prefetch are integers") from None
        return cls(*numbers, *parts[4:5], *extra)


# Decode: the H200 sweep (benchmarks/kv_quant_quality.py --kernel-bench --tq-tiles sweep;
# 64 x 8,192, d128, bf16; bf16 TRITON 564 us). Before 'prmt': 16/64/8/2/gather 1,076 us
# (tq_k8v4), 1,489 (tq_4bit), 1,686 (tq_3bit). With 'prmt' the best single-program shape was
# 16/32/4/2/prmt/128: 723, 886 and 1,374 us, still latency bound (~1/3 of the issue rate:
# the pipeliner's cp.async copies of a tile were waited for at the top of the next one, and
# the metas and page numbers were plain loads used in the same tile). Not yet timed on a GPU:
# the same shape with the register prefetch (prefetch 1; num_stages 1, as the loads are
# issued by hand a tile ahead), which takes every global load out of a tile's dependency
# chain at 4-8% more instructions per key (scripts/tq_kernel_resources.py).
DECODE_TILES = TQTiles(block_m=16, block_n=32, num_warps=4, num_stages=1, lookup="prmt",
                       max_regs=128, prefetch=1)
PREFILL_TILES = TQTiles(block_m=64, block_n=64, num_warps=8, num_stages=2)  # 4 warps spill
INTERPRETER_TILES = TQTiles(block_m=16, block_n=32, num_warps=1, num_stages=1)


@dataclass
class FormatTensors:
    """Device-resident constants of a preset at one head size."""

    signs: torch.Tensor  # the rotation's +-1 diagonal D, float32 [d]: R = H D / sqrt(d)
    hadamard: torch.Tensor  # H, the +-1 Sylvester Hadamard matrix, float16 [d, d] (exact)
    k_levels: torch.Tensor  # float32 codebooks (never empty: kernels take a pointer)
    v_levels: torch.Tensor
    k_bounds: torch.Tensor
    v_bounds: torch.Tensor
    _tables: dict = field(default_factory=dict, repr=False)
    _byte_tables: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            self._tables[dtype] = (self.k_levels.to(dtype), self.v_levels.to(dtype))
        for dtype in (torch.float16, torch.bfloat16):
            self._byte_tables[dtype] = tuple(byte_plane_table(t.to(dtype))
                                             for t in (self.k_levels, self.v_levels))

    def prmt_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) codebooks in `dtype` (float16 or bfloat16) as byte planes for the 'prmt'
        lookup: int32 [8] (`byte_plane_table`)."""
        return self._byte_tables[dtype]

    def level_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) codebooks in `dtype` (float32, float16 or bfloat16): what the attention
        kernel's lookup returns."""
        return self._tables[dtype]


def byte_plane_table(levels: torch.Tensor) -> torch.Tensor:
    """A codebook of up to 16 16-bit levels -> int32 [8]: words 0-3 hold the low bytes of the
    levels 4i..4i+3 (byte j of word i: level 4i + j), words 4-7 their high bytes, so that
    `prmt` picks a level's bytes by its code (entries past the codebook are 0)."""
    bits = torch.zeros(16, dtype=torch.int32)
    n = min(levels.numel(), 16)
    bits[:n] = levels.flatten()[:n].cpu().view(torch.int16).to(torch.int32) & 0xFFFF
    planes = torch.cat([bits & 0xFF, bits >> 8]).view(8, 4)
    words = (planes[:, 0] | planes[:, 1] << 8 | planes[:, 2] << 16
             | (planes[:, 3].to(torch.int64) << 24)).to(torch.int64)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).to(
        levels.device)


def format_tensors(preset: KVPreset, head_size: int, device: torch.device) -> FormatTensors:
    signs = hadamard_signs(head_size, device=device).float()
    hadamard = fwht(torch.eye(head_size)).to(device=device, dtype=torch.float16)

    def table(t: torch.Tensor) -> torch.Tensor:  # never empty: kernels take a pointer
        return (t if t.numel() else torch.zeros(1)).to(device=device, dtype=torch.float32)

    return FormatTensors(signs, hadamard,
                         table(codebook_levels(preset.key)), table(codebook_levels(preset.value)),
                         table(codebook_boundaries(preset.key)),
                         table(codebook_boundaries(preset.value)))


@functools.cache  # the launch arguments of a layer never change: computed once, not per launch
def _codec_args(prefix: str, codec: VectorCodec, head_size: int) -> dict[str, int]:
    return {f"{prefix}_KIND": _KIND_IDS[codec.kind], f"{prefix}_BITS": codec.bits,
            f"{prefix}_CODE_BYTES": codec.code_bytes(head_size),
            f"{prefix}_GROUP": 8 // math.gcd(8, codec.bits),
            f"{prefix}_META_N": codec.meta_bytes // 2}


def _layout_args(preset: KVPreset, kv_cache: torch.Tensor,
                 head_size: int) -> tuple[torch.Tensor, dict[str, int]]:
    """(float16 view of the cache, plane offsets: codes in bytes, metas in fp16 elements)."""
    num_blocks, num_kv_heads, block_size, slot_bytes = kv_cache.shape
    if (kv_cache.dtype != torch.uint8 or slot_bytes != preset.slot_bytes(head_size)
            or kv_cache.stride(3) != 1 or kv_cache.stride(2) != slot_bytes):
        raise ValueError(f"{preset.name} needs a uint8 cache [blocks, Hkv, block_size, "
                         f"{preset.slot_bytes(head_size)}] with contiguous blocks, got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    return kv_cache.view(torch.float16), _plane_args(preset, head_size, block_size)


@functools.cache
def _plane_args(preset: KVPreset, head_size: int, block_size: int) -> dict[str, int]:
    _, v_codes, k_meta, v_meta = preset.plane_offsets(head_size, block_size)
    return dict(V_CODES_OFF=v_codes, K_META_OFF=k_meta // 2, V_META_OFF=v_meta // 2)


# ---- store ------------------------------------------------------------------------------------

@triton.jit
def _hadamard(x, had):
    """x [M, D] fp32 @ H (had: the +-1 Hadamard matrix [D, D] in fp16) on tensor cores, as
    accurate as an fp32 product: each row of x, scaled into [-1, 1], is split into fp16
    hi + lo * 2^-11, whose products with +-1 are exact, and the dots accumulate in fp32. (An
    fp32 [D, D] dot operand would take 128 registers per thread at 4 warps and spill.)"""
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0.0, amax, 1.0)
    xs = x / scale[:, None]
    hi = xs.to(tl.float16)
    lo = ((xs - hi.to(tl.float32)) * 2048.0).to(tl.float16)
    y = tl.dot(hi, had) + tl.dot(lo, had) * (1.0 / 2048.0)
    return y * scale[:, None]


@triton.jit
def _quantize_pack_store(
    x, code_row, meta, ok, signs, had, bounds_ptr,
    HEAD_SIZE: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    ROTATED: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """x [BLOCK_T, D] fp32; code_row [BLOCK_T] pointers to each token's code row (uint8), meta
    [BLOCK_T] pointers to its first fp16 meta. G: codes per whole-byte group (8 bits: 1, 4 bits:
    2, 3 bits: 8)."""
    if KIND == 2:  # uniform between the vector's min and max
        lo = tl.min(x, 1)
        hi = tl.max(x, 1)
        scale = ((hi - lo) / ((1 << BITS) - 1)).to(tl.float16).to(tl.float32)
        lo = lo.to(tl.float16).to(tl.float32)
        safe = tl.where(scale > 0.0, scale, 1.0)
        q = tl.floor((x - lo[:, None]) / safe[:, None] + 0.5)
        codes = tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1).to(tl.int32)
        tl.store(meta, scale.to(tl.float16), mask=ok)
        tl.store(meta + 1, lo.to(tl.float16), mask=ok)
    else:
        if ROTATED:  # y = R x = H (D x) / sqrt(d), per row
            y = _hadamard(x * signs[None, :], had) * (1.0 / tl.sqrt(float(HEAD_SIZE)))
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
        tl.store(meta, tl.minimum(norm, 65504.0).to(tl.float16), mask=ok)

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
        tl.store(code_row[:, None] + groups[None, :] * NB + k,
                 ((word >> (8 * k)) & 255).to(tl.uint8), mask=ok[:, None])


@triton.jit
def _tq_store_kernel(
    key_ptr, value_ptr, cache_ptr, cache16_ptr, slot_ptr, signs_ptr, had_ptr, k_bounds_ptr,
    v_bounds_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ch, stride_cb16, stride_ch16,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    ROTATED: tl.constexpr,
    V_CODES_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr, K_GROUP: tl.constexpr,
    K_META_N: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_CODE_BYTES: tl.constexpr, V_GROUP: tl.constexpr,
    V_META_N: tl.constexpr,
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
    signs = tl.load(signs_ptr + offs_d)
    had = tl.load(had_ptr + offs_d[:, None] * HEAD_SIZE + offs_d[None, :])
    block = tl.where(ok, slots // BLOCK_SIZE, 0)
    row = tl.where(ok, slots % BLOCK_SIZE, 0)
    plane = cache_ptr + block * stride_cb + head * stride_ch
    plane16 = cache16_ptr + block * stride_cb16 + head * stride_ch16
    _quantize_pack_store(k, plane + row * K_CODE_BYTES, plane16 + K_META_OFF + row * K_META_N,
                         ok, signs, had, k_bounds_ptr, HEAD_SIZE, K_KIND, K_BITS, K_GROUP,
                         ROTATED,
                         BLOCK_T)
    _quantize_pack_store(v, plane + V_CODES_OFF + row * V_CODE_BYTES,
                         plane16 + V_META_OFF + row * V_META_N, ok, signs, had, v_bounds_ptr,
                         HEAD_SIZE, V_KIND, V_BITS, V_GROUP, ROTATED, BLOCK_T)


def tq_store(preset: KVPreset, tensors: FormatTensors, key: torch.Tensor, value: torch.Tensor,
             kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_t: int = 16) -> None:
    """Rotate, quantize and pack key/value [T, Hkv, D] into kv_cache [blocks, Hkv, block_size,
    slot_bytes] (plane layout) at slot_mapping [T] (-1 = skip). Only the first
    len(slot_mapping) tokens."""
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    cache16, layout = _layout_args(preset, kv_cache, head_size)
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _tq_store_kernel[grid](
        key, value, kv_cache, cache16, slot_mapping, tensors.signs, tensors.hadamard,
        tensors.k_bounds, tensors.v_bounds, num_tokens, *key.stride(), *value.stride(),
        kv_cache.stride(0), kv_cache.stride(1), cache16.stride(0), cache16.stride(1),
        BLOCK_SIZE=kv_cache.shape[2], HEAD_SIZE=head_size, BLOCK_T=block_t,
        ROTATED=preset.rotated, **layout,
        **_codec_args("K", preset.key, head_size), **_codec_args("V", preset.value, head_size),
        num_warps=4,
    )


# ---- attention --------------------------------------------------------------------------------

@triton.jit
def _load_code_bytes(row, ok, HEAD_SIZE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr):
    """row [BLOCK_N] pointers to code rows -> the row's raw bytes as up to three tensors (b0,
    b1, b2): a row is HEAD_SIZE / G groups of NB bytes holding G codes; b_k [BLOCK_N, D / G]
    uint8 holds byte k of every group (8 and 4 bits: NB = 1, one contiguous run per row, b1 and
    b2 are b0; 3 bits: NB = 3, one strided load per byte). Global loads only: `_unpack_codes`
    makes the codes, so that a caller can issue the loads a tile ahead."""
    NB: tl.constexpr = G * BITS // 8
    groups = tl.arange(0, HEAD_SIZE // G)
    ptrs = row[:, None] + groups[None, :] * NB
    b0 = tl.load(ptrs, mask=ok[:, None], other=0)
    b1 = b0
    b2 = b0
    if NB > 1:
        b1 = tl.load(ptrs + 1, mask=ok[:, None], other=0)
    if NB > 2:
        b2 = tl.load(ptrs + 2, mask=ok[:, None], other=0)
    return b0, b1, b2


@triton.jit
def _unpack_codes(b0, b1, b2, HEAD_SIZE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr):
    """`_load_code_bytes`'s bytes -> codes [BLOCK_N, D] in channel order (uint8 for 8 bits,
    else int32): the group words are replicated G times in channel order (tl.interleave with
    themselves) and each channel shifts its own code out."""
    NB: tl.constexpr = G * BITS // 8
    codes = b0
    if G > 1:
        word = b0.to(tl.int32)
        if NB > 1:
            word = word | (b1.to(tl.int32) << 8)
        if NB > 2:
            word = word | (b2.to(tl.int32) << 16)
        word = tl.interleave(word, word)
        if G >= 4:
            word = tl.interleave(word, word)
        if G >= 8:
            word = tl.interleave(word, word)
        shift = (tl.arange(0, HEAD_SIZE) % G) * BITS
        codes = (word >> shift[None, :]) & ((1 << BITS) - 1)
    return codes


@triton.jit
def _load_codes(row, ok, HEAD_SIZE: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr):
    """row [BLOCK_N] pointers to code rows -> codes [BLOCK_N, D] in channel order."""
    b0, b1, b2 = _load_code_bytes(row, ok, HEAD_SIZE, BITS, G)
    return _unpack_codes(b0, b1, b2, HEAD_SIZE, BITS, G)


# The 'prmt' lookup (CUDA only: inline PTX). A word holds 8 codes (4 bits: 8 nibbles; 3 bits: 24
# bits) in channel order; the codebook's 16-bit levels are held as byte planes in registers
# (`byte_plane_table`: L0-L3 the low bytes of levels 0-15, H0-H3 the high bytes), and `prmt`
# (byte permute) looks up the low or high bytes of 4 codes at once: its selector takes 4
# nibbles, bits 0-2 picking one of the 8 bytes of its two sources (bit 3 must be clear). For 4
# bits, levels 0-7 and 8-15 are looked up separately and a third prmt per plane picks byte k
# from the first or the second by bit 3 of code k; then the low and high bytes are paired into
# the 16-bit levels. ~3 integer ops per code, registers only (no shuffles, no shared memory).
_PRMT_PAIR = """
    prmt.b32 p, lo, hi, 0x5140;
    prmt.b32 q, lo, hi, 0x7362;
    mov.b32 {$%d, $%d}, p;
    mov.b32 {$%d, $%d}, q;"""
# 4 bits: the selectors of both halves are made once for the whole word (s: code bits 0-2,
# t: bit 3 picking the first or second lookup's byte); the upper half shifted down serves
# codes 4-7 (prmt reads only the low 16 bits of its selector).
_PRMT4_SELECT = """
    and.b32 sw, x, 0x77777777;
    shr.b32 tw, x, 1;
    lop3.b32 tw, tw, 0x44444444, 0x32103210, 0xEA;"""
_PRMT4_HALF = """
    prmt.b32 al, $9, $10, s;
    prmt.b32 bl, $11, $12, s;
    prmt.b32 ah, $13, $14, s;
    prmt.b32 bh, $15, $16, s;
    prmt.b32 lo, al, bl, t;
    prmt.b32 hi, ah, bh, t;"""
# 3 bits: the word's 8 codes are first spread to the 8 nibbles of one register in three
# shift-mask-merge steps (codes 4-7 up by 4, then 2-3 of each half by 2, then the odd ones by 1:
# 9 ops for 8 codes); prmt reads only the low 16 bits of its selector, so the spread word
# selects codes 0-3 and its upper half, shifted down, codes 4-7.
_PRMT3_SPREAD = """
    shl.b32 t, x, 4;
    and.b32 t, t, 0x0FFF0000;
    lop3.b32 x, x, 0xFFF, t, 0xEA;
    shl.b32 t, x, 2;
    and.b32 t, t, 0x3F003F00;
    lop3.b32 x, x, 0x003F003F, t, 0xEA;
    shl.b32 t, x, 1;
    and.b32 t, t, 0x70707070;
    lop3.b32 x, x, 0x07070707, t, 0xEA;"""
_PRMT3_HALF = """
    prmt.b32 lo, $9, $10, s;
    prmt.b32 hi, $13, $14, s;"""
PRMT4_ASM = tl.constexpr(
    "{\n    .reg .b32 x, s, t, sw, tw, al, bl, ah, bh, lo, hi, p, q;\n    mov.b32 x, $8;"
    + _PRMT4_SELECT + "\n    mov.b32 s, sw;\n    mov.b32 t, tw;"
    + _PRMT4_HALF + _PRMT_PAIR % (0, 1, 2, 3) + "\n    shr.b32 s, sw, 16;\n    shr.b32 t, tw, 16;"
    + _PRMT4_HALF + _PRMT_PAIR % (4, 5, 6, 7) + "\n}")
PRMT3_ASM = tl.constexpr(
    "{\n    .reg .b32 x, s, t, lo, hi, p, q;\n    mov.b32 x, $8;" + _PRMT3_SPREAD
    + "\n    mov.b32 s, x;" + _PRMT3_HALF + _PRMT_PAIR % (0, 1, 2, 3)
    + "\n    shr.b32 s, x, 16;" + _PRMT3_HALF + _PRMT_PAIR % (4, 5, 6, 7) + "\n}")
_PRMT_CONSTRAINTS = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 9))


@triton.constexpr_function
def _dtypes8(dtype):
    return (dtype,) * 8


# x + (laneid >> 5) (= x): a value that ptxas cannot prove warp-uniform, so that the prmt
# lookup's codebook words, loop invariants, stay in vector registers across the loop instead of
# uniform registers copied into vector registers for every lookup (an IMAD.U32 per operand).
_PER_LANE_ASM = tl.constexpr("""{
    .reg .b32 l;
    mov.u32 l, %laneid;
    shr.u32 l, l, 5;
    add.u32 $0, $1, l;
}""")


@triton.jit
def _per_lane(x):
    return tl.inline_asm_elementwise(_PER_LANE_ASM, "=r,r", [x], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _prmt8(word, table_ptr, BITS: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """words [N, G] of 8 codes each (code k at bit k * BITS) -> their 8 levels (o0..o7, code
    k in o_k) in DTYPE (16-bit); table_ptr: the codebook's byte planes (`byte_plane_table`,
    int32 [8]). Without ASM (the interpreter, which has no inline PTX) table_ptr is the plain
    level table and each code is a load from it."""
    if not ASM:
        m = (1 << BITS) - 1
        o0 = tl.load(table_ptr + (word & m))
        o1 = tl.load(table_ptr + ((word >> BITS) & m))
        o2 = tl.load(table_ptr + ((word >> (2 * BITS)) & m))
        o3 = tl.load(table_ptr + ((word >> (3 * BITS)) & m))
        o4 = tl.load(table_ptr + ((word >> (4 * BITS)) & m))
        o5 = tl.load(table_ptr + ((word >> (5 * BITS)) & m))
        o6 = tl.load(table_ptr + ((word >> (6 * BITS)) & m))
        o7 = tl.load(table_ptr + ((word >> (7 * BITS)) & m))
    else:
        t0, t1, t2, t3 = (_per_lane(tl.load(table_ptr)), _per_lane(tl.load(table_ptr + 1)),
                          _per_lane(tl.load(table_ptr + 2)), _per_lane(tl.load(table_ptr + 3)))
        t4, t5, t6, t7 = (_per_lane(tl.load(table_ptr + 4)), _per_lane(tl.load(table_ptr + 5)),
                          _per_lane(tl.load(table_ptr + 6)), _per_lane(tl.load(table_ptr + 7)))
        if BITS == 4:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                PRMT4_ASM, _PRMT_CONSTRAINTS, [word, t0, t1, t2, t3, t4, t5, t6, t7],
                dtype=_dtypes8(DTYPE), is_pure=True, pack=1)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                PRMT3_ASM, _PRMT_CONSTRAINTS, [word, t0, t1, t2, t3, t4, t5, t6, t7],
                dtype=_dtypes8(DTYPE), is_pure=True, pack=1)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _interleave8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Tensors [N, G] -> [N, 8G] with element 8g + k = a_k[g] (interleaves in bit-reversed
    order of k)."""
    return tl.interleave(tl.interleave(tl.interleave(a0, a4), tl.interleave(a2, a6)),
                         tl.interleave(tl.interleave(a1, a5), tl.interleave(a3, a7)))


@triton.jit
def _prmt_load(row, ok, HEAD_SIZE: tl.constexpr, BITS: tl.constexpr):
    """row [BLOCK_N] pointers to 4- or 3-bit code rows -> (b0, b1, b2) [BLOCK_N, D / 8]: 4 bits:
    b0 the row's D / 8 int32 words of 8 codes (one vector load run; b1, b2 = b0); 3 bits: the
    bytes 0, 1, 2 of its D / 8 groups of 3 bytes (uint8, one strided load each: a word-run
    load, split into the 24-bit groups in registers, made Triton convert layouts through
    shared memory). Global loads only (`_prmt_levels` looks the codes up)."""
    groups = tl.arange(0, HEAD_SIZE // 8)
    if BITS == 4:
        b0 = tl.load(row.to(tl.pointer_type(tl.int32))[:, None] + groups[None, :],
                     mask=ok[:, None], other=0)
        b1 = b0
        b2 = b0
    else:
        ptrs = row[:, None] + groups[None, :] * 3
        b0 = tl.load(ptrs, mask=ok[:, None], other=0)
        b1 = tl.load(ptrs + 1, mask=ok[:, None], other=0)
        b2 = tl.load(ptrs + 2, mask=ok[:, None], other=0)
    return b0, b1, b2


@triton.jit
def _prmt_levels(b0, b1, b2, table_ptr, BITS: tl.constexpr, DTYPE: tl.constexpr,
                 ASM: tl.constexpr):
    """`_prmt_load`'s words or bytes -> levels [BLOCK_N, D] in channel order (`_prmt8`)."""
    if BITS == 4:
        word = b0
    else:
        word = b0.to(tl.int32) | (b1.to(tl.int32) << 8) | (b2.to(tl.int32) << 16)
    o0, o1, o2, o3, o4, o5, o6, o7 = _prmt8(word, table_ptr, BITS, DTYPE, ASM)
    return _interleave8(o0, o1, o2, o3, o4, o5, o6, o7)


@triton.jit
def _select8(codes, levels_ptr):
    """levels[codes & 7] by a binary tree of selects on the code bits (registers only)."""
    b0 = (codes & 1) != 0
    v01 = tl.where(b0, tl.load(levels_ptr + 1), tl.load(levels_ptr))
    v23 = tl.where(b0, tl.load(levels_ptr + 3), tl.load(levels_ptr + 2))
    v45 = tl.where(b0, tl.load(levels_ptr + 5), tl.load(levels_ptr + 4))
    v67 = tl.where(b0, tl.load(levels_ptr + 7), tl.load(levels_ptr + 6))
    b1 = (codes & 2) != 0
    v03 = tl.where(b1, v23, v01)
    v47 = tl.where(b1, v67, v45)
    return tl.where((codes & 4) != 0, v47, v03)


# fp8 e4m3 keys as words of 4 codes: two cvt.f16x2.e4m3x2 (one per 16-bit half) per word, no
# byte extraction (the prefetching loop loads code rows as int32 words).
FP8X4_ASM = tl.constexpr("""{
    .reg .b16 lo, hi;
    .reg .b32 a, b;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 a, lo;
    cvt.rn.f16x2.e4m3x2 b, hi;
    mov.b32 {$0, $1}, a;
    mov.b32 {$2, $3}, b;
}""")


@triton.jit
def _fp8_words(word, ASM: tl.constexpr):
    """int32 words [N, G] of 4 fp8 e4m3 codes (code k in byte k) -> fp16 [N, 4G] in channel
    order (exact). Without ASM (the interpreter): bytes shifted out and bitcast."""
    if ASM:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            FP8X4_ASM, "=h,=h,=h,=h,r", [word], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        o0 = (word & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        o1 = ((word >> 8) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        o2 = ((word >> 16) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        o3 = ((word >> 24) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.interleave(tl.interleave(o0, o2), tl.interleave(o1, o3))


@triton.jit
def _prmt3_chunks(w0, w1, w2, table_ptr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """3-bit code rows as chunks of 3 int32 words (12 bytes: 4 groups of 8 codes), w_j [N, C]
    word j of chunk c -> levels [N, 32C] in CHUNK ORDER: element 32c + 4k + j holds channel
    32c + 8j + k (a transpose within each 32-channel chunk, which `_chunk_order` applies to
    the query and `_channel_order` undoes on the accumulator: dots do not depend on the
    order). One 32-bit load per word instead of one byte load per byte."""
    g0 = w0
    g1 = ((w0 >> 24) & 0xFF) | (w1 << 8)
    g2 = ((w1 >> 16) & 0xFFFF) | (w2 << 16)
    g3 = w2 >> 8
    a0, a1, a2, a3, a4, a5, a6, a7 = _prmt8(g0, table_ptr, 3, DTYPE, ASM)
    e0 = _interleave8(a0, a1, a2, a3, a4, a5, a6, a7)
    a0, a1, a2, a3, a4, a5, a6, a7 = _prmt8(g1, table_ptr, 3, DTYPE, ASM)
    e1 = _interleave8(a0, a1, a2, a3, a4, a5, a6, a7)
    a0, a1, a2, a3, a4, a5, a6, a7 = _prmt8(g2, table_ptr, 3, DTYPE, ASM)
    e2 = _interleave8(a0, a1, a2, a3, a4, a5, a6, a7)
    a0, a1, a2, a3, a4, a5, a6, a7 = _prmt8(g3, table_ptr, 3, DTYPE, ASM)
    e3 = _interleave8(a0, a1, a2, a3, a4, a5, a6, a7)
    return tl.interleave(tl.interleave(e0, e2), tl.interleave(e1, e3))


@triton.jit
def _chunk_order(x, HEAD_SIZE: tl.constexpr):
    """x [M, D] in channel order -> `_prmt3_chunks`' chunk order."""
    M: tl.constexpr = x.shape[0]
    y = tl.permute(tl.reshape(x, [M, HEAD_SIZE // 32, 4, 8]), (0, 1, 3, 2))
    return tl.reshape(y, [M, HEAD_SIZE])


@triton.jit
def _channel_order(x, HEAD_SIZE: tl.constexpr):
    """x [M, D] in `_prmt3_chunks`' chunk order -> channel order."""
    M: tl.constexpr = x.shape[0]
    y = tl.permute(tl.reshape(x, [M, HEAD_SIZE // 32, 8, 4]), (0, 1, 3, 2))
    return tl.reshape(y, [M, HEAD_SIZE])


@triton.jit
def _load_raw(
    code_row, meta, ok, meta_ok,
    HEAD_SIZE: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    LOOKUP: tl.constexpr, WORDS: tl.constexpr,
):
    """The global loads of `_load_vectors`: (b0, b1, b2, first, second): the code row's words
    or bytes (`_prmt_load` or `_load_code_bytes`; WORDS: fp8 rows as int32 words of 4 codes
    under the prmt lookups, `_fp8_words`), the first fp16 meta [BLOCK_N] and the second
    (uniform codes' min; else the first again), loaded under meta_ok. `_decode_vectors`
    makes the vectors."""
    first = tl.load(meta, mask=meta_ok, other=0.0)
    second = first
    if KIND == 2:
        second = tl.load(meta + 1, mask=meta_ok, other=0.0)
    # (Inline constexprs: triton 3.6 returns a jit helper's bool as a tensor, which `if` refuses.)
    PRMT: tl.constexpr = (LOOKUP == 3 or LOOKUP == 4) and KIND == 0 and (BITS == 3 or BITS == 4)
    WORDS3: tl.constexpr = WORDS and PRMT and BITS == 3 and HEAD_SIZE % 32 == 0
    FP8_WORDS: tl.constexpr = WORDS and KIND == 1 and (LOOKUP == 3 or LOOKUP == 4)
    if WORDS3:  # 3-bit prmt rows as int32 words (the prefetching loop, `_prmt3_chunks`)
        chunk = code_row.to(tl.pointer_type(tl.int32))[:, None] \
            + 3 * tl.arange(0, HEAD_SIZE // 32)[None, :]
        b0 = tl.load(chunk, mask=ok[:, None], other=0)
        b1 = tl.load(chunk + 1, mask=ok[:, None], other=0)
        b2 = tl.load(chunk + 2, mask=ok[:, None], other=0)
    elif PRMT:
        b0, b1, b2 = _prmt_load(code_row, ok, HEAD_SIZE, BITS)
    elif FP8_WORDS:  # fp8 rows as int32 words
        groups = tl.arange(0, HEAD_SIZE // 4)
        b0 = tl.load(code_row.to(tl.pointer_type(tl.int32))[:, None] + groups[None, :],
                     mask=ok[:, None], other=0)
        b1 = b0
        b2 = b0
    else:
        b0, b1, b2 = _load_code_bytes(code_row, ok, HEAD_SIZE, BITS, G)
    return b0, b1, b2, first, second


@triton.jit
def _decode_vectors(
    b0, b1, b2, first, second, levels_ptr,
    HEAD_SIZE: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    LOOKUP: tl.constexpr, DTYPE: tl.constexpr, WORDS: tl.constexpr,
):
    """`_load_raw`'s words and metas -> (values [BLOCK_N, D], scale [BLOCK_N] fp32) as
    `_load_vectors`."""
    first = first.to(tl.float32)
    PRMT: tl.constexpr = (LOOKUP == 3 or LOOKUP == 4) and KIND == 0 and (BITS == 3 or BITS == 4)
    WORDS3: tl.constexpr = WORDS and PRMT and BITS == 3 and HEAD_SIZE % 32 == 0
    FP8_WORDS: tl.constexpr = WORDS and KIND == 1 and (LOOKUP == 3 or LOOKUP == 4)
    if WORDS3:  # in chunk order
        values = _prmt3_chunks(b0, b1, b2, levels_ptr, DTYPE, LOOKUP == 3)
        scale = first * (1.0 / tl.sqrt(float(HEAD_SIZE)))
    elif PRMT:
        values = _prmt_levels(b0, b1, b2, levels_ptr, BITS, DTYPE, LOOKUP == 3)
        scale = first * (1.0 / tl.sqrt(float(HEAD_SIZE)))
    elif FP8_WORDS:  # fp8 rows as int32 words
        values = _fp8_words(b0, LOOKUP == 3)
        scale = first * (1.0 / tl.sqrt(float(HEAD_SIZE)))
    else:
        codes = _unpack_codes(b0, b1, b2, HEAD_SIZE, BITS, G)
        if KIND == 2:
            lo = second.to(tl.float32)
            values = codes.to(tl.float32) * first[:, None] + lo[:, None]
            scale = tl.full(first.shape, 1.0, tl.float32)
        else:
            if KIND == 1:  # exact in fp16: one cvt per pair of codes
                values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            elif LOOKUP == 2:
                if BITS <= 4:  # tl.gather from the levels broadcast over the rows: warp shuffles
                    levels = tl.load(levels_ptr + tl.arange(0, 1 << BITS))
                    values = tl.gather(
                        tl.broadcast_to(levels[None, :], (codes.shape[0], 1 << BITS)), codes, 1)
                else:
                    values = tl.load(levels_ptr + codes)
            elif LOOKUP == 1:
                if BITS == 3:
                    values = _select8(codes, levels_ptr)
                elif BITS == 4:
                    values = tl.where((codes & 8) != 0, _select8(codes, levels_ptr + 8),
                                      _select8(codes, levels_ptr))
                else:
                    values = tl.load(levels_ptr + codes)
            else:
                values = tl.load(levels_ptr + codes)
            scale = first * (1.0 / tl.sqrt(float(HEAD_SIZE)))
    return values, scale


@triton.jit
def _load_vectors(
    code_row, meta, ok, levels_ptr,
    HEAD_SIZE: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    LOOKUP: tl.constexpr, DTYPE: tl.constexpr,
):
    """code_row [BLOCK_N] pointers to code rows, meta [BLOCK_N] pointers to the first fp16 meta
    -> (values [BLOCK_N, D], scale [BLOCK_N] fp32): the storage-domain vectors are values *
    scale[:, None]. Scaled codecs (Lloyd-Max, fp8) return the unit codes (Lloyd-Max: in the
    level table's dtype) and the per-vector scale, which the caller folds into the scores (K)
    or the probabilities (V) instead of multiplying every element; uniform codes return the
    dequantized vectors (fp32) and a scale of 1. LOOKUP 3 (prmt, Lloyd-Max 3/4 bits only):
    levels_ptr is the codebook's byte planes and the values come in DTYPE (16-bit); LOOKUP 4:
    its stand-in without inline PTX (`_prmt_levels`), levels_ptr the plain level table.
    (`_load_raw` then `_decode_vectors`: the prefetching loop calls them a tile apart.)"""
    b0, b1, b2, first, second = _load_raw(code_row, meta, ok, ok, HEAD_SIZE, KIND, BITS, G,
                                          LOOKUP, False)
    return _decode_vectors(b0, b1, b2, first, second, levels_ptr, HEAD_SIZE, KIND, BITS, G,
                           LOOKUP, DTYPE, False)


@triton.jit
def _scores(q, k, k_scale, UPCAST: tl.constexpr):
    """q [M, D] . k [N, D]^T, times the per-key scale [N]: fp32 [M, N]."""
    if UPCAST:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    return s * k_scale[None, :]


@triton.jit
def _online_softmax(acc, l_i, m_i, s, seen, sm_scale, soft_cap, USE_SOFT_CAP: tl.constexpr):
    """One online-softmax tile of raw scores s [M, N] (seen: which count): returns the
    probabilities p [M, N] fp32, the accumulator rescaled to the new maximum, l (per-column
    partial row sums [M, N], summed once after the last tile) and m."""
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
    l_i = l_i * alpha[:, None] + p  # row sums taken once at the end (no per-tile reduction)
    return p, acc * alpha[:, None], l_i, m_new


@triton.jit
def _accumulate(acc, p, v, q, UPCAST: tl.constexpr):
    """acc + p [M, N] @ v [N, D], in q's dtype unless UPCAST."""
    if UPCAST:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
    return acc


@triton.jit
def _page_of(k_pos, BLOCK_SIZE: tl.constexpr):
    """Block-table index of key positions k_pos >= 0 (a shift for power-of-two pages)."""
    if BLOCK_SIZE & (BLOCK_SIZE - 1) == 0:
        index = k_pos >> (BLOCK_SIZE.bit_length() - 1)
    else:
        index = k_pos // BLOCK_SIZE
    return index


@triton.jit
def _load_tile_raw(
    head_base, head_base16, page, k_pos, k_ok, all_ok, stride_cb, stride_cb16,
    HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, LOOKUP: tl.constexpr,
    V_CODES_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr, K_GROUP: tl.constexpr,
    K_META_N: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_CODE_BYTES: tl.constexpr, V_GROUP: tl.constexpr,
    V_META_N: tl.constexpr,
):
    """The global loads of one context tile for the prefetching loop (`_load_raw` of its keys
    and values; page [BLOCK_N] int64, 0 past the context): keys and value metas unmasked
    (all_ok), value codes masked by k_ok unless Lloyd-Max, uniform value metas masked."""
    if BLOCK_SIZE & (BLOCK_SIZE - 1) == 0:
        row = k_pos & (BLOCK_SIZE - 1)
    else:
        row = k_pos % BLOCK_SIZE
    plane = head_base + page * stride_cb
    plane16 = head_base16 + page * stride_cb16
    kb0, kb1, kb2, kf, ks = _load_raw(plane + row * K_CODE_BYTES,
                                      plane16 + K_META_OFF + row * K_META_N, all_ok, all_ok,
                                      HEAD_SIZE, K_KIND, K_BITS, K_GROUP, LOOKUP, True)
    v_ok = all_ok
    if V_KIND != 0:
        v_ok = k_ok
    v_meta_ok = all_ok
    if V_KIND == 2:
        v_meta_ok = k_ok
    vb0, vb1, vb2, vf, vs = _load_raw(plane + V_CODES_OFF + row * V_CODE_BYTES,
                                      plane16 + V_META_OFF + row * V_META_N, v_ok, v_meta_ok,
                                      HEAD_SIZE, V_KIND, V_BITS, V_GROUP, LOOKUP, True)
    return kb0, kb1, kb2, kf, ks, vb0, vb1, vb2, vf, vs


@triton.jit
def _tq_attention_kernel(
    q_ptr, key_ptr, value_ptr, cache_ptr, cache16_ptr, out_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr, qblock_req_ptr, qblock_start_ptr,
    signs_ptr, had_ptr, k_levels_ptr, v_levels_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    lse_ptr, sm_scale, soft_cap, window,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_ch, stride_cb16, stride_ch16, stride_bt,
    QPK: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, UPCAST: tl.constexpr,
    ROTATED: tl.constexpr, LOOKUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PREFETCH: tl.constexpr, MERGE_NEW: tl.constexpr,
    V_CODES_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr, K_GROUP: tl.constexpr,
    K_META_N: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_CODE_BYTES: tl.constexpr, V_GROUP: tl.constexpr,
    V_META_N: tl.constexpr,
):
    kv_head = tl.program_id(0)
    qblock = tl.program_id(1)
    split = tl.program_id(2)
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
    l_i = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # per-column partial row sums
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # Phase 1: the quantized context, scored against the rotated query.
    if ROTATED:
        # q R^T = (q D) H / sqrt(d)
        had = tl.load(had_ptr + offs_d[:, None] * HEAD_SIZE + offs_d[None, :])
        signs = tl.load(signs_ptr + offs_d)
        q_ctx = _hadamard(q * signs[None, :], had) * (1.0 / tl.sqrt(float(HEAD_SIZE)))
    else:
        q_ctx = q
    FP8_F16: tl.constexpr = K_KIND == 1 and not UPCAST and BLOCK_M <= 16
    q_pow = tl.full([BLOCK_M], 1.0, tl.float32)
    if FP8_F16:
        # fp8 keys convert exactly to fp16 (one cvt per pair; bf16 would go through fp32), so
        # the key dot runs in fp16: each row of the rotated query is scaled by a power of two
        # 2^-e into fp16's range (|q| <= 2^14; exact) and the scores by 2^e. (Decode shapes
        # only: at prefill's block_m 64 ptxas spilled more.)
        amax = tl.max(tl.abs(q_ctx), 1)
        e = tl.where(amax > 0.0, tl.ceil(tl.log2(tl.maximum(amax, 1e-30))) - 14.0, 0.0)
        e = tl.minimum(tl.maximum(e, -100.0), 100.0).to(tl.int32)
        q_pow = ((e + 127) << 23).to(tl.float32, bitcast=True)
        q_key = (q_ctx * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
    if not UPCAST:
        q_ctx = q_ctx.to(q_ptr.dtype.element_ty)
    if not FP8_F16:
        q_key = q_ctx
    # 3-bit rows read as words come in `_prmt3_chunks`' chunk order: the query in that order
    # for the keys' dot, the accumulator put back in channel order after the loop.
    K_CHUNKS: tl.constexpr = (PREFETCH and (LOOKUP == 3 or LOOKUP == 4) and K_KIND == 0
                              and K_BITS == 3 and HEAD_SIZE % 32 == 0)
    V_CHUNKS: tl.constexpr = (PREFETCH and (LOOKUP == 3 or LOOKUP == 4) and V_KIND == 0
                              and V_BITS == 3 and HEAD_SIZE % 32 == 0)
    if K_CHUNKS:
        q_key = _chunk_order(q_key, HEAD_SIZE)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_base = cache_ptr + kv_head * stride_ch
    head_base16 = cache16_ptr + kv_head * stride_ch16
    part_lo = (lo // BLOCK_N) * BLOCK_N
    part_hi = context
    if NUM_SPLITS > 1:  # this split's share of the context tiles (whole tiles)
        part = tl.cdiv(tl.cdiv(tl.maximum(context - part_lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        part_lo = part_lo + split * part
        part_hi = tl.minimum(part_lo + part, context)
    if PREFETCH:
        # Software pipelining in registers: the codes and metas of tile i + 1 are loaded while
        # tile i is computed, and the page numbers of tile i + 2 (the next loads' addresses),
        # so that no global load's latency sits in a tile's chain (the pipeliner's cp.async
        # copies were waited for right after being issued, and the metas and page numbers
        # were plain loads used in the same tile).
        # Masks: only the page numbers' loads (out-of-range keys read page 0, whose rows
        # exist). Keys and the values' metas load unmasked (the scores of masked keys are
        # replaced by -inf, the value scales by 0); value codes too where every code is a
        # finite level (Lloyd-Max), so that p = 0 keeps them out.
        all_ok = tl.full([BLOCK_N], 1, tl.int1)
        n_pos = part_lo + offs_n
        page = tl.load(table_row + _page_of(n_pos, BLOCK_SIZE),
                       mask=(n_pos < part_hi) & (n_pos >= lo), other=0).to(tl.int64)
        kb0, kb1, kb2, kf, ks, vb0, vb1, vb2, vf, vs = _load_tile_raw(
            head_base, head_base16, page, n_pos, (n_pos < part_hi) & (n_pos >= lo), all_ok,
            stride_cb, stride_cb16, HEAD_SIZE, BLOCK_SIZE, LOOKUP,
            V_CODES_OFF, K_META_OFF, V_META_OFF,
            K_KIND, K_BITS, K_CODE_BYTES, K_GROUP, K_META_N,
            V_KIND, V_BITS, V_CODE_BYTES, V_GROUP, V_META_N)
        n_pos = part_lo + BLOCK_N + offs_n
        next_page = tl.load(table_row + _page_of(n_pos, BLOCK_SIZE),
                            mask=(n_pos < part_hi) & (n_pos >= lo), other=0).to(tl.int64)
        for tile in range(part_lo, part_hi, BLOCK_N):
            # this tile's raw words (loaded one tile ago) ...
            ck0, ck1, ck2, ckf, cks = kb0, kb1, kb2, kf, ks
            cv0, cv1, cv2, cvf, cvs = vb0, vb1, vb2, vf, vs
            k_ok = (tile + offs_n < context) & (tile + offs_n >= lo)
            # ... the next tile's loads, from the page numbers loaded one tile ago ...
            n_pos = tile + BLOCK_N + offs_n
            kb0, kb1, kb2, kf, ks, vb0, vb1, vb2, vf, vs = _load_tile_raw(
                head_base, head_base16, next_page, n_pos, (n_pos < part_hi) & (n_pos >= lo),
                all_ok, stride_cb, stride_cb16, HEAD_SIZE, BLOCK_SIZE, LOOKUP,
                V_CODES_OFF, K_META_OFF, V_META_OFF,
                K_KIND, K_BITS, K_CODE_BYTES, K_GROUP, K_META_N,
                V_KIND, V_BITS, V_CODE_BYTES, V_GROUP, V_META_N)
            n_pos = tile + 2 * BLOCK_N + offs_n
            next_page = tl.load(table_row + _page_of(n_pos, BLOCK_SIZE),
                                mask=(n_pos < part_hi) & (n_pos >= lo), other=0).to(tl.int64)
            # ... and this tile's attention.
            k, k_scale = _decode_vectors(ck0, ck1, ck2, ckf, cks, k_levels_ptr, HEAD_SIZE,
                                         K_KIND, K_BITS, K_GROUP, LOOKUP,
                                         q_ptr.dtype.element_ty, True)
            s = _scores(q_key, k, k_scale, UPCAST)
            if FP8_F16:
                s = s * q_pow[:, None]
            seen = k_ok[None, :]
            if USE_WINDOW:
                seen = seen & (tile + offs_n[None, :] > q_pos[:, None] - window)
            p, acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, seen, sm_scale, soft_cap,
                                               USE_SOFT_CAP)
            v, v_scale = _decode_vectors(cv0, cv1, cv2, cvf, cvs, v_levels_ptr, HEAD_SIZE,
                                         V_KIND, V_BITS, V_GROUP, LOOKUP,
                                         q_ptr.dtype.element_ty, True)
            if V_KIND != 2:  # the unmasked metas of keys past the context: any bits
                v_scale = tl.where(k_ok, v_scale, 0.0)
            acc = _accumulate(acc, p * v_scale[None, :], v, q_ctx, UPCAST)
    else:
        for tile in range(part_lo, part_hi, BLOCK_N):
            k_pos = tile + offs_n
            k_ok = (k_pos < context) & (k_pos >= lo)
            page = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            row = k_pos % BLOCK_SIZE
            plane = head_base + page * stride_cb
            plane16 = head_base16 + page * stride_cb16
            k, k_scale = _load_vectors(plane + row * K_CODE_BYTES,
                                       plane16 + K_META_OFF + row * K_META_N, k_ok, k_levels_ptr,
                                       HEAD_SIZE, K_KIND, K_BITS, K_GROUP, LOOKUP,
                                       q_ptr.dtype.element_ty)
            s = _scores(q_key, k, k_scale, UPCAST)
            if FP8_F16:
                s = s * q_pow[:, None]
            seen = k_ok[None, :]
            if USE_WINDOW:
                seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
            p, acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, seen, sm_scale, soft_cap,
                                               USE_SOFT_CAP)
            v, v_scale = _load_vectors(plane + V_CODES_OFF + row * V_CODE_BYTES,
                                       plane16 + V_META_OFF + row * V_META_N, k_ok, v_levels_ptr,
                                       HEAD_SIZE, V_KIND, V_BITS, V_GROUP, LOOKUP,
                                       q_ptr.dtype.element_ty)
            acc = _accumulate(acc, p * v_scale[None, :], v, q_ctx, UPCAST)
    if V_CHUNKS:
        acc = _channel_order(acc, HEAD_SIZE)
    if ROTATED:
        # acc R = (acc H) D / sqrt(d). H is symmetric: reading it transposed keeps the compiler
        # from merging this load with the first one, which would hold H in registers across
        # the loop.
        had = tl.load(had_ptr + offs_d[None, :] * HEAD_SIZE + offs_d[:, None])
        signs = tl.load(signs_ptr + offs_d) * (1.0 / tl.sqrt(float(HEAD_SIZE)))
        acc = _hadamard(acc, had) * signs[None, :]

    # Phase 2: this step's own tokens at full precision, causally (MERGE_NEW: a dense kernel
    # has attended them already, merged below).
    q_new = q
    if not UPCAST:
        q_new = q.to(q_ptr.dtype.element_ty)
    ones = tl.full([BLOCK_N], 1.0, tl.float32)
    new_lo = tl.maximum(context, lo)
    if NUM_SPLITS > 1:  # the new tokens go to the last split alone
        new_lo = tl.where(split == NUM_SPLITS - 1, new_lo, hi)
    if MERGE_NEW:
        new_lo = hi
    for tile in range(new_lo, hi, BLOCK_N):
        k_pos = tile + offs_n
        k_ok = k_pos < hi
        kv_tok = (q_start + k_pos - context).to(tl.int64)
        k = tl.load(key_ptr + kv_tok[:, None] * stride_kt + kv_head * stride_kh
                    + offs_d[None, :] * stride_kd, mask=k_ok[:, None], other=0.0)
        v = tl.load(value_ptr + kv_tok[:, None] * stride_vt + kv_head * stride_vh
                    + offs_d[None, :] * stride_vd, mask=k_ok[:, None], other=0.0)
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        s = _scores(q_new, k, ones, UPCAST)
        p, acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, seen, sm_scale, soft_cap,
                                           USE_SOFT_CAP)
        acc = _accumulate(acc, p, v, q_new, UPCAST)

    l_sum = tl.sum(l_i, 1)
    if NUM_SPLITS > 1:
        # Partial results (decode_split_kv's layout): m, l [T, H, S] and acc [T, H, S, D], the
        # acc in the storage domain (rotated back) and not normalised.
        part_row = (token * (tl.num_programs(0) * QPK) + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_l_ptr + part_row, l_sum, mask=row_ok)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_SIZE + offs_d[None, :], acc,
                 mask=row_ok[:, None])
    elif MERGE_NEW:
        # out holds the new tokens' attention, normalised, and lse_ptr its base-2 log-sum-exp
        # [T, H] (in the same scaled units as m_i): the two softmaxes merge by their weights.
        # Requests without context keep the dense result untouched.
        ok = row_ok & (context > 0)
        o_ptrs = (out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                  + offs_d[None, :] * stride_od)
        o_new = tl.load(o_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
        lse_new = tl.load(lse_ptr + token * (tl.num_programs(0) * QPK) + head, mask=ok,
                          other=float("-inf"))
        m_all = tl.maximum(m_i, lse_new)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        w_ctx = tl.exp2(m_i - m_all)
        w_new = tl.exp2(lse_new - m_all)
        total = l_sum * w_ctx + w_new
        out = (acc * w_ctx[:, None] + o_new * w_new[:, None]) \
            / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    else:
        l_safe = tl.where(l_sum > 0.0, l_sum, 1.0)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


def inline_asm_supported(device: torch.device) -> bool:
    """Whether the kernels compile for CUDA (not the interpreter): inline PTX (the 'prmt'
    lookup) and ptxas options (max_regs) apply."""
    return device.type == "cuda" and not torch.version.hip


def select_tiles(device: torch.device, decode_only: bool) -> TQTiles:
    if device.type == "cpu":
        return INTERPRETER_TILES
    return DECODE_TILES if decode_only else PREFILL_TILES


def tq_attention(
    preset: KVPreset, tensors: FormatTensors, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, qblock_req: torch.Tensor,
    qblock_start: torch.Tensor, num_qblocks: int, block_q: int, block_m: int, scale: float,
    tiles: TQTiles, sliding_window: int | None = None, soft_cap: float | None = None,
    upcast: bool | None = None, num_splits: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    merge_lse: torch.Tensor | None = None,
) -> None:
    """Attention of query [T, H, D] over the packed cache (context) and key/value [T, Hkv, D]
    (the step's new tokens, full precision) into out [T, H, D]. qblock_req/qblock_start: the
    per-step map of unified_attention.query_block_map. upcast: fp32 dots (default: for fp32
    inputs and in the interpreter). All sizes are host ints: no sync. num_splits > 1 (decode
    batches: block_q 1): each request's context is cut into num_splits ranges attended by
    separate programs (the new tokens by the last), which write `partials`
    (`decode_split_kv.allocate_partials`), merged into out by `reduce_split_kv`. merge_lse
    [T, H] fp32: the new tokens were attended already (a dense kernel wrote out and this base-2
    log-sum-exp, as unified_attention's `lse`): attend the context alone and merge it into
    out, for the query blocks of requests with context (the others are left as they are)."""
    if num_qblocks == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[1]
    if upcast is None:
        upcast = query.dtype == torch.float32 or query.device.type == "cpu"
    cache16, layout = _layout_args(preset, kv_cache, head_size)
    lookup = LOOKUPS[tiles.lookup]
    if lookup == LOOKUPS["prmt"] and (upcast or not inline_asm_supported(query.device)):
        lookup = PRMT_STAND_IN  # inline PTX: CUDA and 16-bit dots only
    if lookup == LOOKUPS["prmt"]:
        k_levels, v_levels = tensors.prmt_tables(query.dtype)
    else:
        k_levels, v_levels = tensors.level_tables(torch.float32 if upcast else query.dtype)
    if num_splits > 1 and (partials is None or block_q != 1):
        raise ValueError("split-KV attention is for decode batches and needs partial buffers")
    if num_splits > 1 and merge_lse is not None:
        raise ValueError("the context-only merge writes out directly: no split-KV")
    part_m, part_l, part_acc = partials if num_splits > 1 else (out, out, out)
    _tq_attention_kernel[(num_kv_heads, num_qblocks, num_splits)](
        query, key, value, kv_cache, cache16, out,
        block_table, query_start_loc, seq_lens, qblock_req, qblock_start,
        tensors.signs, tensors.hadamard, k_levels, v_levels, part_m, part_l, part_acc,
        out if merge_lse is None else merge_lse, scale, soft_cap or 0.0, sliding_window or 0,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        kv_cache.stride(0), kv_cache.stride(1), cache16.stride(0), cache16.stride(1),
        block_table.stride(0),
        QPK=num_heads // num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        UPCAST=upcast, ROTATED=preset.rotated, LOOKUP=lookup, NUM_SPLITS=num_splits,
        PREFETCH=bool(tiles.prefetch), MERGE_NEW=merge_lse is not None,
        **layout,
        **_codec_args("K", preset.key, head_size), **_codec_args("V", preset.value, head_size),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **({"maxnreg": tiles.max_regs} if tiles.max_regs
           and inline_asm_supported(query.device) else {}),
    )
    if num_splits > 1:
        from pagedserve.attention.ops.decode_split_kv import reduce_split_kv

        reduce_split_kv(partials, out, num_qblocks, num_splits)
