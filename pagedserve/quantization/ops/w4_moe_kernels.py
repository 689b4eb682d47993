"""4-bit experts in the Triton grouped GEMM: `moe_kernels.fused_experts` with each expert's
weights held as 4-bit codes and decoded in registers, tile by tile (never written out in 16
bits). Two formats, one layout (`W4Experts`):
- `codes` uint8 [E, N, K / 2]: two codes a byte along K, the low nibble first (MXFP4's
  `blocks` as gpt-oss stores them, flattened; int4 formats repacked so);
- MXFP4: `scales` uint8 [E, N, K / 32], e8m0 exponents (bias 127); w = e2m1(code) * 2^(s - 127);
- int4: `scales` float32 [E, N, K / group] and `zeros` uint8 [E, N, K / group] (0..16, 8 for
  symmetric formats); w = (code - zero) * scale.
Groups run along K in order (`group` inputs each), or, with `g_idx` int32 [E, P, K], each
input's group is read from it: act-order checkpoints (GPTQ's `desc_act`, compressed-tensors'
group actorder), whose map differs per expert and may differ between gate and up (P = 2: the
first half of the rows reads part 0, the second part 1), and a row-parallel slice of the
inputs that splits a group. Then `scales` and `zeros` are [E, N, G] for any G the map names.
Reading the group per input costs one BLOCK_K load per tile beside the codes: the scale and
zero loads are per element of the tile either way. Permuting each expert's inputs into group
order at load instead (what Marlin needs) would make the gate_up kernel gather the token's
activations through a per-expert permutation, column by column, on every tile.

The steps are `moe_kernels.py`'s (pairs sorted by expert and padded to BLOCK_M, no host sync):
a gate_up kernel that decodes the expert's gate and up tiles, accumulates in float32, adds the
bias and applies the activation (SiLU, or gpt-oss's clamped SwiGLU) rounding as the float
kernel does; a down kernel likewise, times the routing weight. The decode is exact in float32
(e2m1 times a power of two built from its bits; a small integer times a scale), and the tile is
rounded to the activation dtype before the dot, so the result is the float kernel's on the
dequantized weights (`tests/quantization/test_w4_moe_kernels.py`). Not yet run on a GPU; chosen by
the 4-bit MoE methods under `PAGEDSERVE_W4A16_KERNEL=1` (`w4_moe.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.models.moe_kernels import (
    Activation,
    MoeTiles,
    _activate,
    _block_pairs,
    _round,
    _Silu,
    _tile_coords,
    align_by_expert,
)


@triton.jit
def _w4_tile(codes_ptr, scales_ptr, zeros_ptr, g_ptr, w_cols, ks, k_ok, stride_cn, stride_sn,
             GROUP: tl.constexpr, MXFP4: tl.constexpr, G_IDX: tl.constexpr):
    """The float32 weights [BK, BN] of inputs `ks` and output rows `w_cols` of one expert
    (the pointers already at it; `g_ptr` at the rows' group map when G_IDX)."""
    byte = tl.load(codes_ptr + w_cols[None, :] * stride_cn + (ks // 2)[:, None],
                   mask=k_ok[:, None], other=0).to(tl.int32)
    code = (byte >> ((ks % 2) * 4)[:, None]) & 0xF
    if G_IDX:
        group = tl.load(g_ptr + ks, mask=k_ok, other=0).to(tl.int64)
    else:
        group = ks // GROUP
    at = w_cols[None, :] * stride_sn + group[:, None]
    if MXFP4:
        exponent = tl.load(scales_ptr + at, mask=k_ok[:, None], other=127).to(tl.int32)
        # e2m1 as twice its magnitude: exponent field 0 -> mantissa bit; else (2 + m) << (e - 1).
        field = (code >> 1) & 3
        mantissa = code & 1
        twice = tl.where(field == 0, mantissa, (2 + mantissa) << tl.maximum(field - 1, 0))
        value = tl.where(code >= 8, -twice, twice).to(tl.float32) * 0.5
        # 2^(s - 127) from its float32 bits (s = 0: the subnormal 2^-127).
        bits = tl.where(exponent == 0, 1 << 22, exponent << 23)
        w = value * bits.to(tl.float32, bitcast=True)
    else:
        scale = tl.load(scales_ptr + at, mask=k_ok[:, None], other=0.0)
        zero = tl.load(zeros_ptr + at, mask=k_ok[:, None], other=0).to(tl.int32)
        w = (code - zero).to(tl.float32) * scale
    return w


@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _w4_gate_up_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, g_ptr, bias_ptr, act_ptr, sorted_ptr,
    block_expert_ptr, num_padded_ptr, num_pairs, num_m, stride_xt, stride_ce, stride_cn,
    stride_se, stride_sn, stride_ge, stride_gp, stride_be, stride_at, alpha, limit,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, GROUP: tl.constexpr,
    MXFP4: tl.constexpr, G_IDX: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, pairs, valid, expert = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, num_pairs,
                                              BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_cols = (cols % INTER).to(tl.int64)  # past INTER: wrapped onto real rows, not stored
    up_cols = gate_cols + INTER
    x_rows = x_ptr + (pairs // TOP_K)[:, None] * stride_xt
    codes = codes_ptr + expert * stride_ce
    scales = scales_ptr + expert * stride_se
    zeros = zeros_ptr + expert * stride_se
    g_gate = g_ptr + expert * stride_ge
    g_up = g_gate + stride_gp  # 0 where gate and up share one map
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < HIDDEN
        a = tl.load(x_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        wg = _w4_tile(codes, scales, zeros, g_gate, gate_cols, ks, k_ok, stride_cn, stride_sn,
                      GROUP, MXFP4, G_IDX).to(a.dtype)
        wu = _w4_tile(codes, scales, zeros, g_up, up_cols, ks, k_ok, stride_cn, stride_sn,
                      GROUP, MXFP4, G_IDX).to(a.dtype)
        if IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_be
        acc_g += tl.load(bias + gate_cols).to(tl.float32)[None, :]
        acc_u += tl.load(bias + up_cols).to(tl.float32)[None, :]
    dt: tl.constexpr = act_ptr.dtype.element_ty
    out = _activate(_round(acc_g, dt), _round(acc_u, dt), alpha, limit, dt, SWIGLU)
    tl.store(act_ptr + rows[:, None] * stride_at + cols[None, :], out.to(dt),
             mask=(cols < INTER)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _w4_down_kernel(
    act_ptr, codes_ptr, scales_ptr, zeros_ptr, g_ptr, bias_ptr, weights_ptr, out_ptr,
    sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_m, stride_at, stride_ce,
    stride_cn, stride_se, stride_sn, stride_ge, stride_be, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, GROUP: tl.constexpr, MXFP4: tl.constexpr,
    G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, pairs, valid, expert = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, num_pairs,
                                              BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = (cols % HIDDEN).to(tl.int64)
    a_rows = act_ptr + rows[:, None] * stride_at
    codes = codes_ptr + expert * stride_ce
    scales = scales_ptr + expert * stride_se
    zeros = zeros_ptr + expert * stride_se
    groups = g_ptr + expert * stride_ge
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < INTER
        a = tl.load(a_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        w = _w4_tile(codes, scales, zeros, groups, w_cols, ks, k_ok, stride_cn, stride_sn,
                     GROUP, MXFP4, G_IDX).to(a.dtype)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + w_cols).to(tl.float32)[None, :]
    dt: tl.constexpr = out_ptr.dtype.element_ty
    y = _round(acc, dt) * tl.load(weights_ptr + pairs).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], y.to(dt),
             mask=valid[:, None] & (cols < HIDDEN)[None, :])


@dataclass(frozen=True)
class W4Experts:
    """One projection of all experts in 4 bits (the module docstring's layout): [E, N, K]."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None  # int4 only
    group: int  # inputs a group, in order; unused with g_idx
    g_idx: torch.Tensor | None = None  # int32 [E, P, K]: each input's group, P parts of rows

    @property
    def mxfp4(self) -> bool:
        return self.zeros is None

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half = self.codes.shape
        return e, n, 2 * half

    def dequantize(self) -> torch.Tensor:
        """float32 [E, N, K] (the tests' reference, with torch ops)."""
        e, n, k = self.shape
        if self.g_idx is None:
            groups = (torch.arange(k, device=self.codes.device) // self.group)[None, None]
        else:
            groups = self.g_idx.long()
        rows = n // groups.shape[1]
        return torch.cat([self._dequantize_rows(slice(p * rows, (p + 1) * rows),
                                                groups[:, p, None, :].expand(e, rows, k))
                          for p in range(groups.shape[1])], dim=1)

    def _dequantize_rows(self, rows: slice, group: torch.Tensor) -> torch.Tensor:
        """float32 [E, R, K] of rows `rows`, `group` [E, R, K] each weight's group (a view)."""
        codes = self.codes[:, rows]
        codes = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2).long()
        scales = self.scales[:, rows]
        if self.mxfp4:
            e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=codes.device)
            values = e2m1[codes & 7] * (1 - 2 * (codes >> 3)).float()
            return values * torch.exp2(scales.float() - 127).gather(-1, group)
        zero = self.zeros[:, rows].long().gather(-1, group)
        return (codes - zero).float() * scales.float().gather(-1, group)


def _check(x: torch.Tensor, gate_up: W4Experts, down: W4Experts) -> None:
    e, two_i, hidden = gate_up.shape
    if x.shape[1] != hidden or two_i % 2 or down.shape != (e, hidden, two_i // 2):
        raise ValueError(f"4-bit expert shapes do not fit: x {tuple(x.shape)}, gate_up "
                         f"{gate_up.shape}, down {down.shape}")
    for w, parts in ((gate_up, (1, 2)), (down, (1,))):
        _check_groups(w, parts)


def _check_groups(w: W4Experts, parts: tuple[int, ...]) -> None:
    """Shapes only (a group map's values are checked where it is built, `w4_moe.py`)."""
    e, n, k = w.shape
    if w.g_idx is not None:
        if (w.g_idx.dtype != torch.int32 or w.g_idx.dim() != 3
                or w.g_idx.shape[0] != e or w.g_idx.shape[1] not in parts
                or w.g_idx.shape[2] != k or w.scales.shape[:2] != (e, n)
                or (w.zeros is not None and w.zeros.shape != w.scales.shape)):
            raise ValueError(f"4-bit experts {w.shape} with a group map need g_idx int32 "
                             f"[{e}, {' or '.join(map(str, parts))}, {k}] and scales (and "
                             f"zeros) [{e}, {n}, groups]; got g_idx {w.g_idx.dtype} "
                             f"{tuple(w.g_idx.shape)}, scales {tuple(w.scales.shape)}")
        return
    if w.group <= 0 or k % w.group or w.scales.shape != (e, n, k // w.group) or (
            w.zeros is not None and w.zeros.shape != w.scales.shape):
        raise ValueError(f"4-bit experts of {k} inputs in groups of {w.group} need scales "
                         f"(and zeros) of shape {(e, n, k // max(w.group, 1))}; "
                         f"got {tuple(w.scales.shape)}")


def _group_args(w: W4Experts) -> tuple[torch.Tensor, int, int]:
    """(map pointer, expert stride, second part's offset) for the kernels; the scales stand in
    for the pointer where the groups run in order (never read)."""
    if w.g_idx is None:
        return w.scales, 0, 0
    return w.g_idx, w.g_idx.stride(0), w.g_idx.stride(1) if w.g_idx.shape[1] == 2 else 0


# The interpreter runs programs one after another: few, whole tiles.
INTERPRETER_TILES = MoeTiles(16, 32, 32, 32, 1, 1, 1)
# Keyed by T * k / E rows per expert, as `moe_kernels.select_tiles`. Not measured on a device.
# The float kernel's tiles do not fit the decode in registers (ptxas for sm_90a under triton
# 3.6, `scripts/gguf_kernel_resources.py`: up to 10 KB of spills, and its prefill tile needs
# 288 KB of shared memory for int4, above the SM's 227 KB); these use at most 213 registers
# and 40 KB and spill nothing (with group maps, under triton 3.7.1: at most 170, 40 KB, none).
_TILES = (
    (8.0, MoeTiles(16, 32, 64, 32, 1, 4, 2)),
    (float("inf"), MoeTiles(64, 32, 64, 64, 4, 8, 2)),
)


def select_w4_tiles(rows_per_expert: float, device: torch.device) -> MoeTiles:
    if device.type == "cpu":
        return INTERPRETER_TILES
    return next(t for bound, t in _TILES if rows_per_expert <= bound)


def w4_fused_experts(x: torch.Tensor, gate_up: W4Experts, down: W4Experts,
                     weights: torch.Tensor, ids: torch.Tensor,
                     activation: Activation = _Silu(),
                     gate_up_bias: torch.Tensor | None = None,
                     down_bias: torch.Tensor | None = None,
                     tiles: MoeTiles | None = None) -> torch.Tensor:
    """`moe.torch_experts` on 4-bit experts: x [T, H]; gate_up [E, 2I, H] (gate rows, then
    up rows), down [E, H, I]; biases [E, 2I] and [E, H]; weights and ids [T, k] -> [T, H] in
    x's dtype."""
    _check(x, gate_up, down)
    num_tokens, top_k = ids.shape
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x)
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    tiles = tiles or select_w4_tiles(num_tokens * top_k / num_experts, x.device)
    sorted_pairs, block_expert, num_padded = align_by_expert(ids, num_experts, tiles.block_m)
    num_m, num_pairs = block_expert.numel(), num_tokens * top_k
    x = x.contiguous()
    ieee = x.dtype == torch.float32
    common = dict(IEEE=ieee, BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k,
                  GROUP_M=tiles.group_m, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)
    act = torch.empty(num_m * tiles.block_m, inter, dtype=x.dtype, device=x.device)
    gz = gate_up.zeros if gate_up.zeros is not None else gate_up.scales
    gb = gate_up_bias if gate_up_bias is not None else gate_up.scales
    gg, stride_ge, stride_gp = _group_args(gate_up)
    _w4_gate_up_kernel[(num_m * triton.cdiv(inter, tiles.block_n_up),)](
        x, gate_up.codes, gate_up.scales, gz, gg, gb, act, sorted_pairs, block_expert,
        num_padded, num_pairs, num_m, x.stride(0), gate_up.codes.stride(0),
        gate_up.codes.stride(1), gate_up.scales.stride(0), gate_up.scales.stride(1), stride_ge,
        stride_gp, gb.stride(0), act.stride(0), activation.alpha, activation.limit,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, GROUP=max(gate_up.group, 1),
        MXFP4=gate_up.mxfp4, G_IDX=gate_up.g_idx is not None,
        SWIGLU=activation.kind == "swiglu_clamped", HAS_BIAS=gate_up_bias is not None,
        BLOCK_N=tiles.block_n_up, **common)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    dz = down.zeros if down.zeros is not None else down.scales
    db = down_bias if down_bias is not None else down.scales
    dg, stride_de, _ = _group_args(down)
    _w4_down_kernel[(num_m * triton.cdiv(hidden, tiles.block_n_down),)](
        act, down.codes, down.scales, dz, dg, db, weights.reshape(-1).contiguous(), out,
        sorted_pairs, block_expert, num_padded, num_pairs, num_m, act.stride(0),
        down.codes.stride(0), down.codes.stride(1), down.scales.stride(0),
        down.scales.stride(1), stride_de, db.stride(0), out.stride(0), HIDDEN=hidden,
        INTER=inter, GROUP=max(down.group, 1), MXFP4=down.mxfp4, G_IDX=down.g_idx is not None,
        HAS_BIAS=down_bias is not None, BLOCK_N=tiles.block_n_down, **common)
    return out if top_k == 1 else out.view(num_tokens, top_k, -1).sum(1)
