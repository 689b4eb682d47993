"""The W4A16 GEMM, which serves 8-bit codes too (W8A16; the names keep the common 4-bit case):
y = x W^T with W held as BITS-bit integer codes (4 or 8) and per-group scales and zero points,
dequantized in registers tile by tile (the weight is never written out in 16 bits).

Layout (`W4A16Weight`, built by `w4a16_layout` from any integer format's `IntCodes`):
- the inputs are put in group order once at load: act-order (GPTQ's `desc_act`) maps inputs to
  groups in any order, so `perm` [K] (int32, or None when already in order) lists the input
  each position reads, and then every group is one run of `group_size` consecutive positions
  (the first run may be shorter by `group_offset`: a tensor-parallel slice of K that starts
  inside a group). The kernel reads x through `perm`, so no gather of x is launched;
- `qweight` int32 [ceil(K / p), N], p = 32 / BITS: p codes a word along K, low bits first
  (code i: position p*r+i), so a tile of BLOCK_K positions x BLOCK_N outputs is BLOCK_K / p rows
  of contiguous words, each loaded once;
- `scales` [G, N] as the checkpoint stores them (float16, bfloat16 or float32) and `zeros`
  [G, N], one per group and output: uint8 for 4 bits (0..16), int16 for 8 bits (0..256:
  GPTQ's v1 reads a stored 255 as 256).

BITS is a compile-time constant, so 4 and 8 bits are two specialisations. One program per
BLOCK_M x BLOCK_N output tile (and per K slice, `split_k`) walks K by BLOCK_K. Each step loads
the tile's words once and shifts every code out of its word into a [BLOCK_K, BLOCK_N] tile
(`_weight_tile`), whose scales and zeros are one row per group where the tile is whole groups
(`W4A16Weight.tile_groups`), else read per position; (code - zero) * scale, or code * scale +
offset, is formed in float32 (exact), rounded to x's dtype and fed to one dot, accumulated in
float32. At one row (batch-1 decode) there is no dot: the products accumulate elementwise in a
[BLOCK_K, BLOCK_N] float32 tile, summed over K once at the end, and the weight is not rounded.
Split K (decode shapes otherwise give fewer programs than the GPU has SMs) stores each slice's
float32 partial product and `_sum_splits_kernel` adds them. Large M, where the product is
compute bound, instead dequantizes the whole weight with `_dequantize_kernel` and calls the
dense GEMM (`DEQUANTIZE_ABOVE_M`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quantization.ops import w4a16_alternatives as alternatives
from pagedserve.quantization.ops.tile_order import grouped_tile, k_slice


@triton.jit
def _weight_tile(qw_ptr, s_ptr, z_ptr, start, K, cols, col_ok, group_size, group_offset,
                 stride_qk, stride_sg, stride_zg, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BITS: tl.constexpr, SCALES: tl.constexpr,
                 TILE_GROUPS: tl.constexpr, OFFSETS: tl.constexpr):
    """Positions start..start + BLOCK_K of the weight, float32 [BLOCK_K, BLOCK_N]: the tile's
    words loaded once, each code shifted out of its word ([R, PER, BLOCK_N] -> position r *
    PER + i), then (code - zero) * scale or code * scale + offset (OFFSETS)."""
    PER: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_K // PER
    word_rows = start // PER + tl.arange(0, R)
    words = tl.load(qw_ptr + word_rows[:, None] * stride_qk + cols[None, :],
                    mask=(word_rows * PER < K)[:, None] & col_ok[None, :], other=0)
    shifts = tl.arange(0, PER) * BITS
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, (BLOCK_K, BLOCK_N)).to(tl.float32)
    if SCALES == 1:  # the tile is whole groups (or lies in one): one row each, broadcast
        group = (start + group_offset) // group_size + tl.arange(0, TILE_GROUPS)
        mask = (group * group_size - group_offset < K)[:, None] & col_ok[None, :]
        scale = tl.load(s_ptr + group[:, None] * stride_sg + cols[None, :], mask=mask,
                        other=0.0)
        zero = tl.load(z_ptr + group[:, None] * stride_zg + cols[None, :], mask=mask,
                       other=0)
        if TILE_GROUPS > 1:
            shape: tl.constexpr = (TILE_GROUPS, BLOCK_K // TILE_GROUPS, BLOCK_N)
            scale = tl.reshape(tl.broadcast_to(scale[:, None, :], shape), (BLOCK_K, BLOCK_N))
            zero = tl.reshape(tl.broadcast_to(zero[:, None, :], shape), (BLOCK_K, BLOCK_N))
    else:  # each position's group
        pos = start + tl.arange(0, BLOCK_K)
        group = (pos + group_offset) // group_size
        mask = (pos < K)[:, None] & col_ok[None, :]
        scale = tl.load(s_ptr + group[:, None] * stride_sg + cols[None, :], mask=mask,
                        other=0.0)
        zero = tl.load(z_ptr + group[:, None] * stride_zg + cols[None, :], mask=mask,
                       other=0)
    scale = scale.to(tl.float32)
    zero = zero.to(tl.float32)
    if OFFSETS:
        w = codes * scale + zero
    else:
        w = (codes - zero) * scale
    return w


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, y_ptr, M, N, K, group_size,
                  group_offset, stride_xm, stride_qk, stride_sg, stride_zg, stride_ys,
                  stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                  BITS: tl.constexpr, SCALES: tl.constexpr, TILE_GROUPS: tl.constexpr,
                  OFFSETS: tl.constexpr, PERMUTED: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    first, last = k_slice(K, BLOCK_K, SPLIT_K)
    if BLOCK_M == 1:  # one row: products summed over K once, at the end (no tensor cores)
        acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(first, last):
        start = t * BLOCK_K
        w = _weight_tile(qw_ptr, s_ptr, z_ptr, start, K, cols, col_ok, group_size,
                         group_offset, stride_qk, stride_sg, stride_zg, BLOCK_K, BLOCK_N, BITS,
                         SCALES, TILE_GROUPS, OFFSETS)
        pos = start + tl.arange(0, BLOCK_K)
        pos_ok = pos < K
        if PERMUTED:
            src = tl.load(perm_ptr + pos, mask=pos_ok, other=0)
        else:
            src = pos
        if BLOCK_M == 1:
            a = tl.load(x_ptr + rows * stride_xm + src, mask=pos_ok & (rows < M), other=0.0)
            acc2 += a.to(tl.float32)[:, None] * w
        else:
            a = tl.load(x_ptr + rows[:, None] * stride_xm + src[None, :],
                        mask=row_ok[:, None] & pos_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a.dtype))
    if BLOCK_M == 1:
        acc = tl.sum(acc2, 0)[None, :]
    out = y_ptr + tl.program_id(1) * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, y_ptr, M, N, stride_ps, stride_pm, stride_ym,
                       SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """Split-K's float32 partial products [SPLIT_K, M, N] summed into y (y's dtype)."""
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + s * stride_ps + row * stride_pm + cols, mask=ok, other=0.0)
    tl.store(y_ptr + row * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, group_size, group_offset,
                       stride_qk, stride_sg, stride_zg, stride_wk, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BITS: tl.constexpr, SCALES: tl.constexpr,
                       TILE_GROUPS: tl.constexpr, OFFSETS: tl.constexpr):
    """The weight in group order, [K, N] in w's dtype (the large-M path)."""
    start = tl.program_id(1) * BLOCK_K
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = _weight_tile(qw_ptr, s_ptr, z_ptr, start, K, cols, col_ok, group_size, group_offset,
                     stride_qk, stride_sg, stride_zg, BLOCK_K, BLOCK_N, BITS, SCALES, TILE_GROUPS,
                     OFFSETS)
    pos = start + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + pos[:, None] * stride_wk + cols[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(pos < K)[:, None] & col_ok[None, :])


