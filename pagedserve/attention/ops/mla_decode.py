"""Multi-head latent attention in the weight-absorbed form over the paged latent cache: decode,
and (the same kernel with a causal mask over several query rows) prefill and mixed steps.

With W_UK folded into the query (q_lat = q_nope @ W_UK[h], one [L] vector per token and head)
the score of a cached token j is (q_lat . c_j + q_pe . kpe_j) * scale and the output is
sum_j p_j c_j in latent space, which the caller maps through W_UV. Every head reads the same
latent rows, so a program takes many heads at once and loads each page once for all of them.

Kernel `_mla_attention_kernel`
  grid:    one axis of num_query_blocks x num_splits x cdiv(num_heads, BLOCK_H) programs, the
           head block fastest: the programs that read the same latent rows (the head blocks of
           one query block and split) start together, so all but the first find the rows in L2.
  tiling:  a query block is BLOCK_Q consecutive new tokens of one request (the per-step map of
           ops.query_blocks: request and first token of every block, heaviest first); the tile
           has BLOCK_M = BLOCK_Q * BLOCK_H rows, row r = token r // BLOCK_H, head
           h0 + r % BLOCK_H. Decode steps use BLOCK_Q = 1, so a program holds BLOCK_H heads of
           one token. Keys are walked in BLOCK_N tiles (any size, independent of the page
           size); each tile loads c [BLOCK_N, L] and k_pe [BLOCK_N, R] once, and c serves both
           as the key (scores) and as the value (accumulator).
  softmax: online, base 2, fp32 statistics and accumulator [BLOCK_M, L_PAD].
  masks:   query i of a request with context ctx sits at position ctx + i and sees keys
           k <= ctx + i (for a decode that is the whole sequence). Rows of a tile past the
           program's last key re-read that key (always written) instead of a masked load, and
           score -inf.
  rescale: with LAZY_RESCALE the running maxima (and the accumulator's rescaling, a multiply
           of every [BLOCK_M, L] element) move only when a tile's maximum passes them by more
           than RESCALE_SLACK (base 2): p <= 2^RESCALE_SLACK, no overflow in fp32 or bf16, and
           the final division by the row sum makes the result the same softmax.
  splits:  decode launches may cut a sequence's keys into NUM_SPLITS whole-tile ranges; each
           writes a partial output and its log-sum-exp, merged by `_merge_splits_kernel`.
  pages:   the step's latents are written first (`write_latents`), so every key is read from
           the pages (one page id per tile when BLOCK_N divides the page size, else one per
           row: tiles start at multiples of BLOCK_N); block-table entries of -1 (padding
           requests of a captured graph) read page 0 and only produce output for padding rows.
  dtypes:  fp32/fp16/bf16; UPCAST (fp32, and the interpreter, whose bf16 arithmetic is broken)
           converts tiles to fp32 after the load and runs ieee dots.

On Hopper (sm_90a compiles: scripts/mla_kernel_resources.py) both dots are wgmma, q sits in
shared memory and the [64, 512] fp32 accumulator takes 128 registers a thread over 8 warps,
so an SM holds one program. Two things bound a 128-head decode before HBM does: its dots do
~240 FLOP per cache byte (2 x (L + R + L) per key and head), above the H200's bf16 ridge
(~206), so even every tensor-core cycle would give only ~85% of HBM's 4.8 TB/s; and Triton lays
a dot that feeds another dot out with every warp along M, so with 64 rows and 8 warps both
warpgroups compute the same scores (the score dot, 53% of the work, runs twice, in n16/n32
wgmma pieces that re-read q from shared memory). Reading each latent row once for all 128
heads would need a 256 KB accumulator: more than an SM's registers; the second head block's
read comes from L2 instead (the grid order above).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MLATiles:
    """Launch shape: block_h heads and block_q tokens per program, block_n keys per tile;
    decode steps (block_q 1) may split each sequence's keys over num_splits programs."""

    block_h: int
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    lazy_rescale: bool = True

    @property
    def block_m(self) -> int:
        return self.block_h * self.block_q


