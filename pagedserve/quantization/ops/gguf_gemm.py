"""GEMMs that read GGUF's quantized blocks as they are in the file: y = x W^T with W [N, K] held
as llama.cpp's raw bytes, one row of blocks per output feature ([N, K / block * block bytes],
uint8), dequantized in registers tile by tile. One kernel, specialised per block type by a
constexpr (`QTYPE`): each type compiles to its own GEMM.

The block layouts (ggml's; 16-bit fields are little-endian float16, read as two bytes because
the blocks are not 2-byte aligned within a row):
- Q8_0, 34 bytes per 32 values: d, then 32 int8 codes; w = d * q.
- Q4_0, 18 bytes per 32: d, then 16 bytes; byte j holds value j (low nibble) and j + 16 (high);
  w = d * (q - 8).
- Q4_1, 20 bytes per 32: d, m, then 16 bytes as Q4_0; w = d * q + m.
- Q4_K, 144 bytes per super-block of 256 in 8 sub-blocks of 32: d, dmin, 12 bytes of 6-bit
  scales and mins, 128 bytes of nibbles. Byte 32c + l holds sub-block 2c's value l (low nibble)
  and sub-block 2c + 1's (high). Sub-block s < 4: scale = b[s] & 63, min = b[s + 4] & 63; s >= 4:
  scale = (b[s + 4] & 15) | (b[s - 4] >> 6) << 4, min = (b[s + 4] >> 4) | (b[s] >> 6) << 4.
  w = (d * scale) * q - dmin * min.
- Q5_K, 176 bytes: as Q4_K with 32 bytes of high bits between the scales and the nibbles: bit s
  of qh[l] is the fifth bit of sub-block s's value l.
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16
  values), then d. In half h (128 values) value r has its nibble in ql[64h + r % 64] (shift
  4 * (r // 64)) and its top two bits in qh[32h + r % 32] (shift 2 * (r // 32));
  w = (d * scale[p // 16]) * (q - 32).

Small M (decode) runs the fused GEMM: each program walks K for a BLOCK_M x BLOCK_N tile,
decodes the weight tile in float32 (the products above, in gguf's order: exact against its
numpy dequantizer in the interpreter), rounds it to x's dtype and accumulates the dot in
float32. Above `DEQUANTIZE_ABOVE_M` rows (prefill) the whole weight is decoded by the same
helper into x's dtype and the dense GEMM runs: simpler than a tile-wise prefill path, and at
that size the product, not the one extra write and read of the weight, sets the time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quantization.gguf_types import BLOCKS


@triton.jit
def _f16(ptr, offs, mask):
    """A little-endian float16 at byte offsets `offs`, as float32."""
    lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(w_ptr, base, s, mask):
    """Q4_K / Q5_K: d * scale and dmin * min of sub-block `s` (0..7) of the super-blocks at
    `base`, from their 12 bytes of 6-bit fields after d and dmin."""
    a = _byte(w_ptr, base + 4 + s, mask)
    b = _byte(w_ptr, base + 8 + s, mask)
    c = _byte(w_ptr, base + 4 + tl.where(s >= 4, s - 4, s), mask)
    sc = tl.where(s < 4, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(s < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return (_f16(w_ptr, base, mask) * sc.to(tl.float32),
            _f16(w_ptr, base + 2, mask) * mn.to(tl.float32))


@triton.jit
def _decode(w_ptr, rows, ks, mask, QTYPE: tl.constexpr):
    """The float32 weights of inputs `ks` [BK, 1] of output rows `rows` [1, BN] (byte offsets
    of those rows' first blocks): a [BK, BN] tile."""
    if QTYPE == 8:  # Q8_0
        base = rows + (ks // 32) * 34
        d = _f16(w_ptr, base, mask)
        q = tl.load(w_ptr + base + 2 + ks % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = d * q.to(tl.float32)
    elif QTYPE == 2:  # Q4_0
        base = rows + (ks // 32) * 18
        j = ks % 32
        q = (_byte(w_ptr, base + 2 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = _f16(w_ptr, base, mask) * (q - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        base = rows + (ks // 32) * 20
        j = ks % 32
        q = (_byte(w_ptr, base + 4 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = _f16(w_ptr, base, mask) * q.to(tl.float32) + _f16(w_ptr, base + 2, mask)
    elif QTYPE == 14:  # Q6_K
        base = rows + (ks // 256) * 210
        p = ks % 256
        h = p // 128
        r = p % 128
        low = (_byte(w_ptr, base + 64 * h + r % 64, mask) >> ((r // 64) * 4)) & 0xF
        high = (_byte(w_ptr, base + 128 + 32 * h + r % 32, mask) >> ((r // 32) * 2)) & 3
        scale = tl.load(w_ptr + base + 192 + p // 16, mask=mask, other=0)
        scale = scale.to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16(w_ptr, base + 208, mask) * scale
        w = d * ((low | (high << 4)) - 32).to(tl.float32)
    elif QTYPE == 12:  # Q4_K
        base = rows + (ks // 256) * 144
        p = ks % 256
        d, dm = _k_scale_min(w_ptr, base, p // 32, mask)
        q = (_byte(w_ptr, base + 16 + 32 * (p // 64) + p % 32, mask) >> ((p // 32 % 2) * 4)) & 0xF
        w = d * q.to(tl.float32) - dm
    else:  # Q5_K (13)
        base = rows + (ks // 256) * 176
        p = ks % 256
        d, dm = _k_scale_min(w_ptr, base, p // 32, mask)
        q = (_byte(w_ptr, base + 48 + 32 * (p // 64) + p % 32, mask) >> ((p // 32 % 2) * 4)) & 0xF
        q = q | (((_byte(w_ptr, base + 16 + p % 32, mask) >> (p // 32)) & 1) << 4)
        w = d * q.to(tl.float32) - dm
    return w


@triton.jit
def _gguf_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, row_bytes, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      QTYPE: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    starts = (cols.to(tl.int64) * row_bytes)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = _decode(w_ptr, starts, ks[:, None], k_ok[:, None] & col_ok[None, :], QTYPE)
        if IEEE:
            acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gguf_dequantize_kernel(w_ptr, out_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, QTYPE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (ks < K)[:, None] & (cols < N)[None, :]
    w = _decode(w_ptr, (cols.to(tl.int64) * row_bytes)[None, :], ks[:, None], mask, QTYPE)
    tl.store(out_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None],
             w.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GGUFBlocks:
    """One GGUF weight (or several stacked along the outputs) of one block type on a device:
    `data` uint8 [N, K / block * block bytes], the file's bytes."""

    qtype: int
    data: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def type_name(self) -> str:
        return BLOCKS[self.qtype][2]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return gguf_dequantize(self, dtype)


def check_blocks(qtype: int, data: torch.Tensor, in_features: int) -> None:
    """Refuse bytes that are not whole rows of blocks of `in_features` values."""
    if qtype not in BLOCKS:
        raise ValueError(f"no GGUF kernel for block type {qtype}")
    block, size, name = BLOCKS[qtype]
    if in_features % block or data.dim() != 2 or data.shape[1] != in_features // block * size:
        raise ValueError(f"{name} weight of {in_features} inputs needs rows of "
                         f"{in_features // block * size} bytes in blocks of {block}; got "
                         f"{tuple(data.shape)}")


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Not yet measured on a device. Chosen from what ptxas reports for sm_90a under triton 3.6
# (`scripts/gguf_kernel_resources.py`): with 64 x 64 tiles in 3 stages Q4_1 and Q6_K used 255
# registers (Q6_K spilled); 32 x 64 in 2 stages needs at most 164 and spills nothing. At
# decode one program covers 32 outputs, so a 4,096-row layer still gives 128 programs.
GPU_TILES = Tiles(16, 32, 64, 4, 2)
INTERPRETER_TILES = Tiles(16, 64, 64, 1, 1)
# Above this many rows the weight is dequantized whole and the dense GEMM runs; not yet
# measured (`benchmarks/gguf_linear.py` times both on the device).
DEQUANTIZE_ABOVE_M = 64


def _tiles(device: torch.device) -> Tiles:
    return INTERPRETER_TILES if device.type == "cpu" else GPU_TILES


def gguf_mm(x: torch.Tensor, weight: GGUFBlocks, out: torch.Tensor | None = None
            ) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) -> [M, N] in x's dtype, written into `out`
    (a [M, N] view whose last dim is contiguous, such as a column slice) when given."""
    m, k = x.shape
    if k != weight.in_features:
        raise ValueError(f"input has {k} features; the {weight.type_name} weight takes "
                         f"{weight.in_features}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = weight.out_features
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = _tiles(x.device)
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    _gguf_gemm_kernel[grid](x, weight.data, out, m, n, k, x.stride(0), weight.data.stride(0),
                            out.stride(0), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                            BLOCK_K=t.block_k, QTYPE=weight.qtype,
                            IEEE=x.dtype == torch.float32, num_warps=t.num_warps,
                            num_stages=t.num_stages)
    return out


def gguf_dequantize(weight: GGUFBlocks, dtype: torch.dtype, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """[N, K] in `dtype`, decoded on the weight's device by the GEMM's own helper (into `out`,
    contiguous [N, K], when given)."""
    n, k = weight.out_features, weight.in_features
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=weight.data.device)
    t = _tiles(weight.data.device)
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(k, t.block_k))
    _gguf_dequantize_kernel[grid](weight.data, out, n, k, weight.data.stride(0),
                                  BLOCK_N=t.block_n, BLOCK_K=t.block_k, QTYPE=weight.qtype,
                                  num_warps=t.num_warps)
    return out


def gguf_linear(x: torch.Tensor, parts: list[GGUFBlocks], bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, plus `bias`. `parts`: the layer's weights stacked
    along the outputs in order (a fused layer's parts may be of different block types: a
    Q4_K_M file stores some v and down projections in Q6_K); each writes its own columns, or
    above `DEQUANTIZE_ABOVE_M` rows its own rows of the dense weight."""
    flat = x.reshape(-1, x.shape[-1])
    n = sum(p.out_features for p in parts)
    if flat.shape[0] > DEQUANTIZE_ABOVE_M:
        dense = torch.empty((n, flat.shape[1]), dtype=x.dtype, device=x.device)
        start = 0
        for part in parts:
            gguf_dequantize(part, x.dtype, dense[start:start + part.out_features])
            start += part.out_features
        out = torch.nn.functional.linear(flat, dense, bias)
    else:
        out = torch.empty((flat.shape[0], n), dtype=x.dtype, device=x.device)
        start = 0
        for part in parts:
            gguf_mm(flat, part, out[:, start:start + part.out_features])
            start += part.out_features
        if bias is not None:
            out = out + bias
    return out.reshape(*x.shape[:-1], n)
