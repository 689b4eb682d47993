"""Rejection sampling (Leviathan et al., 2023): the tokens a verify step keeps are distributed
exactly as the target's own samples would be.

- Greedy rows: a draft is kept while it equals the target's argmax at its position; the first
  mismatch is replaced by the argmax there, and a request whose drafts all pass gets the
  argmax after the last one (the bonus token).
- Random rows: draft d at a position with target probabilities p and draft probabilities q is
  kept when p(d) / q(d) >= u, u ~ U(0, 1]; the first rejected one is replaced by a sample of
  max(p - q, 0) (renormalised), and the bonus token is a sample of p. Drafts without
  probabilities (n-gram) count as one-hot: kept with probability p(d), replaced by a sample of
  p with d removed.

p is the target's distribution after the request's own processing at that position (logit
bias, grammar mask, min_tokens, penalties over the outputs so far including the drafts before
it, temperature, top-k / top-p / min-p): one expanded SamplingMetadata over every logits row.
A seeded request draws its uniforms and noise from its own generator only, so its tokens
depend on its seed and its own drafts, never on the batch. Vectorised torch over the batch;
the only Python loop is over seeded requests, as in the sampler.

On CUDA the acceptance walk, the output assembly and the residual / bonus sample run as one
Triton kernel (rejection_kernels.py) after the same processing and the same random draws
(`_draws`), so both paths give the same tokens. PAGEDSERVE_REJECTION_SAMPLER=torch keeps the
torch path there, =triton runs the kernel anywhere (Triton's interpreter on the CPU). The
synthetic acceptance mode (timing only) always runs in torch.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from pagedserve import envs
from pagedserve.device import to_device_async
from pagedserve.engine.sampler import (
    SamplerOutput,
    SamplingMetadata,
    _gather_logprobs,
    apply_penalties,
    apply_top_k_top_p_min_p,
    exponential_noise,
)
from pagedserve.spec_decode.verify import VerifyLayout


class RejectionSampler:
    def __init__(self, synthetic_acceptance_rate: float | None = None,
                 use_kernel: bool | None = None) -> None:
        # Testing only: drafts kept at this rate per position whatever the target says.
        self.synthetic_rate = synthetic_acceptance_rate
        # None: as PAGEDSERVE_REJECTION_SAMPLER says (auto: the Triton kernel on CUDA, torch
        # elsewhere). True forces the kernel (CPU tensors need TRITON_INTERPRET=1), False
        # forces torch.
        self.use_kernel = use_kernel
        if use_kernel is None:
            _path_asked()  # a bad value refused at start-up, not at the first verify step

    def __call__(self, logits: Tensor, meta: SamplingMetadata, layout: VerifyLayout,
                 draft_probs: Tensor | None = None) -> SamplerOutput:
        """`logits` [N, V]: the layout's rows. Returns [B, Kmax+1] token ids, -1 past each
        request's kept tokens, and (when asked) logprobs of the target's raw distribution
        for rows b * (Kmax + 1) + j."""
        logits = logits.to(torch.float32)
        if draft_probs is not None:  # (both paths compare in float32)
            draft_probs = draft_probs.to(torch.float32)
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if meta.max_num_logprobs is not None else None)
        argmax, probs = self._target(logits, meta, layout)
        uniforms, noise = self._draws(probs, meta, layout)
        if self._kernel(logits.device):
            from pagedserve.spec_decode.rejection_kernels import rejection_tokens_triton

            tokens = rejection_tokens_triton(
                argmax, probs, layout.num_drafts_dev,
                layout.row_start_dev, layout.drafts_dev, meta.is_greedy, draft_probs,
                uniforms, noise)
        else:
            accepted = self._accepted(argmax, probs, meta, layout, draft_probs, uniforms)
            tokens = self._tokens(accepted, argmax, probs, meta, layout, draft_probs, noise)
        if raw_logprobs is None:
            return SamplerOutput(tokens)
        width = layout.width
        j = torch.arange(width, device=logits.device)
        at = (layout.row_start_dev[:, None] + torch.minimum(
            j[None, :], layout.num_drafts_dev[:, None]))
        lp = _gather_logprobs(raw_logprobs[at.reshape(-1)], tokens.reshape(-1).clamp_min(0),
                              meta.max_num_logprobs or 0)
        return SamplerOutput(tokens, lp.logprobs, lp.token_ids, lp.ranks)

    def _target(self, logits: Tensor, meta: SamplingMetadata, layout: VerifyLayout
                ) -> tuple[Tensor, Tensor | None]:
        """Every row's processed argmax [N] and, unless all requests are greedy, its sampling
        distribution [N, V] (penalties, temperature, top-k / top-p / min-p): what both paths
        walk."""
        rows = expand_metadata(meta, layout)
        processed = apply_penalties(logits, rows)
        argmax = processed.argmax(dim=-1)
        if meta.all_greedy:
            return argmax, None
        scaled = processed / rows.temperature.unsqueeze(1)
        return argmax, apply_top_k_top_p_min_p(scaled, rows).softmax(dim=-1)

    def _kernel(self, device: torch.device) -> bool:
        """Whether this call runs the Triton kernel (never for synthetic acceptance)."""
        if self.synthetic_rate is not None:
            return False
        if self.use_kernel is not None:
            return self.use_kernel
        choice = _path_asked()
        if choice == "triton":
            return True
        if device.type != "cuda" or choice == "torch":
            return False
        try:
            import triton  # noqa: F401
        except ImportError:  # a CUDA install without triton: the torch path, same tokens
            return False
        return True

    def _draws(self, probs: Tensor | None, meta: SamplingMetadata, layout: VerifyLayout
               ) -> tuple[Tensor | None, Tensor | None]:
        """The step's random draws, the same for both paths: uniforms [B, Kmax] (synthetic
        acceptance's own draws when set), then Exp(1) noise [B, V] for the replacement or
        bonus sample; None where not needed (greedy batches, no drafts)."""
        b, kmax = layout.drafts.shape
        device = layout.drafts_dev.device
        uniforms = None
        if kmax and self.synthetic_rate is not None:
            uniforms = torch.rand(b, kmax, device=device)
        elif kmax and probs is not None:
            uniforms = _uniforms(layout, meta.generators, device)
        noise = (None if probs is None else
                 exponential_noise((b, probs.shape[1]), meta.generators, device))
        return uniforms, noise

    def _accepted(self, argmax: Tensor, probs: Tensor | None, meta: SamplingMetadata,
                  layout: VerifyLayout, draft_probs: Tensor | None,
                  u: Tensor | None) -> Tensor:
        """[B] drafts kept per request (leading positions that pass)."""
        b, kmax = layout.drafts.shape
        device = argmax.device
        if not kmax:
            return torch.zeros(b, dtype=torch.int64, device=device)
        drafts = layout.drafts_dev
        j = torch.arange(kmax, device=device)
        valid = j[None, :] < layout.num_drafts_dev[:, None]
        at = (layout.row_start_dev[:, None] + j[None, :]).clamp_max(argmax.shape[0] - 1)
        if self.synthetic_rate is not None:
            passed = u < self.synthetic_rate
        else:
            passed = argmax[at] == drafts
            if probs is not None:
                p = probs[at, drafts]
                q = (torch.ones_like(p) if draft_probs is None
                     else draft_probs.gather(2, drafts[..., None])[..., 0])
                passed = torch.where(meta.is_greedy[:, None], passed, p >= u * q)
        passed &= valid
        return passed.long().cumprod(dim=1).sum(dim=1)

    def _tokens(self, accepted: Tensor, argmax: Tensor, probs: Tensor | None,
                meta: SamplingMetadata, layout: VerifyLayout, draft_probs: Tensor | None,
                noise: Tensor | None) -> Tensor:
        """[B, Kmax+1]: the kept drafts, then the replacement or bonus token, then -1."""
        b, kmax = layout.drafts.shape
        device = argmax.device
        last = layout.row_start_dev + accepted  # the row of each request's final token
        final = argmax[last]
        if probs is not None:
            residual = probs[last]
            rejected = accepted < layout.num_drafts_dev
            if self.synthetic_rate is None and layout.drafts.shape[1]:  # (no sync on .any())
                residual = _remove_draft(residual, rejected, accepted, layout, draft_probs)
            sampled = residual.div_(noise).argmax(dim=-1)  # argmax(r / E): a sample of r
            final = torch.where(meta.is_greedy, final, sampled)
        j = torch.arange(kmax + 1, device=device)
        padded = torch.cat([layout.drafts_dev, torch.zeros(b, 1, dtype=torch.int64,
                                                           device=device)], dim=1)
        tokens = torch.where(j[None, :] < accepted[:, None], padded, -1)
        return tokens.scatter(1, accepted[:, None], final[:, None])


def _path_asked() -> str:
    choice = envs.PAGEDSERVE_REJECTION_SAMPLER
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"PAGEDSERVE_REJECTION_SAMPLER={choice!r}: use auto, torch or triton")
    return choice


def _remove_draft(residual: Tensor, rejected: Tensor, accepted: Tensor, layout: VerifyLayout,
                  draft_probs: Tensor | None) -> Tensor:
    """max(p - q, 0) at each request's first rejected position (its rows where `rejected`);
    a residual with no mass left (p was q's, up to rounding) falls back to p."""
    col = accepted.clamp_max(max(layout.drafts.shape[1] - 1, 0))[:, None]
    draft = layout.drafts_dev.gather(1, col)[:, 0]
    if draft_probs is None:
        q = torch.zeros_like(residual)
        q.scatter_(1, draft[:, None], 1.0)
    else:
        q = draft_probs[torch.arange(len(draft), device=draft.device), col[:, 0]]
    out = (residual - q).clamp_min_(0)
    empty = out.sum(dim=-1) <= 0
    out = torch.where((rejected & ~empty)[:, None], out, residual)
    return out


def _uniforms(layout: VerifyLayout, generators: dict[int, torch.Generator],
              device: torch.device) -> Tensor:
    """U(0, 1] draws [B, Kmax]; a seeded request's K_b from its own generator (as many as its
    own drafts: its stream never depends on the batch)."""
    b, k = layout.drafts.shape
    u = torch.rand(b, k, device=device) if len(generators) < b else torch.zeros(
        b, k, device=device)
    for row, gen in generators.items():
        n = int(layout.num_drafts[row])
        u[row] = 0.0
        if n:
            u[row, :n] = torch.rand(n, generator=gen, device=device)
    return 1.0 - u  # (0, 1]: a token of probability 0 is never kept


def expand_metadata(meta: SamplingMetadata, layout: VerifyLayout) -> SamplingMetadata:
    """The request rows' sampling settings over every logits row, with each row's penalties
    counting the drafts before it and min_tokens banning by each row's position."""
    req = layout.req_of_row
    take = (lambda t: None if t is None else t.index_select(0, req))  # noqa: E731
    counts = take(meta.output_token_counts)
    if counts is not None and layout.drafts.shape[1]:
        counts = counts.clone()
        rows, ids = _draft_history(layout)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=counts.dtype),
                          accumulate=True)
    banned = take(meta.banned_token_mask)
    if banned is not None and layout.min_tokens_left is not None:
        within = torch.arange(layout.num_rows, device=req.device) - layout.row_start_dev[req]
        left = torch.from_numpy(layout.min_tokens_left).to(req.device)[req]
        banned = banned & (within < left)[:, None]
    bias = meta.logit_bias
    if bias is not None:
        bias = _expand_bias(bias, layout)
    # A verify step's grammar bitmask (meta.token_bitmask) is filled per logits row already:
    # a guided request's rows hold the masks after 0..K of its drafts (engine/guided.py).
    return dataclasses.replace(
        meta, temperature=take(meta.temperature), is_greedy=take(meta.is_greedy),
        top_k=take(meta.top_k), top_p=take(meta.top_p), min_p=take(meta.min_p),
        presence_penalties=take(meta.presence_penalties),
        frequency_penalties=take(meta.frequency_penalties),
        repetition_penalties=take(meta.repetition_penalties), output_token_counts=counts,
        prompt_token_mask=take(meta.prompt_token_mask), banned_token_mask=banned,
        allowed_token_mask=take(meta.allowed_token_mask), generators={}, logit_bias=bias)