# GPU launch shape, chosen from sm_90a compiles (scripts/mla_kernel_resources.py), not yet
# timed (benchmarks/mla_decode.py --sweep picks among 42): the fp32 accumulator of 64 heads x
# 512 latent channels is 128 KB of registers over 8 warps, so one program fills an SM's
# registers and the latent rows of 128 heads are read by two programs. Its shared memory is q
# (BLOCK_M rows) plus two key tiles of BLOCK_N rows (one loading while one is used; more
# stages only fetch the page ids earlier): 64-key tiles at bf16 take 216 KB of the 227 KB,
# the most keys in flight per SM, and the fewest instructions per key (the score dot is
# issued in n32 wgmma pieces instead of n16). Eager rescaling: lazy rescaling's saved
# multiplies cost as many instructions in its program-wide test, and spill at 64-key tiles.
_DECODE_ROWS = 64
_PREFILL_ROWS = 64
_GPU_BLOCK_NS = (64, 32, 16)  # the largest whose two key buffers fit beside q
_GPU_WARPS = 8
_SMEM_BYTES = 227 * 1024
_INTERPRETER_ROWS = 64  # the interpreter runs programs in turn: few, large ones are fastest
# A decode step splits each sequence's keys while whole extra waves of programs fit on the SMs
# (one program per SM: registers). 64 x 4,096 x 128 heads is 128 programs on 132 SMs: no
# split (3 splits measured 492 us against 455 us unsplit on the H200, 2026-12-01).
_PROGRAMS_PER_SM = 1
# Programs of 16 heads or fewer (DeepSeek's 128 over 8 GPUs) count two per SM: 64 x 4,096 x
# 16 heads took 115.7 us in 4 splits against 193.5 us in 2 (H200, 2026-12-02, page 64).
_SMALL_HEAD_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 16
_MIN_TILES_PER_SPLIT = 4  # shorter splits cost more in partials and merging than they gain


