"""The rejection sampler's acceptance walk, output assembly and residual sampling as one Triton
kernel (CUDA; CPU tensors under TRITON_INTERPRET=1). The target's processing (penalties, bias,
grammar masks, temperature, top-k / top-p / min-p, softmax) and every random draw stay in
torch (rejection_sampler.py): the kernel reads the same argmax, probabilities, uniforms and
Exp(1) noise as the torch path and writes the same tokens, so a seeded request's stream and
its samples do not depend on which path ran.

Kernel `_rejection_kernel`
  grid:    (B,); program b walks request b's K_b drafts at once (a vector of KBLOCK >= Kmax
           lanes): draft j passes when argmax[row_start + j] == d_j (greedy rows) or
           p[row_start + j, d_j] >= u[b, j] * q_j (random rows; q_j = 1 without draft
           probabilities); `accepted` = the passes before the first failure. It writes
           tokens[b, :accepted] = drafts, tokens[b, accepted] = the final token, -1 after.
           Greedy: the final token is argmax[row_start + accepted]. Random: a race over the
           vocabulary at row `last` = row_start + accepted, argmax(r / E) with E = noise[b]
           (Exp(1), clamped >= tiny), r = max(p - q, 0) with q the draft's distribution at the
           first rejected position (one-hot at the draft without draft probabilities), r = p
           after the last draft (the bonus token) or where p - q has no mass left.
  why one: the residual is needed only at the first rejected position, which the walk has
           just found; vLLM's split (walk kernels after a recovered-token kernel) races at
           every draft position in advance, K times the vocabulary reads.
  layout:  argmax [N] int64; probs [N, V] float32 contiguous; drafts [B, Kmax] int64
           contiguous; uniforms [B, Kmax] float32 contiguous; noise [B, V] float32 with unit
           column stride; draft_probs [B, Kmax, V] float32 with unit vocabulary stride;
           is_greedy [B] bool; the output [B, Kmax + 1] int64. The race reads the vocabulary
           in blocks of BLOCK_V (fewer for a smaller vocabulary).
  exact:   the same comparisons and correctly rounded divisions as torch (`div_rn`), and the
           lowest index among equal scores as torch's argmax: equal tokens for equal draws.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _race(probs_ptr, noise_ptr, q_ptr, draft, vocab_size, SUBTRACT: tl.constexpr,
          ONE_HOT: tl.constexpr, BLOCK: tl.constexpr):
    """(argmax over the vocabulary of r / noise, max of r); r = max(p - q, 0) if SUBTRACT
    (q one-hot at `draft` if ONE_HOT, else read at q_ptr), else r = p."""
    best = -1.0
    best_idx = 0
    mass = 0.0
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab_size
        r = tl.load(probs_ptr + offs, mask=inside, other=0.0)
        if SUBTRACT:
            if ONE_HOT:
                q = tl.where(offs == draft, 1.0, 0.0)
            else:
                q = tl.load(q_ptr + offs, mask=inside, other=0.0)
            r = tl.maximum(r - q, 0.0)
        noise = tl.load(noise_ptr + offs, mask=inside, other=1.0)
        score = tl.where(inside, tl.math.div_rn(r, noise), -1.0)  # scores are >= 0
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0, tie_break_left=True)
        # Strictly greater: an earlier block keeps a tie, as torch's argmax keeps the first.
        better = block_best > best
        best_idx = tl.where(better, start + block_idx, best_idx)
        best = tl.where(better, block_best, best)
        mass = tl.maximum(mass, tl.max(r, axis=0))
    return best_idx, mass


@triton.jit
def _random_final(row_probs, row_noise, q_row, draft, rejected, vocab_size,
                  HAS_DRAFT_PROBS: tl.constexpr, BLOCK: tl.constexpr):
    """A random request's final token: a sample of max(p - q, 0) at its first rejected
    position (of p where that has no mass left), of p after its last draft."""
    if rejected:
        final, mass = _race(row_probs, row_noise, q_row, draft, vocab_size, True,
                            not HAS_DRAFT_PROBS, BLOCK)
        if mass <= 0.0:  # p was q's up to rounding: nothing left to subtract from
            final, mass = _race(row_probs, row_noise, q_row, draft, vocab_size, False, False,
                                BLOCK)
    else:  # every draft kept: the bonus token
        final, mass = _race(row_probs, row_noise, q_row, draft, vocab_size, False, False,
                            BLOCK)
    return final.to(tl.int64)


@triton.jit
def _rejection_kernel(tokens_ptr, num_drafts_ptr, row_start_ptr, drafts_ptr, argmax_ptr,
                      is_greedy_ptr, probs_ptr, draft_probs_ptr, uniforms_ptr, noise_ptr,
                      vocab_size, kmax, dp_stride_b, dp_stride_k, noise_stride,
                      ALL_GREEDY: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
                      KBLOCK: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    k = tl.load(num_drafts_ptr + b)
    row_start = tl.load(row_start_ptr + b)
    j = tl.arange(0, KBLOCK)
    valid = j < k
    drafts = tl.load(drafts_ptr + b * kmax + j, mask=valid, other=0)
    # Greedy's rule first; a random row replaces it. (ALL_GREEDY leaves the random code, and
    # its float pointers, out of the compiled kernel.)
    passed = tl.load(argmax_ptr + row_start + j, mask=valid, other=-1) == drafts
    if not ALL_GREEDY:
        greedy = tl.load(is_greedy_ptr + b) != 0
        if not greedy:
            p = tl.load(probs_ptr + (row_start + j) * vocab_size + drafts, mask=valid,
                        other=0.0)
            u = tl.load(uniforms_ptr + b * kmax + j, mask=valid, other=1.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + b * dp_stride_b + j * dp_stride_k + drafts,
                            mask=valid, other=1.0)
                passed = p >= u * q
            else:
                passed = p >= u
    # The first lane that fails (or k): the drafts kept.
    accepted = tl.min(tl.where(passed & valid, KBLOCK, j), axis=0).to(tl.int64)
    accepted = tl.minimum(accepted, k)
    last = row_start + accepted
    final = tl.load(argmax_ptr + last).to(tl.int64)
    if not ALL_GREEDY:
        if not greedy:
            final = _random_final(probs_ptr + last * vocab_size, noise_ptr + b * noise_stride,
                                  draft_probs_ptr + b * dp_stride_b
                                  + tl.minimum(accepted, kmax - 1) * dp_stride_k,
                                  tl.sum(tl.where(j == accepted, drafts, 0), axis=0),
                                  accepted < k, vocab_size, HAS_DRAFT_PROBS, BLOCK)
    w = kmax + 1
    jw = tl.arange(0, 2 * KBLOCK)
    kept = tl.load(drafts_ptr + b * kmax + jw, mask=jw < accepted, other=0)
    out = tl.where(jw < accepted, kept, tl.where(jw == accepted, final, -1))
    tl.store(tokens_ptr + b * w + jw, out, mask=jw < w)


def rejection_tokens_triton(argmax: torch.Tensor, probs: torch.Tensor | None,
                            num_drafts: torch.Tensor, row_start: torch.Tensor,
                            drafts: torch.Tensor, is_greedy: torch.Tensor,
                            draft_probs: torch.Tensor | None, uniforms: torch.Tensor | None,
                            noise: torch.Tensor | None) -> torch.Tensor:
    """[B, Kmax + 1] int64: each request's kept drafts, then its replacement or bonus token,
    then -1. `probs`, `uniforms` and `noise` are None only when every request is greedy."""
    b, kmax = drafts.shape
    device = argmax.device
    all_greedy = probs is None
    # The kernel trusts these shapes and layouts: a wrong one reads past a buffer.
    assert argmax.dtype == drafts.dtype == num_drafts.dtype == row_start.dtype == torch.int64
    assert drafts.is_contiguous() and num_drafts.shape == row_start.shape == (b,)
    tokens = torch.empty((b, kmax + 1), dtype=torch.int64, device=device)
    if not b:
        return tokens
    if all_greedy:
        probs = noise = uniforms = argmax  # never read
        vocab_size, noise_stride, draft_probs = 0, 0, None
    else:
        assert probs.dtype == torch.float32 and probs.is_contiguous()
        assert probs.shape[0] == argmax.shape[0]
        assert is_greedy.dtype == torch.bool and is_greedy.shape == (b,)
        assert is_greedy.is_contiguous()
        vocab_size = probs.shape[1]
        assert noise.dtype == torch.float32 and noise.shape == (b, vocab_size)
        assert noise.stride(1) == 1
        noise_stride = noise.stride(0)
        if uniforms is None:  # no drafts anywhere: nothing to compare
            assert kmax == 0
            uniforms = noise
        else:
            assert uniforms.dtype == torch.float32 and uniforms.is_contiguous()
            assert uniforms.shape == (b, kmax)
    if draft_probs is not None:
        assert draft_probs.dtype == torch.float32 and draft_probs.stride(2) == 1
        assert draft_probs.shape == (b, kmax, vocab_size)
        dp, dp_stride_b, dp_stride_k = draft_probs, draft_probs.stride(0), draft_probs.stride(1)
    else:
        dp, dp_stride_b, dp_stride_k = argmax, 0, 0  # never read
    _rejection_kernel[(b,)](
        tokens, num_drafts, row_start, drafts, argmax, is_greedy, probs, dp, uniforms, noise,
        vocab_size, kmax, dp_stride_b, dp_stride_k, noise_stride, ALL_GREEDY=all_greedy,
        HAS_DRAFT_PROBS=draft_probs is not None,
        KBLOCK=triton.next_power_of_2(max(kmax, 1)),
        BLOCK=min(BLOCK_V, triton.next_power_of_2(max(vocab_size, 1))),
        num_warps=1 if all_greedy else 8)
    return tokens