def _draft_history(layout: VerifyLayout) -> tuple[Tensor, Tensor]:
    """(logits row, token) for every draft m of a request and every later row j >= m of it
    (row j has seen drafts 1..j)."""
    b, kmax = layout.drafts.shape
    j = torch.arange(kmax + 1)[None, :, None]
    m = torch.arange(1, kmax + 1)[None, None, :]
    k = torch.from_numpy(layout.num_drafts)[:, None, None]
    keep = (m <= j) & (j <= k)
    rows = (torch.from_numpy(layout.row_start)[:, None, None] + j).expand(b, -1, kmax)[keep]
    ids = torch.from_numpy(layout.drafts)[:, None, :].expand(b, kmax + 1, -1)[keep]
    device = layout.req_of_row.device
    return to_device_async(rows, device), to_device_async(ids, device)


def _expand_bias(bias: tuple[Tensor, Tensor, Tensor], layout: VerifyLayout
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Each logit-bias entry of request r onto every row of r."""
    rows, ids, values = bias
    per = torch.from_numpy(layout.num_drafts + 1).to(rows.device)[rows]
    offsets = torch.arange(int(per.sum()), device=rows.device) - torch.repeat_interleave(
        per.cumsum(0) - per, per)
    starts = layout.row_start_dev[rows]
    return (torch.repeat_interleave(starts, per) + offsets, torch.repeat_interleave(ids, per),
            torch.repeat_interleave(values, per))