def decode_splits(num_programs: int, num_sms: int, max_seq_len: int, block_n: int,
                  programs_per_sm: int = _PROGRAMS_PER_SM) -> int:
    """Key splits per sequence for a decode launch of `num_programs` (request, head block)
    programs: as many as fill whole waves of the SMs, none past the longest sequence
    (`max_seq_len` 0: unknown, as in a captured graph, which keeps its split count for every
    replay; a split past a sequence's end returns at once)."""
    if num_programs <= 0 or num_sms <= 0:
        return 1
    by_sms = (programs_per_sm * num_sms) // num_programs
    by_length = (max(1, max_seq_len // (_MIN_TILES_PER_SPLIT * block_n)) if max_seq_len
                 else _MAX_SPLITS)
    return max(1, min(_MAX_SPLITS, by_sms, by_length))


def gpu_key_tiles(block_m: int, block_size: int, row_bytes: int) -> tuple[int, int]:
    """(block_n, num_stages) for programs of `block_m` query rows over pages of `block_size`
    latent rows of `row_bytes` (padded L + R channels x element size): the largest key tile
    whose two buffers fit in shared memory beside q. Two stages when a tile lies in one page
    (one page id per tile), else three, so each row's page id is fetched a tile earlier; at
    bf16 DeepSeek widths those are the 64-key shapes that compile without spills."""
    fits = [n for n in _GPU_BLOCK_NS if (block_m + 2 * n) * row_bytes <= _SMEM_BYTES]
    block_n = fits[0] if fits else _GPU_BLOCK_NS[-1]
    return block_n, 2 if block_size % block_n == 0 else 3


def default_decode_tiles(num_sms: int, num_heads: int, num_reqs: int, block_size: int = 16,
                         row_bytes: int = 1152, max_seq_len: int = 0) -> MLATiles:
    """The GPU decode launch of `num_reqs` requests on `num_sms` SMs (row_bytes: DeepSeek's
    512 + 64 channels in bf16 unless given)."""
    block_h = min(max(16, triton.next_power_of_2(num_heads)), _DECODE_ROWS)
    block_n, stages = gpu_key_tiles(block_h, block_size, row_bytes)
    programs = num_reqs * triton.cdiv(num_heads, block_h)
    per_sm = _SMALL_HEAD_PROGRAMS_PER_SM if block_h <= 16 else _PROGRAMS_PER_SM
    splits = decode_splits(programs, num_sms, max_seq_len, block_n, per_sm)
    return MLATiles(block_h, 1, block_n=block_n, num_warps=_GPU_WARPS, num_stages=stages,
                    num_splits=splits, lazy_rescale=False)


def latent_row_bytes(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one latent row as the kernel holds it: both parts padded to powers of two."""
    padded = (max(16, triton.next_power_of_2(kv_lora_rank))
              + max(16, triton.next_power_of_2(rope_dim)))
    return padded * torch.empty((), dtype=dtype).element_size()


def select_mla_tiles(device: torch.device, num_heads: int, decode_only: bool,
                     num_reqs: int = 0, max_seq_len: int = 0, block_size: int = 16,
                     row_bytes: int = 1152) -> MLATiles:
    """Heads per program: all of them up to the row budget (the fewer head tiles, the fewer
    times a page is read); at least 16 rows, the smallest dot on a GPU. A decode step of
    `num_reqs` requests (longest `max_seq_len`) with too few programs to fill the GPU splits
    the keys. block_size and row_bytes (`latent_row_bytes`) size the key tiles."""
    interp = device.type == "cpu"
    rows = _INTERPRETER_ROWS if interp else (_DECODE_ROWS if decode_only else _PREFILL_ROWS)
    block_h = min(max(16, triton.next_power_of_2(num_heads)), rows)
    block_q = 1 if decode_only else max(1, rows // block_h)
    if interp:
        return MLATiles(block_h, block_q, block_n=64, num_warps=1, num_stages=1)
    if decode_only:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return default_decode_tiles(sms, num_heads, num_reqs, block_size, row_bytes,
                                    max_seq_len)
    block_n, stages = gpu_key_tiles(block_h * block_q, block_size, row_bytes)
    return MLATiles(block_h, block_q, block_n=block_n, num_warps=_GPU_WARPS,
                    num_stages=stages, lazy_rescale=False)


# LAZY_RESCALE's slack in base-2 logits: probabilities up to 2^8 before the running max moves.
RESCALE_SLACK: tl.constexpr = tl.constexpr(8.0)


@triton.jit
def _write_latents_kernel(src, cache, slots, stride_st, stride_sd, width,
                          BLOCK_D: tl.constexpr):
    """One token's row into its slot; slot -1 (padding) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    offs = tl.arange(0, BLOCK_D)
    ok = (offs < width) & (slot >= 0)
    row = tl.load(src + t.to(tl.int64) * stride_st + offs * stride_sd, mask=ok)
    dst = cache + tl.maximum(slot, 0).to(tl.int64) * width + offs
    tl.store(dst, row.to(cache.dtype.element_ty), mask=ok)


def write_latents(latent: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """latent [T, L + R] (any strides) into kv_cache [num_blocks, block_size, L + R] (contiguous)
    at slot_mapping [T]; one launch, no host sync."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    width = kv_cache.shape[-1]
    assert kv_cache.is_contiguous() and latent.shape[-1] == width
    _write_latents_kernel[(n,)](latent, kv_cache, slot_mapping, latent.stride(0),
                                latent.stride(1), width,
                                BLOCK_D=triton.next_power_of_2(width))


@triton.jit
def _mla_attention_kernel(
    q_lat, q_pe, cache, out, part_out, part_lse, block_table, query_start_loc, seq_lens,
    qblock_req, qblock_start, token_base, sm_scale, stride_qlt, stride_qlh, stride_qpt,
    stride_qph, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
    NUM_HEADS: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr,
    R_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    head_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    head_block = pid % head_blocks
    split = (pid // head_blocks) % NUM_SPLITS
    qb = pid // (head_blocks * NUM_SPLITS)
    req = tl.load(qblock_req + qb)
    first = tl.load(qblock_start + qb)
    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    seq_len = tl.load(seq_lens + req)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = first + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_len) & (head < NUM_HEADS)
    q_pos = context + tok
    token = (q_start - token_base + tok).to(tl.int64)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    l_ok = offs_l < L
    r_ok = offs_r < R

    ql = tl.load(q_lat + token[:, None] * stride_qlt + head[:, None] * stride_qlh
                 + offs_l[None, :], mask=row_ok[:, None] & l_ok[None, :], other=0.0)
    qp = tl.load(q_pe + token[:, None] * stride_qpt + head[:, None] * stride_qph
                 + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST:
        ql = ql.to(tl.float32)
        qp = qp.to(tl.float32)
    else:  # the dots take one dtype: the cache's
        ql = ql.to(cache.dtype.element_ty)
        qp = qp.to(cache.dtype.element_ty)

    # The last key any row of the block sees: the block's last token, or the sequence end.
    kv_end = tl.minimum(seq_len, context + first + BLOCK_Q)
    kv_start = 0
    if NUM_SPLITS > 1:  # decode (BLOCK_Q 1): this program's share of the keys, whole tiles
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = split * chunk
        kv_end = tl.minimum(kv_end, kv_start + chunk)
    acc, l_i, m_i = _mla_tiles(ql, qp, q_pos, cache, block_table + req.to(tl.int64) * stride_bt,
                               kv_start, kv_end, sm_scale, stride_cb, stride_cs, L, L_PAD, R,
                               R_PAD, BLOCK_SIZE, BLOCK_Q * BLOCK_H, BLOCK_N, LAZY_RESCALE,
                               UPCAST, DOT_PRECISION)
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if NUM_SPLITS > 1:
        # Partial output and its log-sum-exp (base 2; -inf for a split past the sequence end),
        # merged by _merge_splits_kernel.
        row = (token * NUM_HEADS + head) * NUM_SPLITS + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse + row, lse, mask=row_ok)
        tl.store(part_out + row[:, None] * L + offs_l[None, :], acc,
                 mask=row_ok[:, None] & l_ok[None, :])
    else:
        o_ptrs = out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & l_ok[None, :])


@triton.jit
def _merge_splits_kernel(part_out, part_lse, out, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One (token, head): the splits' partial outputs weighted by their share of the softmax
    mass."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < NUM_SPLITS
    offs_l = tl.arange(0, L_PAD)
    row = (token * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse + row + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    parts = tl.load(part_out + (row + offs_s)[:, None] * L + offs_l[None, :],
                    mask=s_ok[:, None] & (offs_l[None, :] < L), other=0.0)
    merged = tl.sum(parts * w[:, None], 0)
    tl.store(out + token * stride_ot + head * stride_oh + offs_l, merged.to(out.dtype.element_ty),
             mask=offs_l < L)


@triton.jit
def _mla_tiles(ql, qp, q_pos, cache, table_row, kv_start, kv_end, sm_scale, stride_cb,
               stride_cs,
               L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               LAZY_RESCALE: tl.constexpr, UPCAST: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """Online softmax over keys [kv_start, kv_end): returns the unnormalised [BLOCK_M, L_PAD]
    accumulator, the row sums and the row maxima (base 2)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    l_ok = offs_l < L
    r_ok = offs_r < R
    qk_scale = sm_scale * 1.4426950408889634  # base 2
    acc = tl.zeros([BLOCK_M, L_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for tile in range(kv_start, kv_end, BLOCK_N):
        k_pos = tile + offs_n
        k_ok = k_pos < kv_end
        # Rows past the end re-read the last key: written, so finite (p = 0 must not meet a
        # NaN of an unwritten row), and the loads need no per-row mask.
        k_read = tl.minimum(k_pos, kv_end - 1)
        if BLOCK_SIZE % BLOCK_N == 0:
            # Tiles start at multiples of BLOCK_N, so a tile lies in one page: one page id
            # and one base offset per tile instead of one per row.
            page = tl.load(table_row + tile // BLOCK_SIZE)
            # -1 entries (graph padding requests) must not address memory before the cache.
            slot = (tl.maximum(page, 0).to(tl.int64) * stride_cb
                    + ((tile % BLOCK_SIZE) + (k_read - tile)) * stride_cs)
        else:
            page = tl.load(table_row + k_read // BLOCK_SIZE)
            slot = (tl.maximum(page, 0).to(tl.int64) * stride_cb
                    + (k_read % BLOCK_SIZE) * stride_cs)
        if L == L_PAD:
            c = tl.load(cache + slot[:, None] + offs_l[None, :])  # [BLOCK_N, L]
        else:
            c = tl.load(cache + slot[:, None] + offs_l[None, :], mask=l_ok[None, :], other=0.0)
        if R == R_PAD:
            pe = tl.load(cache + slot[:, None] + L + offs_r[None, :])  # [BLOCK_N, R]
        else:
            pe = tl.load(cache + slot[:, None] + L + offs_r[None, :], mask=r_ok[None, :],
                         other=0.0)
        if UPCAST:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        s = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(qp, tl.trans(pe), s, input_precision=DOT_PRECISION)
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_tile = tl.max(s, 1)
        if LAZY_RESCALE:
            # One branch for the whole program: rescale only when some row's maximum grew by
            # more than the slack (always on the first tile a row sees: its max was -inf).
            if tl.max((m_tile > m_i + RESCALE_SLACK).to(tl.int32), 0) > 0:
                m_new = tl.maximum(m_i, m_tile)
                alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            # A row that has seen no key yet keeps max -inf; subtract 0 so no NaN appears.
            p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
            l_i = l_i + tl.sum(p, 1)
            acc = tl.dot(p.to(c.dtype), c, acc, input_precision=DOT_PRECISION)
        else:
            m_new = tl.maximum(m_i, m_tile)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_ref[:, None])
            alpha = tl.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new
    return acc, l_i, m_i


def upcast_tiles(kv_cache: torch.Tensor) -> bool:
    """fp32 tiles and ieee dots: a float32 cache, or the interpreter (its bf16 is broken)."""
    return kv_cache.dtype == torch.float32 or kv_cache.device.type == "cpu"


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  out: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, qblock_req: torch.Tensor, qblock_start: torch.Tensor,
                  num_qblocks: int, scale: float, tiles: MLATiles, token_base: int = 0) -> None:
    """q_lat [T, H, L] and q_pe [T, H, R] (last dim contiguous) against the latent cache
    [num_blocks, block_size, L + R]; writes out [T, H, L] (the latent-space output) for every
    token a query block covers. One launch, no host sync.

    token_base: the step's token index of row 0 of q_lat, q_pe and out, so a caller can pass
    only a tail of the step (the decodes after the prefills) with the step's query_start_loc."""
    if num_qblocks == 0:
        return
    num_heads, lora = q_lat.shape[1], q_lat.shape[2]
    rope = q_pe.shape[2]
    assert q_lat.stride(2) == 1 and q_pe.stride(2) == 1 and out.stride(2) == 1
    assert kv_cache.stride(2) == 1 and kv_cache.shape[2] == lora + rope
    upcast = upcast_tiles(kv_cache)
    splits = tiles.num_splits
    if splits > 1 and tiles.block_q != 1:
        raise ValueError("only decode launches (block_q 1) split the keys")
    part_out = part_lse = out  # unused without splits
    if splits > 1:
        # Rows of the step's tokens [token_base, token_base + T); allocated per call (inside a
        # captured graph: from its private pool, so replays keep the pointers).
        num_tokens = q_lat.shape[0]
        part_out = torch.empty(num_tokens * num_heads * splits * lora, dtype=torch.float32,
                               device=q_lat.device)
        part_lse = torch.empty(num_tokens * num_heads * splits, dtype=torch.float32,
                               device=q_lat.device)
    l_pad = max(16, triton.next_power_of_2(lora))
    grid = (num_qblocks * splits * triton.cdiv(num_heads, tiles.block_h),)
    _mla_attention_kernel[grid](
        q_lat, q_pe, kv_cache, out, part_out, part_lse, block_table, query_start_loc, seq_lens,
        qblock_req, qblock_start, token_base, scale, q_lat.stride(0), q_lat.stride(1),
        q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), block_table.stride(0),
        NUM_HEADS=num_heads, L=lora, L_PAD=l_pad, R=rope,
        R_PAD=max(16, triton.next_power_of_2(rope)), BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_Q=tiles.block_q, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
        NUM_SPLITS=splits, LAZY_RESCALE=tiles.lazy_rescale, UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if splits > 1:
        # Decode blocks cover one token each: the step's tokens are rows 0..T-1 here.
        _merge_splits_kernel[(q_lat.shape[0], num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            L=lora, L_PAD=l_pad, NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=4)
