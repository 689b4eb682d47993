"""Paged attention for a whole step in one launch: prefills (with a cached prefix), chunked
prefills and decodes together, reading K/V straight from the pages through the block table.

Kernel `_unified_attention_kernel`
  grid:    (num_kv_heads, num_query_blocks, num_splits)
  order:   programs take query blocks in the map's order, which lists the blocks with the
           most keys first, so the final wave is the lightest.
  tiling:  a query block is BLOCK_Q consecutive new tokens of one request; the program takes all
           num_queries_per_kv query heads of its KV head for them, so its tile has
           BLOCK_M >= BLOCK_Q * num_queries_per_kv rows (row r: token r // qpk, head r % qpk of
           the group; padded rows are masked) and every K/V tile is loaded once for the group.
           Keys are walked in tiles of BLOCK_N (any multiple of 16, independent of the page
           size): the tile's page ids come from one vector load of the request's block-table row.
           Tiles that lie wholly inside every row's causal window run without masks; only the
           tiles at the diagonal, the sequence end and the window start are masked.
           Online softmax in base 2 with fp32 statistics and accumulator. The request of each
           query block and its first token come from a per-step map built on the host
           (`query_block_map`), so no search runs on the device.
  split:   with num_splits > 1 the key range of each program is cut into num_splits equal,
           BLOCK_N-aligned partitions (sized on the device from the sequence length, so the grid
           depends only on the batch size); each writes its partial (max, sum, acc) to fp32
           buffers for `decode_split_kv.reduce_split_kv` (acc of DV_PAD channels).
  layout:  query [T, H, D], out [T, H, D_v]; k_cache [num_blocks, block_size, Hkv, D] and
           v_cache [..., D_v] (any strides, the same for both: K/V outermost, or the K and V
           halves of one side-by-side buffer when D_v != D); block_table [B, max_blocks] int32;
           query_start_loc [B+1]; seq_lens [B]. Q/K tiles hold D_PAD channels, V tiles and the
           accumulator DV_PAD (each a padded power of two, masked), so D_v may differ from D.
  masks:   query i of a request with context c sits at position c + i and sees keys k with
           k <= c + i and, with a sliding window W, k > c + i - W. With USE_LIMIT a per-token
           limit replaces c + i in the first test (the last key of the query's image span, for
           models whose image tokens attend both ways), and the block's keys run to its rows'
           largest limit; the window still counts from c + i.
  sinks:   USE_SINKS adds one column per query head with logit sinks[h] that carries no value
           (gpt-oss): the running max of each row starts at the sink (in base 2) and the
           running sum at exp2(sink - sink) = 1, so it costs no pass of its own. Split programs
           leave it out; `reduce_split_kv` adds it once when merging.
  dtypes:  fp32/fp16/bf16. UPCAST converts every tile to fp32 right after its load (used for fp32
           and by the Triton interpreter, whose bf16 arithmetic is broken); otherwise the two
           dots run in the input dtype on tensor cores with fp32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.attention.ops.query_blocks import query_block_map  # noqa: F401 (re-export)


@dataclass(frozen=True)
class TileConfig:
    """Launch shape. block_m: target rows per program (query tokens x heads of one KV group);
    block_n: keys per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Hopper defaults, from `benchmarks/triton_tiles.py` on the H200 (d128, 32:8 heads, bf16, page
# 16): decode 64 x 2,048 took 129 us with these (4.16 TB/s; the earlier 16/64/4 warps/3 stages
# took ~189 us); prefill 8 x 2,048 took 919 us with 128/32/4 warps/4 stages against 970 us with
# 128/64/4/4 in the same sweep (and ~1,090 us with 128/128/8/3).
# Shared memory per program is about (block_m + 2 * num_stages * block_n) * D_PAD * element
# size: 96 KB for the prefill tiles at d128, within the H200's 227 KB.
PREFILL_TILES = TileConfig(block_m=128, block_n=32, num_warps=4, num_stages=4)
PREFILL_TILES_LARGE_HEAD = TileConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
DECODE_TILES = TileConfig(block_m=16, block_n=64, num_warps=2, num_stages=4)
DECODE_TILES_LARGE_HEAD = TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3)
FP32_TILES = TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
# Values narrower than keys (d128/dv64) at 6:2 heads: triton 3.6's ptxas dies (SIGSEGV) on the
# 4-stage prefill tile for sm_90a; 3 stages compile (scripts/kernel_resources.py's way of
# compiling without a GPU finds it).
PREFILL_TILES_DIFF_KV = TileConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)
# The interpreter runs programs one after another: few, large programs are fastest.
INTERPRETER_TILES = TileConfig(block_m=64, block_n=64, num_warps=1, num_stages=1)


