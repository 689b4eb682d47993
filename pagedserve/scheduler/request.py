"""A request as the scheduler sees it: its tokens, how many are in the KV cache, its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # A plain attribute, not a property: the step path asks it several times per request.
        self.is_finished = self.name.startswith("FINISHED_")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(frozen=True)
class ScoringTask:
    """What makes a request a scoring request: instead of sampling, the engine returns the
    full next-token log-distribution before each token of `continuation` (float32 [len, V]).

    - "decode": the continuation is fed as forced outputs, one decode step per token against
      the KV cache (teacher forcing); the request runs without async overlap.
    - "prefill": prompt + continuation is computed as one prompt (chunked as usual, never from
      the prefix cache) and the logits at the positions that predict the continuation are
      kept; the one token it then samples is dropped.
    """

    mode: str
    continuation: tuple[int, ...]

    MODES: ClassVar[tuple[str, ...]] = ("decode", "prefill")

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise ValueError(f"mode must be 'decode' or 'prefill', not {self.mode!r}")
        if not self.continuation:
            raise ValueError("the continuation to score is empty")


class Request:
    """Prompt and output tokens of one sequence. `num_computed_tokens` counts the tokens whose
    K/V is in the cache; the scheduler feeds the rest, a chunk at a time for long prompts.

    The per-request rules the scheduler, the runner and the sampler share are computed here,
    once: which token ids end it, whether its sampling needs its earlier tokens on the host,
    whether a step must keep logits beyond the sampled token's."""

    # Slots: the step path reads a few of these per request per step, and a request's state
    # then lies in its own object (one less pointer to follow, fewer cache lines).
    __slots__ = ("request_id", "scoring", "prompt_token_ids", "num_prompt_tokens",
                 "all_token_ids", "output_token_ids", "num_tokens", "num_output_tokens",
                 "sampling_params", "eos_token_id", "arrival_time", "cache_salt", "status",
                 "num_computed_tokens", "num_output_placeholders", "num_preemptions",
                 "state_slot", "forced_output_ids", "score_from", "skip_prefix_cache",
                 "needs_logits", "needs_host_history", "grammar", "max_tokens", "min_tokens",
                 "end_token_ids", "spec_token_ids", "pooling", "lora_request",
                 "lora_int_id", "mm_features", "mrope_positions", "mrope_delta")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: int | None = None,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 scoring: ScoringTask | None = None, pooling: Any = None,
                 lora_request: Any = None, mm_features: list[Any] | None = None,
                 mrope_positions: Any = None, mrope_delta: int = 0) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must have at least one token")
        self.request_id = request_id
        self.scoring = scoring
        prompt = list(prompt_token_ids)
        if scoring is not None and scoring.mode == "prefill":
            prompt += scoring.continuation
        self.prompt_token_ids = prompt
        self.num_prompt_tokens = len(prompt)
        self.all_token_ids = list(prompt)
        self.output_token_ids: list[int] = []
        # len(all_token_ids) and len(output_token_ids), kept as plain attributes: the step
        # path reads them several times per request (append_output_token keeps them).
        self.num_tokens = len(prompt)
        self.num_output_tokens = 0
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        # The adapter (a pagedserve.lora.LoRARequest; None and id 0: the base model).
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        # Images (multimodal.MultiModalFeature, in prompt order; [] for a text prompt): where
        # each one's placeholder tokens lie, its processed inputs and its identifier.
        self.mm_features: list[Any] = mm_features or []
        # M-RoPE models: int64 [3, num_prompt_tokens] prompt positions, and the offset of the
        # positions after the prompt (token i at i + mrope_delta on every row).
        self.mrope_positions = mrope_positions
        self.mrope_delta = mrope_delta
        self.status = RequestStatus.WAITING
        # Tokens whose K/V is in the cache or being written by a step already scheduled (the
        # scheduler advances it when it schedules them).
        self.num_computed_tokens = 0
        # Samples of scheduled steps not yet known on the host (at most one: with async
        # scheduling the next step is scheduled while this request's last one still runs).
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # The state slot of a model with state layers while the request runs (the KV cache
        # manager hands it out and takes it back); -1 when it holds none.
        self.state_slot = -1
        # Teacher forcing: the runner emits these tokens instead of sampled ones.
        self.forced_output_ids: list[int] | None = (
            list(scoring.continuation) if scoring is not None and scoring.mode == "decode"
            else None)
        # Scoring by prefill: the full next-token log-distributions at prompt positions
        # score_from..num_prompt_tokens-2 (those predicting prompt tokens score_from+1..).
        self.score_from: int | None = (
            len(prompt_token_ids) - 1 if scoring is not None and scoring.mode == "prefill"
            else None)
        prompt_logprobs = sampling_params.prompt_logprobs is not None
        # A pooling request (pooling.PoolingParams): its whole prompt in one step, pooled
        # instead of sampled (pooling/).
        self.pooling = pooling
        # Prompt logprobs, scoring by prefill and pooling need every prompt position they
        # cover computed, so cached prefixes are skipped.
        self.skip_prefix_cache = (self.score_from is not None or prompt_logprobs
                                  or pooling is not None)
        # A step keeps more than the sampled token for it (logits at forced or prompt
        # positions).
        self.needs_logits = scoring is not None or prompt_logprobs
        # Its sampling reads earlier outputs on the host: its previous sample must be back
        # before its next step launches (no async overlap while it runs).
        self.needs_host_history = (sampling_params.needs_host_history
                                   or self.forced_output_ids is not None)
        # Guided decoding: the engine's matcher for this sequence (structured_output's
        # RequestGrammar), advanced by the scheduler with each sampled token.
        self.grammar: Any = None
        # Speculative decoding: drafts proposed after its last step, verified by its next one
        # (the scheduler consumes them when it schedules it).
        self.spec_token_ids: list[int] = []
        if scoring is not None:
            self.max_tokens = len(scoring.continuation) if scoring.mode == "decode" else 1
            self.min_tokens = 0
            self.end_token_ids: frozenset[int] = frozenset()  # forced tokens never stop it
        else:
            self.max_tokens = sampling_params.max_tokens or 1 << 62
            self.min_tokens = sampling_params.min_tokens
            self.end_token_ids = sampling_params.end_token_ids(eos_token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_tokens += 1
        self.num_output_tokens += 1

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions known from token ids alone (stop strings are the detokenizer's)."""
        if self.num_output_tokens == 0:
            return None
        if (self.output_token_ids[-1] in self.end_token_ids
                and self.num_output_tokens >= self.min_tokens):
            return RequestStatus.FINISHED_STOPPED
        # The grammar has ended (its stop token accepted, even one ignore_eos would pass), or
        # refused a token: nothing more it could accept.
        if self.grammar is not None and (self.grammar.failed or self.grammar.is_terminated):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens},"
                f" out={self.num_output_tokens}, computed={self.num_computed_tokens})")
