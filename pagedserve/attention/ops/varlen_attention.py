"""Varlen attention over packed, contiguous Q/K/V (no cache): the encoder-only layers' kernel
for the TRITON backend (attention/encoder.py).

One program per (query block of a request, query head): it walks its request's keys in tiles
of BLOCK_N with an online softmax in float32 (non-causal; `CAUSAL` masks keys after the
query for a causal variant, `WINDOW` keys further than WINDOW - 1 positions either side).
Requests are found through cu_seqlens; a program whose query block lies past its request's
end exits at once, so the grid is [cdiv(max_seqlen, BLOCK_M), B, H]. The
head size is padded to a power of two and masked. GQA reads K/V head h // (H / Hkv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _varlen_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, scale,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_ot, stride_oh,
                             GROUP: tl.constexpr, HEAD: tl.constexpr, HEAD_V: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    block = tl.program_id(0)
    req = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_ptr + req)
    length = tl.load(cu_ptr + req + 1) - start
    if block * BLOCK_M < length:
        kv_head = head // GROUP
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        row_ok = rows < length
        q = tl.load(q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < HEAD), other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        end = length
        if CAUSAL:
            end = tl.minimum(length, (block + 1) * BLOCK_M)
        for n0 in range(0, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < length
            k = tl.load(k_ptr + (start + cols)[:, None] * stride_kt + kv_head * stride_kh
                        + d[None, :], mask=col_ok[:, None] & (d[None, :] < HEAD),
                        other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * scale
            keep = col_ok[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            if WINDOW > 0:  # two-sided: |query - key| < WINDOW
                dist = cols[None, :] - rows[:, None]
                keep = keep & (dist < WINDOW) & (dist > -WINDOW)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + (start + cols)[:, None] * stride_vt + kv_head * stride_vh
                        + dv[None, :], mask=col_ok[:, None] & (dv[None, :] < HEAD_V),
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dv[None, :],
                 out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < HEAD_V))


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     output: torch.Tensor, cu_seqlens: torch.Tensor, num_reqs: int,
                     max_seqlen: int, scale: float, causal: bool = False,
                     window: int | None = None) -> torch.Tensor:
    """query [T, H, D], key [T, Hkv, D], value [T, Hkv, Dv] packed by cu_seqlens [B+1] ->
    output [T, H, Dv] (rows past cu_seqlens[B] untouched). One launch, no host sync.
    `window`: keys within window - 1 positions of the query, on both sides."""
    if num_reqs == 0 or max_seqlen == 0:
        return output
    h, d = query.shape[1], query.shape[2]
    hkv, dv = key.shape[1], value.shape[2]
    block_m = 32 if max_seqlen > 16 else 16
    grid = (triton.cdiv(max_seqlen, block_m), num_reqs, h)
    _varlen_attention_kernel[grid](
        query, key, value, output, cu_seqlens, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), output.stride(0), output.stride(1),
        GROUP=h // hkv, HEAD=d, HEAD_V=dv, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_M=block_m, BLOCK_N=32,
        CAUSAL=causal, WINDOW=window or 0)
    return output
