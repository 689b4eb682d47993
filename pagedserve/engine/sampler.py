"""Batched token sampler: one vectorised pass over the whole batch.

Per-request parameters live in [B] tensors so mixed batches (greedy, top-k, seeded, ...)
run as a handful of tensor ops. The only per-row Python loop is over rows that own a seeded
``torch.Generator``, since each such row must draw its noise from its own RNG stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pagedserve.device import to_device_async
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.manager import masked_logits

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-batch sampling state. Build it with :meth:`build`."""

    temperature: Tensor  # [B] float32; 1.0 on greedy rows so dividing by it is always safe
    is_greedy: Tensor  # [B] bool
    top_k: Tensor  # [B] int64; vocab size where disabled
    top_p: Tensor  # [B] float32; 1.0 where disabled
    min_p: Tensor  # [B] float32; 0.0 where disabled
    presence_penalties: Tensor  # [B] float32
    frequency_penalties: Tensor  # [B] float32
    repetition_penalties: Tensor  # [B] float32
    output_token_counts: Tensor | None  # [B, V] int32; None when no_penalties
    prompt_token_mask: Tensor | None  # [B, V] bool; None unless a row has a repetition penalty
    # [B, V] bool: EOS/stop ids of rows below min_tokens, and the ends of bad words
    banned_token_mask: Tensor | None
    generators: dict[int, torch.Generator]  # row -> generator, for seeded requests
    max_num_logprobs: int | None  # max over rows of params.logprobs; None if no row asks
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_freq_presence: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    # (rows, token ids, biases) of every row's logit_bias entries; None unless a row has one.
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None
    # [B, V] bool: the tokens a row may sample (allowed_token_ids; every token for the other
    # rows); None unless a row lists them.
    allowed_token_mask: Tensor | None = None
    # Guided decoding: [B, ceil(V / 32)] int32 allowed-token bits, applied to `bitmask_rows`
    # only (None: every row); the runner sets both for the sampling of a step with a mask.
    token_bitmask: Tensor | None = None
    bitmask_rows: list[int] | None = None

    @property
    def no_top_k_top_p_min_p(self) -> bool:
        return self.no_top_k and self.no_top_p and self.no_min_p

    @property
    def argmax_only(self) -> bool:
        """Every row's token is the argmax of its raw logits, and nothing else is asked of
        them (no penalty, bias, ban, mask or logprobs): what a decode graph's head computes."""
        return (self.all_greedy and self.no_penalties and self.logit_bias is None
                and self.allowed_token_mask is None and self.banned_token_mask is None
                and self.token_bitmask is None
                and self.max_num_logprobs is None)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device | str,
        distinct: tuple[list[SamplingParams], list[int] | None] | None = None,
    ) -> SamplingMetadata:
        """Gather a batch's parameters into tensors.

        ``generators`` must persist across steps for a request (created once from its seed);
        a fresh generator per step would replay the same noise every step. ``distinct``:
        `distinct_params(params)` when the caller has it already.
        """
        n = len(params)
        if not (len(prompt_token_ids) == n == len(output_token_ids)):
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        v = vocab_size
        # Rows are built per distinct parameter object, then gathered: an offline batch
        # shares one object, so the per-step host work does not grow with the batch.
        uniq, which = distinct if distinct is not None else distinct_params(params)
        greedy = [p.greedy for p in uniq]
        # Greedy rows get neutral filter values so they never trigger the filtering work.
        temperature = [1.0 if p.greedy else p.temperature for p in uniq]
        top_k = [v if p.greedy or p.top_k <= 0 else min(p.top_k, v) for p in uniq]
        top_p = [1.0 if p.greedy else p.top_p for p in uniq]
        min_p = [0.0 if p.greedy else p.min_p for p in uniq]
        rep = [p.repetition_penalty for p in uniq]
        pres = [p.presence_penalty for p in uniq]
        freq = [p.frequency_penalty for p in uniq]

        no_rep = all(r == 1.0 for r in rep)
        no_freq_presence = not any(pres) and not any(freq)
        no_penalties = no_rep and no_freq_presence
        counts = None if no_penalties else _token_counts(output_token_ids, v, device)
        prompt_mask = None if no_rep else _token_counts(prompt_token_ids, v, device) > 0

        ban_rows: list[int] = []
        ban_cols: list[int] = []
        if any(p.min_tokens or p.bad_words_token_ids for p in uniq):
            for row, (p, out) in enumerate(zip(params, output_token_ids, strict=True)):
                ids = p.end_token_ids(eos_token_id) if len(out) < p.min_tokens else set()
                ids = [*ids, *_bad_word_ends(p.bad_words_token_ids, out)]
                ban_rows.extend([row] * len(ids))
                ban_cols.extend(ids)
        banned = None
        if ban_rows:
            banned = torch.zeros(n, v, dtype=torch.bool, device=device)
            banned[_long(ban_rows, device), _long(ban_cols, device)] = True

        bias = None
        if any(p.logit_bias for p in uniq):
            bias_rows, bias_cols = _row_pairs(params, lambda p: p.logit_bias)
            values = [x for p in params if p.logit_bias for x in p.logit_bias.values()]
            bias = (_long(bias_rows, device), _long(bias_cols, device),
                    to_device_async(torch.tensor(values, dtype=torch.float32), device))

        allowed = None
        if any(p.allowed_token_ids for p in uniq):
            # Made on the device from (row, id) pairs, as the ban is: a host [B, V] mask
            # would be copied every step.
            allow_rows, allow_cols = _row_pairs(params, lambda p: p.allowed_token_ids)
            free_rows = [row for row, p in enumerate(params) if not p.allowed_token_ids]
            allowed = torch.zeros(n, v, dtype=torch.bool, device=device)
            allowed[_long(free_rows, device)] = True
            allowed[_long(allow_rows, device), _long(allow_cols, device)] = True

        asked = [p.logprobs for p in uniq if p.logprobs is not None]
        # One transfer for the per-row values (top_k and vocab ids are exact in float32).
        table = torch.tensor([temperature, top_p, min_p, pres, freq, rep, top_k, greedy],
                             dtype=torch.float32)
        if which is None:
            table = table.expand(-1, n).contiguous()
        elif len(uniq) < n:  # with all distinct, `which` is 0..n-1 already
            table = table[:, torch.tensor(which, dtype=torch.int64)]
        rows = to_device_async(table, device)
        return cls(
            temperature=rows[0],
            is_greedy=rows[7] != 0,
            top_k=rows[6].long(),
            top_p=rows[1],
            min_p=rows[2],
            presence_penalties=rows[3],
            frequency_penalties=rows[4],
            repetition_penalties=rows[5],
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            banned_token_mask=banned,
            generators=generators,
            max_num_logprobs=max(asked) if asked else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=no_penalties,
            no_freq_presence=no_freq_presence,
            no_top_k=all(k >= v for k in top_k),
            no_top_p=all(p >= 1.0 for p in top_p),
            no_min_p=not any(min_p),
            logit_bias=bias,
            allowed_token_mask=allowed,
        )