@dataclass
class W4A16Weight:
    """A linear's 4- or 8-bit weight as the kernel reads it (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    group_size: int
    group_offset: int
    in_features: int
    bits: int = 4
    offsets: bool = False  # `zeros` holds float offsets: w = code * scale + offset

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def zero_stride(self) -> int:
        """0 where every group shares one row of zeros (symmetric formats store it once)."""
        return 0 if self.zeros.shape[0] == 1 else self.zeros.stride(0)

    @property
    def whole_word_groups(self) -> bool:
        """Whether every word's codes lie in one group (all formats' group sizes do)."""
        per_word = 32 // self.bits
        return self.scales.shape[0] == 1 or (self.group_size % per_word == 0
                                             and self.group_offset % per_word == 0)

    def tile_groups(self, block_k: int) -> int:
        """The groups a tile of `block_k` positions spans when it is whole groups (or lies
        in one): 1 or block_k / group_size, each read as one row of scales; 0 where groups
        do not line up with tiles, and each position's scale is read."""
        if self.scales.shape[0] == 1 or (self.group_size % block_k == 0
                                         and self.group_offset % block_k == 0):
            return 1
        if block_k % self.group_size == 0 and self.group_offset == 0:
            return block_k // self.group_size
        return 0

    def _scale_args(self, block_k: int) -> dict[str, int]:
        groups = self.tile_groups(block_k)
        return {"SCALES": 1 if groups else 2, "TILE_GROUPS": max(groups, 1)}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold it (for a module to register as buffers)."""
        held = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}
        return held if self.perm is None else {**held, "perm": self.perm}

    def dequantize_in_group_order(self, dtype: torch.dtype, out: torch.Tensor | None = None
                                  ) -> torch.Tensor:
        """[K, N] in `dtype`, row j the input `perm[j]` (j itself without a perm); written
        into `out` ([K, N] with contiguous rows, such as a column slice) when given."""
        k, n = self.in_features, self.out_features
        if out is None:
            out = torch.empty((k, n), dtype=dtype, device=self.qweight.device)
        grid = (triton.cdiv(n, 64), triton.cdiv(k, 128))
        _dequantize_kernel[grid](self.qweight, self.scales, self.zeros, out, n, k,
                                 self.group_size, self.group_offset, self.qweight.stride(0),
                                 self.scales.stride(0), self.zero_stride, out.stride(0),
                                 BLOCK_N=64, BLOCK_K=128, BITS=self.bits, OFFSETS=self.offsets,
                                 **self._scale_args(128))
        return out

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, inputs in the checkpoint's order (the tests' reference)."""
        ordered = self.dequantize_in_group_order(dtype)
        if self.perm is None:
            return ordered.t()
        w = torch.empty_like(ordered)
        w[self.perm.long()] = ordered
        return w.t()