def padded_head_size(head_size: int) -> int:
    """Channels a tile holds: the next power of two, at least 16 (the smallest dot)."""
    return max(16, triton.next_power_of_2(head_size))


def interpreting(device: torch.device) -> bool:
    return device.type == "cpu"


def select_tiles(device: torch.device, head_size: int, dtype: torch.dtype,
                 decode_only: bool, head_size_v: int | None = None) -> TileConfig:
    if interpreting(device):
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return FP32_TILES
    if decode_only:
        return DECODE_TILES_LARGE_HEAD if head_size > 128 else DECODE_TILES
    if head_size > 128:
        return PREFILL_TILES_LARGE_HEAD
    return PREFILL_TILES if head_size_v in (None, head_size) else PREFILL_TILES_DIFF_KV


def query_block_shape(num_queries_per_kv: int, tiles: TileConfig,
                      decode_only: bool) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): tokens per query block and the padded row count of its tile."""
    block_q = 1 if decode_only else max(1, tiles.block_m // num_queries_per_kv)
    block_m = max(16, triton.next_power_of_2(block_q * num_queries_per_kv))
    return block_q, block_m


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_pos, q_lim, k_base, v_base, table_row, new_k_base, new_v_base,
    new_first,
    tile_start, tile_end, sm_scale, soft_cap, window,
    stride_cb, stride_cs, stride_cd, stride_kt, stride_kd, stride_vt, stride_vd,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, HEAD_SIZE_V: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    FROM_INPUT: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Keys [tile_start, tile_end) in BLOCK_N tiles, from the pages (or, FROM_INPUT, from the
    step's key/value inputs: position k is token new_first + k). MASKED tiles check
    k < tile_end, the causal mask (CAUSAL) and the window; the others must be whole tiles
    that every row sees. Row r's causal limit is key q_lim[r] (q_pos[r], or the end of its
    image span), its window counts back from q_pos[r]."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_SIZE
    offs_dv = tl.arange(0, DV_PAD)
    dv_ok = offs_dv < HEAD_SIZE_V
    qk_scale = sm_scale * 1.4426950408889634  # base 2
    for tile in range(tile_start, tile_end, BLOCK_N):
        k_pos = tile + offs_n
        k_ok = k_pos < tile_end
        if FROM_INPUT:
            tok = (new_first + k_pos).to(tl.int64)
            k_ptrs = new_k_base + tok[None, :] * stride_kt + offs_d[:, None] * stride_kd
            v_ptrs = new_v_base + tok[:, None] * stride_vt + offs_dv[None, :] * stride_vd
        else:
            if MASKED:
                page = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
            else:
                page = tl.load(table_row + k_pos // BLOCK_SIZE)
            slot = page.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
            k_ptrs = k_base + slot[None, :] + offs_d[:, None] * stride_cd  # [D_PAD, BLOCK_N]
            v_ptrs = v_base + slot[:, None] + offs_dv[None, :] * stride_cd  # [BLOCK_N, DV_PAD]
        if MASKED:
            k = tl.load(k_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & dv_ok[None, :], other=0.0)
        else:  # channel masks only where a head size is padded
            if HEAD_SIZE != D_PAD:
                k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
            if HEAD_SIZE_V != DV_PAD:
                v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:  # an fp8 cache's tiles join the dots in the queries' dtype (else a no-op)
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s * (sm_scale / soft_cap)) * 1.4426950408889634
        if MASKED:
            seen = k_ok[None, :]
            if CAUSAL:
                seen = seen & (k_pos[None, :] <= q_lim[:, None])
            if USE_WINDOW:
                seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))

        # Scores stay unscaled: the scale goes into the max and into one FMA per element.
        if USE_SOFT_CAP:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # A row that has seen no key yet keeps max -inf; subtract 0 instead so no NaN appears.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        if USE_SOFT_CAP:
            p = tl.exp2(s - m_ref[:, None])
        else:
            p = tl.exp2(s * qk_scale - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_one(acc, l_i, m_i, q, k, v, take, sm_scale, soft_cap, USE_SOFT_CAP: tl.constexpr):
    """One key k [D_PAD] and its value v [DV_PAD] for the rows where `take` [BLOCK_M] holds:
    scores by an fp32 row-wise dot, then the same online-softmax update as a tile."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1)
    if USE_SOFT_CAP:
        s = soft_cap * _tanh(s * (sm_scale / soft_cap)) * 1.4426950408889634
    else:
        s = s * (sm_scale * 1.4426950408889634)
    s = tl.where(take, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref)
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]
    return acc, l_i, m_new


