"""The Mixture-of-Experts expert computation on CUDA as two Triton grouped GEMMs over the
(token, slot) pairs sorted by expert: the CUDA path of `moe.FusedMoE`, whose reference is
`moe.torch_experts` (the design follows vLLM's fused_moe).

1. `moe_align.align_by_expert`: the T*k pairs grouped by expert, each expert's run padded to a
   multiple of BLOCK_M with the invalid pair id T*k, so that every BLOCK_M block of the list
   belongs to one expert. No host sync: the buffers are sized by an upper bound from T, k, E
   and BLOCK_M (`max_blocks`) and the real length stays a device tensor that the kernels read
   to exit early, so a decode step can be captured in a CUDA graph.
2. `_gate_up_kernel`: one program per (block of sorted pairs, BLOCK_N columns of I) gathers the
   x rows of the block's tokens, accumulates the matching gate and up tiles of the block's
   expert in float32 over H, adds the bias and writes act(gate, up) to the intermediate row of
   each sorted position ([padded pairs, I]: the down GEMM then reads whole blocks contiguously,
   and gate_up never goes through memory).
3. `_down_kernel`: the same grid over H: intermediate @ W_down[expert]^T + bias, times the
   pair's routing weight, into row `pair` of [T*k, H]. The k rows of each token are summed
   afterwards (no atomics: the result does not depend on the order programs run in).

Rounding follows torch_experts: float32 accumulation, then in 16 bits the projections round to
the model dtype (as F.linear's output does) and so does each op of the activation, so bf16
results stay within a rounding step of the torch path. Float32 dots run in IEEE float32 (no
tf32). Importing this module imports triton: FusedMoE does so on its first CUDA forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
import triton
import triton.language as tl

from pagedserve.models.moe_align import align_by_expert


class Activation(Protocol):
    """What the kernels read of `moe.ExpertActivation` (kept structural, so this module does
    not import the layer that dispatches to it)."""

    kind: str
    alpha: float
    limit: float


@dataclass(frozen=True)
class _Silu:
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class MoeTiles:
    """Launch shape of both GEMMs. block_m: sorted pairs per program (the alignment's padding
    unit); block_n_up: columns of I per gate_up program (which holds a gate and an up tile);
    block_n_down: columns of H per down program; block_k: reduction step; group_m: row blocks
    that walk the column tiles together, so a block's gathered rows and an expert's weight tiles
    are reused from L2."""

    block_m: int
    block_n_up: int
    block_n_down: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Keyed by the average rows an expert gets, T * k / E: that is what BLOCK_M must fit (each hit
# expert pads its rows up to a multiple of it), and it lets one table serve Qwen3-MoE (k 8 of
# 128), Mixtral (2 of 8) and gpt-oss (4 of 32/128). Hopper, 16-bit:
# - up to ~8 rows (decode), chosen by reasoning: the step only streams the hit experts'
#   weights, so BLOCK_M 16 (the smallest dot) wastes the least on padding, and narrow column
#   tiles with a long BLOCK_K give the 132 SMs enough programs, and bytes in flight, on one
#   expert's weights (Qwen3-30B-A3B at batch 1: 8 experts x 24 gate_up tiles = 192 programs).
# - more rows: the fastest of 12 shapes swept on an H100 (`benchmarks/moe_kernels.py --sweep
#   --tiles ...`, Qwen3-30B-A3B's layer at 512 / 2,048 / 8,192 tokens, 2026-12-06; 3%, 20% and
#   21% faster than the shapes chosen by reasoning before): wide column tiles (the gate_up
#   program holds a 128-column gate and up tile, so 256 output columns, as the down program's)
#   over BLOCK_K 64, 4 stages, 8 warps. Shared memory per program, (block_m + 2 * block_n_up) *
#   block_k * 2 bytes a stage, is 196 KB of the 227 KB.
_TILES_16BIT = (
    (2.0, MoeTiles(16, 32, 64, 128, 1, 4, 4)),
    (8.0, MoeTiles(16, 64, 128, 128, 1, 4, 3)),
    (32.0, MoeTiles(64, 128, 256, 64, 1, 8, 4)),
    (128.0, MoeTiles(128, 128, 256, 64, 8, 8, 4)),
    (float("inf"), MoeTiles(128, 128, 256, 64, 1, 8, 4)),
)
# The interpreter runs programs one after another: few programs, each a whole tile, are fastest.
INTERPRETER_TILES = MoeTiles(64, 64, 64, 64, 1, 1, 1)


def select_tiles(rows_per_expert: float, dtype: torch.dtype, device: torch.device) -> MoeTiles:
    """The launch shape for T * k / E rows per expert."""
    if device.type == "cpu":
        return INTERPRETER_TILES
    tiles = next(t for bound, t in _TILES_16BIT if rows_per_expert <= bound)
    if dtype == torch.float32:
        # IEEE float32 dots run on the FMA units with twice the bytes per element: smaller
        # tiles keep registers and shared memory in bounds; float32 MoE on a GPU is for tests.
        tiles = replace(tiles, block_m=min(tiles.block_m, 64), block_n_up=32, block_n_down=64,
                        block_k=32, num_warps=4, num_stages=2)
    return tiles


@triton.jit
def _tile_coords(num_m, NUM_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program: GROUP_M row blocks take each column tile in
    turn, so neighbouring programs share weight tiles (same expert) and gathered rows in L2."""
    pid = tl.program_id(0)
    width = GROUP_M * NUM_N
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _block_pairs(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """The block's sorted positions, pair ids (padding mapped to pair 0, a safe address whose
    results are never stored), validity, and expert."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    valid = pairs < num_pairs
    pairs = tl.where(valid, pairs, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return rows.to(tl.int64), pairs, valid, expert


@triton.jit
def _load_k(ptrs, ks, K: tl.constexpr, BLOCK_K: tl.constexpr, K_AXIS: tl.constexpr,
            UPCAST: tl.constexpr):
    """A tile whose K_AXIS runs over the reduction: masked only where K is not a multiple of
    BLOCK_K; UPCAST to float32 for the interpreter, whose 16-bit dots are broken."""
    if K % BLOCK_K == 0:
        tile = tl.load(ptrs)
    elif K_AXIS == 1:
        tile = tl.load(ptrs, mask=(ks < K)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs, mask=(ks < K)[:, None], other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _round(x, dt: tl.constexpr):
    """x rounded to the model dtype and back: where torch's 16-bit ops store a result."""
    return x.to(dt).to(tl.float32)


@triton.jit
def _activate(gate, up, alpha, limit, dt: tl.constexpr, SWIGLU: tl.constexpr):
    """ExpertActivation on float32 tiles already rounded to dt, rounding after each op as the
    torch path does; the caller rounds the product."""
    if SWIGLU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = _round(tl.sigmoid(_round(gate * alpha, dt)), dt)
        return _round(gate * sig, dt) * _round(up + 1.0, dt)
    return _round(gate / (1.0 + tl.exp(-gate)), dt) * up


@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _gate_up_kernel(
    x_ptr, w_ptr, bias_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, num_m, stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be,
    stride_bn, stride_at, alpha, limit,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, SWIGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """act[rows, cols] = act(x[token] @ Wg[e, cols]^T + bg, x[token] @ Wu[e, cols]^T + bu)."""
    pid_m, pid_n = _tile_coords(num_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, pairs, valid, expert = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, num_pairs,
                                              BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past INTER wrap onto real ones, so weight loads need no mask; they are not stored.
    w_cols = (cols % INTER).to(tl.int64)
    x_rows = x_ptr + (pairs // TOP_K)[:, None] * stride_xt
    gate_rows = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = _load_k(x_rows + ks[None, :] * stride_xh, ks, HIDDEN, BLOCK_K, 1, UPCAST)
        wg = _load_k(gate_rows + ks[:, None] * stride_wh, ks, HIDDEN, BLOCK_K, 0, UPCAST)
        wu = _load_k(up_rows + ks[:, None] * stride_wh, ks, HIDDEN, BLOCK_K, 0, UPCAST)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_be + w_cols * stride_bn
        acc_g += tl.load(bias).to(tl.float32)[None, :]
        acc_u += tl.load(bias + INTER * stride_bn).to(tl.float32)[None, :]
    dt: tl.constexpr = act_ptr.dtype.element_ty
    out = _activate(_round(acc_g, dt), _round(acc_u, dt), alpha, limit, dt, SWIGLU)
    # Padding rows are written too (from pair 0's token), so that every row the down kernel
    # reads below num_padded is defined.
    tl.store(act_ptr + rows[:, None] * stride_at + cols[None, :], out.to(dt),
             mask=(cols < INTER)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _down_kernel(
    act_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    num_padded_ptr, num_pairs, num_m, stride_at, stride_we, stride_wn, stride_wi, stride_be,
    stride_bn, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[pair, cols] = weight[pair] * (act[rows] @ Wd[e, cols]^T + bd), for valid pairs."""
    pid_m, pid_n = _tile_coords(num_m, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, pairs, valid, expert = _block_pairs(sorted_ptr, block_expert_ptr, pid_m, num_pairs,
                                              BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = (cols % HIDDEN).to(tl.int64)
    a_rows = act_ptr + rows[:, None] * stride_at
    w_rows = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = _load_k(a_rows + ks[None, :], ks, INTER, BLOCK_K, 1, UPCAST)
        w = _load_k(w_rows + ks[:, None] * stride_wi, ks, INTER, BLOCK_K, 0, UPCAST)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + w_cols * stride_bn).to(tl.float32)[None, :]
    dt: tl.constexpr = out_ptr.dtype.element_ty
    y = _round(acc, dt) * tl.load(weights_ptr + pairs).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], y.to(dt),
             mask=valid[:, None] & (cols < HIDDEN)[None, :])


@dataclass(frozen=True)
class _Aligned:
    """`align_by_expert`'s output, with the pair count and k the kernels need beside it."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    num_pairs: int
    top_k: int


def _dot_modes(x: torch.Tensor) -> dict[str, object]:
    """16-bit dots on the tensor cores; float32 ones in IEEE float32, not tf32, to match the
    torch path; the interpreter (CPU tensors) takes everything to float32."""
    upcast = x.device.type == "cpu"
    ieee = upcast or x.dtype == torch.float32
    return dict(UPCAST=upcast, DOT_PRECISION="ieee" if ieee else None)


def _bias_args(bias: torch.Tensor | None, fallback: torch.Tensor) -> tuple:
    """(pointer, strides) of a bias; without one, any tensor as the pointer (HAS_BIAS is off)."""
    if bias is None:
        return fallback, 0, 0
    return bias, bias.stride(0), bias.stride(1)


def _gate_up(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
             activation: Activation, al: _Aligned, tiles: MoeTiles) -> torch.Tensor:
    """The activated intermediate [padded pairs, I], rows in sorted order."""
    num_m = al.block_expert.numel()
    inter = w.shape[1] // 2
    act = torch.empty(num_m * tiles.block_m, inter, dtype=x.dtype, device=x.device)
    grid = (num_m * triton.cdiv(inter, tiles.block_n_up),)
    bias_t, stride_be, stride_bn = _bias_args(bias, w)
    _gate_up_kernel[grid](
        x, w, bias_t, act, al.sorted_pairs, al.block_expert, al.num_padded, al.num_pairs,
        num_m, x.stride(0), x.stride(1), *w.stride(), stride_be, stride_bn, act.stride(0),
        activation.alpha, activation.limit,
        HIDDEN=x.shape[1], INTER=inter, TOP_K=al.top_k, SWIGLU=activation.kind == "swiglu_clamped",
        HAS_BIAS=bias is not None, **_dot_modes(x), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n_up, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return act


def _down(act: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
          weights: torch.Tensor, al: _Aligned, tiles: MoeTiles) -> torch.Tensor:
    """[T * k, H]: each pair's weighted expert output, in pair order."""
    num_m = al.block_expert.numel()
    hidden, inter = w.shape[1], w.shape[2]
    out = torch.empty(al.num_pairs, hidden, dtype=act.dtype, device=act.device)
    grid = (num_m * triton.cdiv(hidden, tiles.block_n_down),)
    bias_t, stride_be, stride_bn = _bias_args(bias, w)
    _down_kernel[grid](
        act, w, bias_t, weights, out, al.sorted_pairs, al.block_expert, al.num_padded,
        al.num_pairs, num_m, act.stride(0), *w.stride(), stride_be, stride_bn, out.stride(0),
        HIDDEN=hidden, INTER=inter, HAS_BIAS=bias is not None, **_dot_modes(act),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n_down, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def _check(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
           ids: torch.Tensor) -> None:
    if not x.dtype == gate_up_proj.dtype == down_proj.dtype:
        raise ValueError(f"fused_experts needs one dtype: x {x.dtype}, gate_up_proj "
                         f"{gate_up_proj.dtype}, down_proj {down_proj.dtype}")
    experts, two_i, hidden = gate_up_proj.shape
    if x.shape[1] != hidden or two_i % 2 or down_proj.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"expert shapes do not fit: x {tuple(x.shape)}, gate_up_proj "
                         f"{tuple(gate_up_proj.shape)}, down_proj {tuple(down_proj.shape)}")
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} do not match x {tuple(x.shape)}")


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  activation: Activation = _Silu(),
                  gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, *,
                  tiles: MoeTiles | None = None) -> torch.Tensor:
    """`moe.torch_experts` as Triton grouped GEMMs, without a host sync: x [T, H];
    gate_up_proj [E, 2I, H] (gate rows, then up rows); down_proj [E, H, I]; optional biases
    [E, 2I] and [E, H]; weights and ids [T, k] -> [T, H] in x's dtype. `tiles` overrides the
    launch shape (`select_tiles`)."""
    _check(x, gate_up_proj, down_proj, ids)
    num_tokens, top_k = ids.shape
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x)
    num_experts = gate_up_proj.shape[0]
    tiles = tiles or select_tiles(num_tokens * top_k / num_experts, x.dtype, x.device)
    al = _Aligned(*align_by_expert(ids, num_experts, tiles.block_m), num_tokens * top_k, top_k)
    act = _gate_up(x, gate_up_proj, gate_up_bias, activation, al, tiles)
    out = _down(act, down_proj, down_bias, weights.reshape(-1).contiguous(), al, tiles)
    # Pair t * k + j is row j of token t: with k = 1 the rows are the output already.
    return out if top_k == 1 else out.view(num_tokens, top_k, -1).sum(1)
