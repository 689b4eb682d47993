"""vLLM-shaped results of generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> its logprob (the chosen token plus the top alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # over every token in token_ids
    # One entry per token whose text is returned: a stop string cut from the text takes its
    # tokens' entries with it (they stay in token_ids, which usage counts), so this list
    # may be shorter than token_ids, never longer.
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # What this step added (for streaming): text and token ids since the previous output.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None
    # Teacher-forced scoring only: [num_tokens, vocab] next-token log-distributions.
    forced_logprobs: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

    def __repr__(self) -> str:
        texts = [o.text for o in self.outputs]
        return f"RequestOutput(id={self.request_id!r}, finished={self.finished}, outputs={texts!r})"
