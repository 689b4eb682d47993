"""FP8 experts in the Triton grouped GEMM: `moe_kernels.fused_experts` with block-scaled FP8
weights (DeepSeek-V3, Qwen3-MoE FP8 releases: 128 x 128 blocks per expert) and activations
quantized per token in 1 x 128 groups.

The layout and the steps are `models/moe_kernels.py`'s (pairs sorted by expert and padded to
BLOCK_M, one program per block of pairs and column tile, no host sync), with FP8 operands:
1. x quantized per token group (`fp8_block_gemm.quantize_per_token_group`);
2. `_fp8_gate_up_kernel`: the gathered rows' codes against the expert's gate and up tiles, each
   step of BLOCK_K (= the weight block's columns) scaled by the row's group scale and the
   columns' block scales, then SiLU-and-mul rounded to the model dtype as the float kernel does;
3. the intermediate quantized per row group;
4. `_fp8_down_kernel`: the same against the down tiles, times the pair's routing weight.
Scales: gate_up_scale [E, 2 * ceil(I / Bn), ceil(H / Bk)] (the gate's block rows, then the
up's: each part's own blocks, so I need not be a multiple of Bn), down_scale
[E, ceil(H / Bn), ceil(I / Bk)].
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from pagedserve.models.moe_kernels import (
    MoeTiles,
    _activate,
    _block_pairs,
    _round,
    _tile_coords,
    align_by_expert,
    select_tiles,
)
from pagedserve.quantization.ops.fp8_block_gemm import quantize_per_token_group


@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _fp8_gate_up_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, num_m, stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn,
    stride_at,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, SCALE_N: tl.constexpr,
    UP_SCALE_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, pairs, valid, expert = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, num_pairs,
                                              BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = (cols % INTER).to(tl.int64)
    tokens = pairs // TOP_K
    x_rows = xq_ptr + tokens[:, None] * stride_xt
    xs_rows = xs_ptr + tokens * stride_xst
    gate_rows = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    gs_rows = ws_ptr + expert * stride_wse + (w_cols // SCALE_N) * stride_wsn
    us_rows = gs_rows + UP_SCALE_ROW * stride_wsn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(HIDDEN, BLOCK_K)):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < HIDDEN
        a = tl.load(x_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        wg = tl.load(gate_rows + ks[:, None], mask=k_ok[:, None], other=0.0)
        wu = tl.load(up_rows + ks[:, None], mask=k_ok[:, None], other=0.0)
        a_s = tl.load(xs_rows + step)[:, None]
        acc_g += tl.dot(a, wg) * a_s * tl.load(gs_rows + step)[None, :]
        acc_u += tl.dot(a, wu) * a_s * tl.load(us_rows + step)[None, :]
    dt: tl.constexpr = act_ptr.dtype.element_ty
    out = _activate(_round(acc_g, dt), _round(acc_u, dt), 0.0, 0.0, dt, False)
    tl.store(act_ptr + rows[:, None] * stride_at + cols[None, :], out.to(dt),
             mask=(cols < INTER)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _fp8_down_kernel(
    aq_ptr, as_ptr, w_ptr, ws_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    num_padded_ptr, num_pairs, num_m, stride_at, stride_ast, stride_we, stride_wn, stride_wse,
    stride_wsn, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, pairs, valid, expert = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, num_pairs,
                                              BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = (cols % HIDDEN).to(tl.int64)
    a_rows = aq_ptr + rows[:, None] * stride_at
    as_rows = as_ptr + rows * stride_ast
    w_rows = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn
    ws_rows = ws_ptr + expert * stride_wse + (w_cols // SCALE_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(INTER, BLOCK_K)):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < INTER
        a = tl.load(a_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None], other=0.0)
        acc += (tl.dot(a, w) * tl.load(as_rows + step)[:, None]
                * tl.load(ws_rows + step)[None, :])
    dt: tl.constexpr = out_ptr.dtype.element_ty
    y = _round(acc, dt) * tl.load(weights_ptr + pairs).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], y.to(dt),
             mask=valid[:, None] & (cols < HIDDEN)[None, :])


# The interpreter runs programs one after another: few, whole tiles.
INTERPRETER_TILES = MoeTiles(16, 32, 32, 128, 1, 1, 1)


def fp8_fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor,
                      gate_up_scale: torch.Tensor, down_proj: torch.Tensor,
                      down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      block: tuple[int, int], tiles: MoeTiles | None = None) -> torch.Tensor:
    """SiLU experts on FP8 weights: x [T, H] in the model dtype; gate_up_proj [E, 2I, H] and
    down_proj [E, H, I] in e4m3 with the block scales above; weights and ids [T, k] ->
    [T, H] in x's dtype."""
    num_tokens, top_k = ids.shape
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    bn, bk = block
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x)
    if x.device.type == "cpu":
        tiles = INTERPRETER_TILES
    else:
        # One weight block's columns per step: one scale per row and column a step.
        tiles = replace(tiles or select_tiles(num_tokens * top_k / num_experts, x.dtype,
                                              x.device), block_k=bk)
    sorted_pairs, block_expert, num_padded = align_by_expert(ids, num_experts, tiles.block_m)
    num_m, num_pairs = block_expert.numel(), num_tokens * top_k
    xq, xs = quantize_per_token_group(x, bk)
    act = torch.empty(num_m * tiles.block_m, inter, dtype=x.dtype, device=x.device)
    _fp8_gate_up_kernel[(num_m * triton.cdiv(inter, tiles.block_n_up),)](
        xq, xs, gate_up_proj, gate_up_scale, act, sorted_pairs, block_expert, num_padded,
        num_pairs, num_m, xq.stride(0), xs.stride(0), gate_up_proj.stride(0),
        gate_up_proj.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1),
        act.stride(0), HIDDEN=hidden, INTER=inter, TOP_K=top_k, SCALE_N=bn,
        UP_SCALE_ROW=math.ceil(inter / bn), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n_up,
        BLOCK_K=bk, GROUP_M=tiles.group_m, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    aq, a_s = quantize_per_token_group(act, bk)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _fp8_down_kernel[(num_m * triton.cdiv(hidden, tiles.block_n_down),)](
        aq, a_s, down_proj, down_scale, weights.reshape(-1).contiguous(), out, sorted_pairs,
        block_expert, num_padded, num_pairs, num_m, aq.stride(0), a_s.stride(0),
        down_proj.stride(0), down_proj.stride(1), down_scale.stride(0), down_scale.stride(1),
        out.stride(0), HIDDEN=hidden, INTER=inter, SCALE_N=bn, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n_down, BLOCK_K=bk, GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out if top_k == 1 else out.view(num_tokens, top_k, -1).sum(1)