def distinct_params(params: list[SamplingParams]
                    ) -> tuple[list[SamplingParams], list[int] | None]:
    """The batch's distinct SamplingParams objects (by identity, in first-seen order) and each
    row's index among them; None for the indices when one object serves every row."""
    first = params[0] if params else None
    if all(p is first for p in params):
        return params[:1], None
    slot: dict[int, int] = {}
    uniq: list[SamplingParams] = []
    which = []
    for p in params:
        i = slot.setdefault(id(p), len(uniq))
        if i == len(uniq):
            uniq.append(p)
        which.append(i)
    return uniq, which


def _bad_word_ends(words: list[list[int]] | None, output: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    return [w[-1] for w in words or () if len(w) - 1 <= len(output)
            and (len(w) == 1 or output[len(output) - len(w) + 1:] == w[:-1])]


def _row_pairs(params: Sequence[SamplingParams], ids_of: Callable[[SamplingParams], Any]
               ) -> tuple[list[int], list[int]]:
    """(rows, ids): row r once for every token id `ids_of(params[r])` names (a dict's keys)."""
    rows: list[int] = []
    ids: list[int] = []
    for row, p in enumerate(params):
        named = ids_of(p)
        if named:
            rows.extend([row] * len(named))
            ids.extend(named)
    return rows, ids


def _long(xs: list[int], device: torch.device | str) -> Tensor:
    return to_device_async(torch.tensor(xs, dtype=torch.int64), device)


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> Tensor:
    """[B, V] int32 occurrence counts, from one scatter over the flattened ids."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.int32, device=device)
    lengths = _long([len(ids) for ids in token_ids], device)
    flat = _long(list(chain.from_iterable(token_ids)), device)
    if flat.numel():
        rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
        ones = torch.ones_like(flat, dtype=torch.int32)
        counts.index_put_((rows, flat), ones, accumulate=True)
    return counts


class LogprobsTensors(NamedTuple):
    logprobs: Tensor  # [N, K+1] float32; column 0 is the chosen token, then the top-K
    token_ids: Tensor  # [N, K+1] int64
    ranks: Tensor  # [N] int64; 1-based rank of the chosen token (ties share the best rank)


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [B] int64
    logprobs: Tensor | None = None  # [B, K+1] float32
    logprob_token_ids: Tensor | None = None  # [B, K+1] int64
    sampled_token_ranks: Tensor | None = None  # [B] int64


def apply_penalties(logits: Tensor, meta: SamplingMetadata, temperature: Tensor | None = None
                    ) -> Tensor:
    """Logit bias, allowed_token_ids, the grammar's bitmask, the min_tokens ban, then
    repetition, then frequency/presence penalties. Out of place. `temperature`: divide by it
    with the mask (`mask_takes_temperature`)."""
    if meta.logit_bias is not None:
        logits = logits.clone()  # in place below: not on the caller's tensor
        rows, token_ids, biases = meta.logit_bias
        logits.index_put_((rows, token_ids), biases, accumulate=True)
    if meta.allowed_token_mask is not None:
        logits = logits.masked_fill(~meta.allowed_token_mask, _NEG_INF)
    if meta.token_bitmask is not None:
        # A copy: on CUDA the mask of every row may be host memory only our kernel reads.
        logits = masked_logits(logits, meta.token_bitmask, meta.bitmask_rows, temperature)
    if meta.banned_token_mask is not None:
        logits = logits.masked_fill(meta.banned_token_mask, _NEG_INF)
    if meta.no_penalties:
        return logits
    counts = meta.output_token_counts
    assert counts is not None
    if meta.prompt_token_mask is not None:
        # Transformers' rule, over prompt and output tokens: shrink positive logits, grow
        # negative ones, so a penalty > 1 always makes a seen token less likely.
        seen = meta.prompt_token_mask | (counts > 0)
        penalty = meta.repetition_penalties.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if not meta.no_freq_presence:
        # OpenAI's rule, over output tokens only.
        logits = (
            logits
            - meta.frequency_penalties.unsqueeze(1) * counts
            - meta.presence_penalties.unsqueeze(1) * (counts > 0)
        )
    return logits


def mask_takes_temperature(logits: Tensor, meta: SamplingMetadata) -> bool:
    """Whether the mask's kernel divides by the temperature too: a mask of every row on a
    GPU with nothing between it and the division (no ban, no penalty) in a batch that samples.
    One launch fewer a guided step, whose host time is the step's at batch 64 on the H200."""
    return (logits.is_cuda and meta.token_bitmask is not None and meta.bitmask_rows is None
            and meta.banned_token_mask is None and meta.no_penalties and not meta.all_greedy)


def apply_top_k_top_p_min_p(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Mask filtered-out tokens to -inf. Modifies ``logits`` in place and returns it."""
    if not (meta.no_top_k and meta.no_top_p):
        # One ascending sort serves both top-k (threshold at column V-k) and top-p (cumsum).
        sorted_logits, order = logits.sort(dim=-1)
        if not meta.no_top_k:
            kth = sorted_logits.gather(1, (logits.shape[-1] - meta.top_k).unsqueeze(1))
            # `<` keeps ties with the k-th value, as transformers' TopKLogitsWarper does.
            sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
        if not meta.no_top_p:
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = cum <= (1 - meta.top_p).unsqueeze(1)
            remove[:, -1] = False  # the most likely token always survives
            sorted_logits.masked_fill_(remove, _NEG_INF)
        logits.scatter_(1, order, sorted_logits)
    if not meta.no_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
        logits.masked_fill_(probs < threshold, _NEG_INF)
    return logits


def _exponential_(noise: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Fill with Exp(1) draws. On the CPU as -log(U): torch's CPU exponential_ draws element by
    element (75 ms for 64 x 49,152 on two cores, a fifth of a bundled-model step), uniform_
    and log_ are vectorised (19 ms)."""
    if noise.device.type == "cpu":
        # uniform_ can return exactly 0 (float32: steps of 2^-24): clamped first, else -log
        # gives inf, and a row whose one allowed token drew it would pick token 0 (p / inf).
        return noise.uniform_(generator=generator).clamp_min_(
            torch.finfo(noise.dtype).tiny).log_().neg_()
    return noise.exponential_(generator=generator)


def exponential_noise(shape: tuple[int, int], generators: dict[int, torch.Generator],
                      device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """Exp(1) draws [rows, V], clamped to >= tiny: row r from generators[r] where seeded
    (V draws of its own), the others from the global generator."""
    noise = torch.empty(shape, dtype=dtype, device=device)
    if len(generators) < shape[0]:
        _exponential_(noise)
    for row, gen in generators.items():
        # A row's own V draws: its token depends only on its seed, never on the batch.
        _exponential_(noise[row], gen)
    # exponential_ may return exactly 0; 0/0 = nan would win argmax on a masked token.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _exponential_race(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """Sample one index per row: argmax(p / E) with E ~ Exp(1) is distributed as p."""
    noise = exponential_noise(probs.shape, generators, probs.device, probs.dtype)
    return probs.div_(noise).argmax(dim=-1)


def _gather_logprobs(logprobs: Tensor, token_ids: Tensor, k: int) -> LogprobsTensors:
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k <= 0:
        return LogprobsTensors(chosen, token_ids.unsqueeze(1), ranks)
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return LogprobsTensors(
        torch.cat([chosen, top_lp], dim=1),
        torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        ranks,
    )


def compute_prompt_logprobs(logits: Tensor, target_token_ids: Tensor, k: int) -> LogprobsTensors:
    """Logprobs of each prompt token (row t of ``logits`` predicts ``target_token_ids[t]``)."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return _gather_logprobs(logprobs, target_token_ids, k)


class Sampler(torch.nn.Module):
    def forward(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.to(torch.float32)
        # Logprobs describe the model's raw distribution, before any request-side processing.
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        scaled = mask_takes_temperature(logits, meta)
        logits = apply_penalties(logits, meta, meta.temperature if scaled else None)
        sampled = self._sample(logits, meta, scaled)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        lp = _gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs or 0)
        return SamplerOutput(sampled, lp.logprobs, lp.token_ids, lp.ranks)

    @staticmethod
    def _sample(logits: Tensor, meta: SamplingMetadata, scaled: bool = False) -> Tensor:
        """`scaled`: the logits are divided by the temperature already (greedy rows' is 1: their
        argmax is the same), in a fresh tensor."""
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if greedy is not None and meta.all_greedy:
            return greedy
        if not scaled:
            # Division allocates a fresh tensor, so the in-place steps below never touch the
            # caller's logits.
            logits = logits / meta.temperature.unsqueeze(1)
        logits = apply_top_k_top_p_min_p(logits, meta)
        sampled = _exponential_race(logits.softmax(dim=-1), meta.generators)
        if greedy is not None:
            sampled = torch.where(meta.is_greedy, greedy, sampled)
        return sampled
