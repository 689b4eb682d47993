"""A request as the scheduler sees it: its tokens, how many are in the KV cache, its state."""

from __future__ import annotations

import enum
import time
from typing import Any


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


class Request:
    """Prompt and output tokens of one sequence. `num_computed_tokens` counts the tokens whose
    K/V is in the cache; the scheduler feeds the rest, a chunk at a time for long prompts."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                 eos_token_id: int | None = None, arrival_time: float | None = None,
                 cache_salt: str | None = None, score_from: int | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must have at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        # Tokens whose K/V is in the cache or being written by a step already scheduled (the
        # scheduler advances it when it schedules them).
        self.num_computed_tokens = 0
        # Samples of scheduled steps not yet known on the host (at most one: with async
        # scheduling the next step is scheduled while this request's last one still runs).
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # Scoring by prefill: the full next-token log-distributions at prompt positions
        # score_from..num_prompt_tokens-2 (those predicting prompt tokens score_from+1..).
        self.score_from = score_from
        # Prompt logprobs and scoring need logits at every prompt position they cover, so
        # cached prefixes are skipped.
        self.skip_prefix_cache = (score_from is not None or
                                  getattr(sampling_params, "prompt_logprobs", None) is not None)
        self.max_tokens: int = getattr(sampling_params, "max_tokens", None) or 1 << 62
        self.min_tokens: int = getattr(sampling_params, "min_tokens", 0) or 0
        self.ignore_eos: bool = bool(getattr(sampling_params, "ignore_eos", False))
        self.stop_token_ids = frozenset(getattr(sampling_params, "stop_token_ids", None) or ())
        # Teacher forcing (scoring): the runner emits these tokens instead of sampled ones and
        # keeps the full next-token distribution at each of them.
        self.forced_output_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions known from token ids alone (stop strings are the detokenizer's)."""
        if self.num_output_tokens == 0:
            return None
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.min_tokens:
            if (not self.ignore_eos and last == self.eos_token_id) or last in self.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens},"
                f" out={self.num_output_tokens}, computed={self.num_computed_tokens})")