def _contiguous_groups(group: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, int,
                                                     int] | None:
    """Inputs in group order: (perm or None, each run's group, the run length, the first run's
    shortfall), or None when the groups are not runs of one length."""
    k = group.numel()
    perm = None
    if k > 1 and not bool((group[1:] >= group[:-1]).all()):
        perm = torch.argsort(group, stable=True)
        group = group[perm]
    ids, runs = torch.unique_consecutive(group, return_counts=True)
    size = int(runs.max())
    if runs.numel() > 2 and bool((runs[1:-1] != size).any()):
        return None
    if runs.numel() > 1 and int(runs[-1]) > size:
        return None
    return perm, ids, size, size - int(runs[0]) if runs.numel() > 1 else 0


def w4a16_layout(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group: torch.Tensor, bits: int = 4, offsets: bool = False) -> W4A16Weight:
    """Codes [N, K] (0..2^bits - 1), zeros and scales [N, G], group [K] (`IntCodes`'
    fields; with `offsets`, `zeros` are float offsets: w = code * scale + offset) -> the
    kernel's layout, on the codes' device. Raises ValueError for groups that are not runs of
    one size once sorted (no format writes those)."""
    if bits not in (4, 8):
        raise ValueError(f"the W4A16 kernel reads 4- or 8-bit codes, not {bits}-bit")
    runs = _contiguous_groups(group.long())
    if runs is None:
        raise ValueError("the input groups are not of one size; the W4A16 kernel reads "
                         "groups of one size")
    perm, ids, size, offset = runs
    n, k = codes.shape
    if perm is not None:
        codes = codes[:, perm.to(codes.device)]
    per_word = 32 // bits
    c = torch.nn.functional.pad(codes.t(), (0, 0, 0, -k % per_word))  # [K padded, N]
    words = torch.zeros((c.shape[0] // per_word, n), dtype=torch.int64, device=codes.device)
    for i in range(per_word):  # one field at a time: no temporary larger than the words
        words |= c[i::per_word].to(torch.int64) << (i * bits)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    ids = ids.to(scales.device)
    scale_dtype = scales.dtype if scales.dtype in (torch.float16, torch.bfloat16) else \
        torch.float32
    # A zero of 2^bits (GPTQ v1) needs one bit more than the codes.
    zero_dtype = torch.float32 if offsets else torch.uint8 if bits == 4 else torch.int16
    zeros = zeros[:, ids].t().to(zero_dtype)
    if not offsets and bool((zeros == zeros[:1]).all()):
        zeros = zeros[:1]  # one row for every group: read with stride 0
    return W4A16Weight(words, scales[:, ids].t().to(scale_dtype).contiguous(),
                       zeros.contiguous(),
                       None if perm is None else perm.to(torch.int32).contiguous(), size,
                       offset, k, bits, offsets)


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # 0: enough K slices to give every SM two programs
    # `w4a16_alternatives`' kernels, where the groups are whole words: the one-row GEMV, and
    # from 16 rows a dot per bit-field; not yet measured against the default.
    gemv: bool = False
    field_dots: bool = False


# Keyed by M (the largest M each serves): `benchmarks/int4_linear.py --sweep` on an H100 80GB
# (2026-12-08, 38fd502; CUDA graphs over eight distinct 8B layers, 4-bit g128), a layer's four
# projections: M = 1 0.135 ms (bf16 0.168), 4 and 16 0.172 (0.17), 64 0.180 (0.17), 256
# 0.572 (0.199; the dequantized path 0.413, so above DEQUANTIZE_ABOVE_M it runs instead).
_TILES = (
    (2, Tiles(1, 32, 128, 1, 4, 3, 4)),
    (40, Tiles(16, 64, 128, 1, 4, 3, 0)),
    (160, Tiles(64, 128, 64, 4, 4, 3, 0)),
    (math.inf, Tiles(128, 64, 64, 8, 4, 3, 1)),
)
INTERPRETER_TILES = (
    (1, Tiles(1, 32, 32, 1, 1, 1)),
    (math.inf, Tiles(16, 32, 128, 1, 1, 1)),
)
# Above this many rows the weight is dequantized whole and the dense GEMM runs (None: never):
# at 64 rows the fused GEMM took 0.18 ms a layer against the dequantized path's 0.37, at 256
# 0.57 against 0.41 (H100, the sweep above); 128 lies between, not measured.
DEQUANTIZE_ABOVE_M: int | None = 128


def _table() -> tuple[tuple[float, Tiles], ...]:
    from pagedserve import envs

    path = envs.PAGEDSERVE_W4A16_TILES
    return _TILES if not path else _read_table(path)


@functools.lru_cache(maxsize=4)
def _read_table(path: str) -> tuple[tuple[float, Tiles], ...]:
    with open(path) as f:
        rows = json.load(f)
    return tuple(sorted(((math.inf if b == "inf" else int(b)), Tiles(**t))
                        for b, t in rows.items()))


def select_tiles(m: int, device: torch.device) -> Tiles:
    table = INTERPRETER_TILES if device.type == "cpu" else _table()
    return next(t for bound, t in table if m <= bound)


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split(t: Tiles, m: int, n: int, k: int, device: torch.device) -> int:
    k_tiles = triton.cdiv(k, t.block_k)
    if t.split_k:
        return max(1, min(t.split_k, k_tiles))
    if device.type != "cuda":
        return 1
    programs = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    sms = _sm_count(device.index)
    return max(1, min(triton.cdiv(2 * sms, programs), k_tiles, 16))


def w4a16_mm(x: torch.Tensor, weight: W4A16Weight, tiles: Tiles | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) -> [M, N] in x's dtype, written into `out` (a
    [M, N] view with contiguous rows, such as a column slice) when given."""
    m, k = x.shape
    if k != weight.in_features:
        raise ValueError(f"input has {k} features; the {weight.bits}-bit weight takes "
                         f"{weight.in_features}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = weight.out_features
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = tiles or select_tiles(m, x.device)
    split = _split(t, m, n, k, x.device)
    # Split K: each slice stores its float32 partial product, and one small kernel sums them.
    dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32,
                                              device=x.device)
    perm = weight.perm if weight.perm is not None else weight.qweight
    # Every kernel's leading arguments (`w4a16_alternatives`' take the same).
    args = (x, weight.qweight, weight.scales, weight.zeros, perm, dest, m, n, k,
            weight.group_size, weight.group_offset, x.stride(0), weight.qweight.stride(0),
            weight.scales.stride(0), weight.zero_stride, dest.stride(0) if split > 1 else 0,
            dest.stride(-2))
    if not alternatives.launch(t, args, weight, split):
        grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
        _w4a16_kernel[grid](*args, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                            GROUP_M=t.group_m, SPLIT_K=split, BITS=weight.bits,
                            OFFSETS=weight.offsets, PERMUTED=weight.perm is not None,
                            IEEE=x.dtype == torch.float32, num_warps=t.num_warps,
                            num_stages=t.num_stages, **weight._scale_args(t.block_k))
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(n, 1024), m)](dest, out, m, n, dest.stride(0),
                                                      dest.stride(1), out.stride(0),
                                                      SPLIT_K=split, BLOCK=1024)
    return out


def w4a16_linear(x: torch.Tensor, weight: W4A16Weight | list[W4A16Weight],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, plus `bias`. `weight` may be a layer's parts
    stacked along the outputs in order (a GGUF layer's parts of different block types); each
    writes its own columns."""
    parts = weight if isinstance(weight, list) else [weight]
    flat = x.reshape(-1, x.shape[-1])
    n = sum(p.out_features for p in parts)
    if DEQUANTIZE_ABOVE_M is not None and flat.shape[0] > DEQUANTIZE_ABOVE_M:
        products = [_dense_product(flat, p) for p in parts]
        out = products[0] if len(products) == 1 else torch.cat(products, dim=1)
    else:
        out = torch.empty((flat.shape[0], n), dtype=x.dtype, device=x.device)
        start = 0
        for p in parts:
            w4a16_mm(flat, p, out=out[:, start:start + p.out_features])
            start += p.out_features
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def _dense_product(flat: torch.Tensor, weight: W4A16Weight) -> torch.Tensor:
    """The large-M path: the whole weight dequantized, then the dense GEMM."""
    if weight.perm is not None:
        flat = flat.index_select(1, weight.perm)
    return flat @ weight.dequantize_in_group_order(flat.dtype)
