"""The engine core's part: a pooling sequence becomes a scheduler Request that runs its whole
prompt once and ends (`max_tokens=1`, never from the prefix cache: every position it pools is
computed), and a completed step's embeddings go into its StepOutput by sequence id."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Request, SchedulerOutput

# Greedy, so no generator or filter is built for the placeholder sample that ends it.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0)


def pooling_request(r: Any, eos_token_id: int | None) -> Request:
    """The scheduler's Request for a pooling CoreRequest `r`."""
    return Request(r.request_id, r.prompt_token_ids, POOLING_SAMPLING, eos_token_id,
                   r.arrival_time, pooling=r.pooling)


def record_embeddings(batch: SchedulerOutput, pooled: np.ndarray,
                      results: list[tuple[Request, int | None]], out: Any) -> None:
    """Each finished pooling sequence's row of `pooled` (batch order), cut to its
    `dimensions`, into `out.embeddings`. `results` are some of the batch's requests, in batch
    order (those finished while the step ran are left out)."""
    requests, row = batch.requests, 0
    width = pooled.shape[1]
    for request, token in results:
        while requests[row] is not request:
            row += 1
        if token is None or request.pooling is None:
            continue
        d = request.pooling.dimensions or width
        out.embeddings[request.request_id] = pooled[row, :d]
