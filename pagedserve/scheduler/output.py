"""What one scheduling step decided."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedserve.scheduler.request import Request


@dataclass
class SchedulerOutput:
    """The requests of one step in batch order (prefills first, then decodes: a decode is a
    request with exactly one new token), with arrays aligned to that order."""

    requests: list[Request]
    num_scheduled_tokens: np.ndarray  # int32 [B]: new tokens of each request this step
    num_computed_tokens: np.ndarray  # int32 [B]: tokens already in the cache before this step
    # Per request, per KV cache group: the block ids appended this step.
    new_block_ids: list[tuple[list[int], ...]]
    is_new: list[bool]  # the request needs a fresh row (just admitted, or resumed)
    num_prefills: int
    # bool [B]: the step reaches the end of the request's sequence, so its sample is the
    # request's next token (a prompt chunk that stops short samples nothing).
    will_sample: np.ndarray
    # Requests whose rows the model runner drops before this step (finished, aborted or
    # preempted since the last step).
    freed_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0
    # A request's cached prefix includes blocks that this same step writes (a prefix-cache hit
    # on another request's prompt being computed now, e.g. the n samples of one prompt): the
    # step's K/V must be in the cache before any attention reads it.
    context_written_in_step: bool = False
    # Speculative decoding (None in a step without drafts): int32 [B] drafts scheduled after
    # each request's last verified token, and the drafts themselves ([] for none). A request
    # with K drafts runs 1 + K new tokens.
    num_draft_tokens: np.ndarray | None = None
    draft_token_ids: list[list[int]] | None = None
    # Images (multimodal/): request id -> indices into its mm_features of the images whose
    # encoders run this step; whether any request's new tokens include image placeholders
    # (the runner then builds inputs_embeds; a step without them runs as a text step); the
    # identifiers whose rows the runner's store drops before this step's encoders run.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    embeds_images: bool = False
    free_encoder_identifiers: list[str] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())

    @property
    def is_empty(self) -> bool:
        return not self.requests