@triton.jit
def _attend_part(
    acc, l_i, m_i, q, q_pos, q_lim, k_base, v_base, table_row, new_k_base, new_v_base,
    new_first,
    start, front_end, mid_end, end, part_lo, part_hi, sm_scale, soft_cap, window,
    stride_cb, stride_cs, stride_cd, stride_kt, stride_kd, stride_vt, stride_vd,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, HEAD_SIZE_V: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FROM_INPUT: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Keys [start, end) as a masked front [start, front_end) (the window's start), whole
    unmasked tiles [front_end, mid_end) and a masked tail [mid_end, end), each clipped to this
    program's split [part_lo, part_hi)."""
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, q_lim, k_base, v_base, table_row, new_k_base, new_v_base,
        new_first,
        tl.maximum(start, part_lo), tl.minimum(front_end, part_hi),
        sm_scale, soft_cap, window, stride_cb, stride_cs, stride_cd,
        stride_kt, stride_kd, stride_vt, stride_vd,
        HEAD_SIZE, D_PAD, HEAD_SIZE_V, DV_PAD, BLOCK_SIZE, BLOCK_N, True, CAUSAL, FROM_INPUT,
        USE_WINDOW, USE_SOFT_CAP, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, q_lim, k_base, v_base, table_row, new_k_base, new_v_base,
        new_first,
        tl.maximum(front_end, part_lo), tl.minimum(mid_end, part_hi),
        sm_scale, soft_cap, window, stride_cb, stride_cs, stride_cd,
        stride_kt, stride_kd, stride_vt, stride_vd,
        HEAD_SIZE, D_PAD, HEAD_SIZE_V, DV_PAD, BLOCK_SIZE, BLOCK_N, False, CAUSAL, FROM_INPUT,
        USE_WINDOW, USE_SOFT_CAP, UPCAST, DOT_PRECISION)
    return _attend_tiles(
        acc, l_i, m_i, q, q_pos, q_lim, k_base, v_base, table_row, new_k_base, new_v_base,
        new_first,
        tl.maximum(mid_end, part_lo), tl.minimum(end, part_hi),
        sm_scale, soft_cap, window, stride_cb, stride_cs, stride_cd,
        stride_kt, stride_kd, stride_vt, stride_vd,
        HEAD_SIZE, D_PAD, HEAD_SIZE_V, DV_PAD, BLOCK_SIZE, BLOCK_N, True, CAUSAL, FROM_INPUT,
        USE_WINDOW, USE_SOFT_CAP, UPCAST, DOT_PRECISION)


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, key_ptr, value_ptr, slot_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr, qblock_req_ptr, qblock_start_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, lse_ptr, limit_ptr,
    sm_scale, v_scale, soft_cap, window,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_bt,
    NUM_HEADS: tl.constexpr, QPK: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_Q_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FUSED_WRITE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STORE_LSE: tl.constexpr, USE_LIMIT: tl.constexpr,
):
    kv_head = tl.program_id(0)
    qblock = tl.program_id(1)  # the map lists blocks heaviest first (query_block_map)
    split = tl.program_id(2)
    req = tl.load(qblock_req_ptr + qblock)
    q_off = tl.load(qblock_start_ptr + qblock)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len

    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_SIZE
    offs_dv = tl.arange(0, DV_PAD)
    dv_ok = offs_dv < HEAD_SIZE_V
    new_k_base = key_ptr + kv_head * stride_kh
    new_v_base = value_ptr + kv_head * stride_vh
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    if FUSED_WRITE:
        if split == 0:  # this block's new K/V of this head into the cache (slot -1: skipped)
            w = tl.arange(0, BLOCK_Q_PAD)
            w_tok = q_start + q_off + w
            w_slot = tl.load(slot_ptr + w_tok, mask=(w < BLOCK_Q) & (q_off + w < q_len),
                             other=-1).to(tl.int64)
            w_ok = (w_slot >= 0)[:, None] & d_ok[None, :]
            wv_ok = (w_slot >= 0)[:, None] & dv_ok[None, :]
            w_tok64 = w_tok.to(tl.int64)[:, None]
            w_row = (w_slot // BLOCK_SIZE) * stride_cb + (w_slot % BLOCK_SIZE) * stride_cs
            w_row = w_row[:, None]
            kw = tl.load(new_k_base + w_tok64 * stride_kt + offs_d[None, :] * stride_kd,
                         mask=w_ok)
            vw = tl.load(new_v_base + w_tok64 * stride_vt + offs_dv[None, :] * stride_vd,
                         mask=wv_ok)
            tl.store(k_base + w_row + offs_d[None, :] * stride_cd,
                     kw.to(k_cache_ptr.dtype.element_ty), mask=w_ok)
            tl.store(v_base + w_row + offs_dv[None, :] * stride_cd,
                     vw.to(v_cache_ptr.dtype.element_ty), mask=wv_ok)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_off + rows // QPK
    head = kv_head * QPK + rows % QPK
    row_ok = (rows < BLOCK_Q * QPK) & (q_idx < q_len)
    q_pos = context + q_idx
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this block needs: [lo, hi), cut into the cached context [lo, context), read from
    # the pages in BLOCK_N tiles aligned at tile_lo, and the step's new keys [context, hi),
    # read from the key/value inputs when FUSED_WRITE (else from the pages too).
    q_first = context + q_off
    q_last = tl.minimum(q_first + BLOCK_Q, seq_len) - 1
    hi = q_last + 1
    q_lim = q_pos
    if USE_LIMIT:  # rows of an image span see the whole span: the new keys end further on
        q_lim = tl.load(limit_ptr + token, mask=row_ok, other=0)
        hi = tl.minimum(tl.maximum(tl.max(q_lim, 0) + 1, hi), seq_len)
    if USE_WINDOW:
        lo = tl.maximum(q_first - window + 1, 0)
    else:
        lo = 0
    tile_lo = (lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        part = tl.cdiv(tl.cdiv(hi - tile_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        part_lo = tile_lo + split * part
        part_hi = tl.minimum(part_lo + part, hi)
    else:
        part_lo = tile_lo
        part_hi = hi
    # Unmasked tiles start inside every row's window and end where the context (or, among the
    # new keys, the first row's causal limit) ends.
    full_lo = tile_lo
    new_full_lo = context
    if USE_WINDOW:
        full_lo = tl.maximum(tile_lo, tl.cdiv(q_last - window + 1, BLOCK_N) * BLOCK_N)
        new_full_lo = tl.maximum(context, q_last - window + 1)
    front_end = tl.minimum(full_lo, context)
    mid_end = tl.maximum(front_end, (context // BLOCK_N) * BLOCK_N)
    new_front_end = tl.minimum(new_full_lo, hi)
    new_mid_end = new_front_end + tl.maximum(q_first + 1 - new_front_end, 0) // BLOCK_N * BLOCK_N

    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    if USE_SINKS:
        # The sink column first: max = its base-2 logit, sum = exp2(0). Every row's head is a
        # real head (padded rows only repeat them), so the load needs no mask.
        m_i = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    new_first = q_start - context
    # The cached context (whole tiles end at its last tile boundary), from the pages.
    acc, l_i, m_i = _attend_part(
        acc, l_i, m_i, q, q_pos, q_pos, k_base, v_base, table_row, new_k_base, new_v_base,
        new_first,
        tile_lo, front_end, mid_end, context, part_lo, part_hi,
        sm_scale, soft_cap, window, stride_cb, stride_cs, stride_cd,
        stride_kt, stride_kd, stride_vt, stride_vd,
        HEAD_SIZE, D_PAD, HEAD_SIZE_V, DV_PAD, BLOCK_SIZE, BLOCK_N, False, False,
        USE_WINDOW, USE_SOFT_CAP, UPCAST, DOT_PRECISION)
    if BLOCK_Q == 1:
        # A decode's one new key (position `context`), in registers: no tile loop of its own,
        # so a decode program keeps the shared memory of the context loop alone. Of a split
        # decode, the split whose range holds the key takes it.
        if FUSED_WRITE:
            k_new = tl.load(new_k_base + q_start.to(tl.int64) * stride_kt + offs_d * stride_kd,
                            mask=d_ok, other=0.0)
            v_new = tl.load(new_v_base + q_start.to(tl.int64) * stride_vt + offs_dv * stride_vd,
                            mask=dv_ok, other=0.0)
        else:
            page = tl.load(table_row + context // BLOCK_SIZE).to(tl.int64)
            slot = page * stride_cb + (context % BLOCK_SIZE) * stride_cs
            k_new = tl.load(k_base + slot + offs_d * stride_cd, mask=d_ok, other=0.0)
            v_new = tl.load(v_base + slot + offs_dv * stride_cd, mask=dv_ok, other=0.0)
        take = row_ok & (context >= part_lo) & (context < part_hi)
        acc, l_i, m_i = _attend_one(acc, l_i, m_i, q, k_new, v_new, take, sm_scale, soft_cap,
                                    USE_SOFT_CAP)
    else:
        # The step's new keys (whole tiles end at the block's first row; the rest is its
        # causal diagonal), from the key/value inputs when FUSED_WRITE.
        acc, l_i, m_i = _attend_part(
            acc, l_i, m_i, q, q_pos, q_lim, k_base, v_base, table_row, new_k_base, new_v_base,
            new_first, context, new_front_end, new_mid_end, hi, part_lo, part_hi,
            sm_scale, soft_cap, window, stride_cb, stride_cs, stride_cd,
            stride_kt, stride_kd, stride_vt, stride_vd,
            HEAD_SIZE, D_PAD, HEAD_SIZE_V, DV_PAD, BLOCK_SIZE, BLOCK_N, True, FUSED_WRITE,
            USE_WINDOW, USE_SOFT_CAP, UPCAST, DOT_PRECISION)

    if NUM_SPLITS > 1:
        # Partial results, indexed [token, head, split(, channel)].
        part_row = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_l_ptr + part_row, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part_row[:, None] * DV_PAD + offs_dv[None, :], acc,
                 mask=row_ok[:, None])
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None] * v_scale  # exact for a cache without scales (1.0)
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_dv[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
        if STORE_LSE:  # base 2, in the scaled logits' units: for a caller's merge
            tl.store(lse_ptr + token * NUM_HEADS + head,
                     tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)


def unified_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    qblock_req: torch.Tensor, qblock_start: torch.Tensor, num_qblocks: int, block_q: int,
    block_m: int, scale: float, tiles: TileConfig, sliding_window: int | None = None,
    soft_cap: float | None = None, num_splits: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    key: torch.Tensor | None = None, value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    lse: torch.Tensor | None = None, v_scale: float = 1.0,
    attend_limit: torch.Tensor | None = None,
) -> None:
    """Attention of query [T, H, D] over the paged cache (k_cache [..., D], v_cache [..., D_v])
    into `out` [T, H, D_v].

    qblock_req/qblock_start: the first `num_qblocks` entries of the per-step map of
    `query_block_map` (device int32). With num_splits > 1 (decode batches only: block_q 1) the
    results go to `partials` = (m [T, H, S], l [T, H, S], acc [T, H, S, DV_PAD]) fp32 instead
    of `out` (flat buffers, see `decode_split_kv.allocate_partials`) and `reduce_split_kv`
    merges them. With key [T, Hkv, D], value [T, Hkv, D_v] and slot_mapping [T] the kernel also
    writes the step's new K/V into the cache (each program its own block's tokens; slot -1
    skipped) and reads the new keys from key/value; without them the cache must already hold
    them. sinks [H] (any float dtype): per-head sink logits joining every softmax; a split
    launch takes none (`reduce_split_kv` adds them, once). lse [T, H] fp32 (contiguous; not
    with splits): also store each row's log-sum-exp in base 2 (scores times scale x log2(e)),
    for a caller that merges this softmax with another. v_scale multiplies the output (an fp8
    cache holds V / v_scale; its k_scale rides on `scale`); a split launch leaves it to
    `reduce_split_kv`. attend_limit [T] int32 (not with splits): the last key position each
    query sees, in place of its own (bidirectional image spans: `CommonAttentionMetadata.
    attend_limit`); the step must hold every key up to it. All sizes are host ints: no sync."""
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, head_size_v = k_cache.shape[2], v_cache.shape[3]
    if num_qblocks == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    if num_splits > 1 and (partials is None or block_q != 1):
        raise ValueError("the split-KV path is for decode batches and needs partial buffers")
    if num_splits > 1 and lse is not None:
        raise ValueError("a split launch writes partials, not a log-sum-exp")
    if num_splits > 1 and attend_limit is not None:
        raise ValueError("the split-KV path is for decodes, which see no key past their own")
    if num_splits > 1 and sinks is not None:
        raise ValueError("split partials leave the sinks out: reduce_split_kv adds them")
    fused = key is not None
    if fused and (value is None or slot_mapping is None):
        raise ValueError("writing K/V needs key, value and slot_mapping together")
    if fused and k_cache.dtype == torch.float8_e4m3fn:
        raise ValueError("an fp8 cache takes the step's K/V scaled, through reshape_and_cache")
    upcast = query.dtype == torch.float32 or interpreting(query.device)
    if partials is None:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m, part_l, part_acc = partials
    if not fused:
        key = value = query  # unused
        slot_mapping = seq_lens
    grid = (num_kv_heads, num_qblocks, num_splits)
    _unified_attention_kernel[grid](
        query, k_cache, v_cache, out, key, value, slot_mapping,
        block_table, query_start_loc, seq_lens, qblock_req, qblock_start,
        part_m, part_l, part_acc, query if sinks is None else sinks,
        out if lse is None else lse, seq_lens if attend_limit is None else attend_limit,
        scale, float(v_scale), soft_cap or 0.0, sliding_window or 0,
        *query.stride(), *out.stride(), *k_cache.stride(), *key.stride(), *value.stride(),
        block_table.stride(0),
        NUM_HEADS=num_heads, QPK=num_heads // num_kv_heads, HEAD_SIZE=head_size,
        D_PAD=padded_head_size(head_size), HEAD_SIZE_V=head_size_v,
        DV_PAD=padded_head_size(head_size_v), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q, BLOCK_Q_PAD=triton.next_power_of_2(block_q), BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, NUM_SPLITS=num_splits, FUSED_WRITE=fused,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        USE_SINKS=sinks is not None, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else None,
        STORE_LSE=lse is not None, USE_LIMIT=attend_limit is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
