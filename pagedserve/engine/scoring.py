"""What a step keeps beyond the sampled tokens, for the requests that ask (`needs_logits`):
full next-token distributions of teacher-forced tokens, prompt logprobs, and the rows of a
prefill that a scoring request reads.

Position p of a prompt predicts prompt token p + 1. The head runs over a request's whole chunk,
as transformers' forward does over the sequence: the same matmul shape, so the same rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.engine.sampler import LogprobsTensors, compute_prompt_logprobs
from pagedserve.scheduler import SchedulerOutput

Logits = Callable[[torch.Tensor], torch.Tensor]


def forced_logprobs(batch: SchedulerOutput, index: list[int], logits: torch.Tensor
                    ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """Teacher forcing for the scoring requests among batch rows `index`: the full next-token
    distribution at each forced position, and (batch row, token) to emit instead of the
    sample. Such requests run without async overlap, so their outputs so far are all on the
    host."""
    index = [i for i in index
             if batch.requests[i].forced_output_ids is not None and batch.will_sample[i]]
    if not index:
        return {}, {}
    logprobs = torch.log_softmax(logits[index].float(), dim=-1).cpu()
    result, tokens = {}, {}
    for j, i in enumerate(index):
        request = batch.requests[i]
        tokens[request.request_id] = (i, request.forced_output_ids[request.num_output_tokens])
        result[request.request_id] = logprobs[j]
    return result, tokens


def prompt_position_logprobs(
    batch: SchedulerOutput, index: list[int], hidden: torch.Tensor, compute_logits: Logits,
    device: torch.device,
) -> tuple[dict[str, LogprobsTensors], dict[str, tuple[int, torch.Tensor]]]:
    """For the requests among batch rows `index` that asked, from the logits of their chunk's
    prompt positions:
    - prompt logprobs: the logprobs of the prompt tokens they predict (top `prompt_logprobs`
      beside);
    - scoring by prefill (`score_from` set): (first position, the full log-distributions at
      positions score_from..num_prompt_tokens-2 in this chunk)."""
    prompt_lp: dict[str, LogprobsTensors] = {}
    scores: dict[str, tuple[int, torch.Tensor]] = {}
    starts = np.cumsum(batch.num_scheduled_tokens) - batch.num_scheduled_tokens
    for i in index:
        request = batch.requests[i]
        c, n = int(batch.num_computed_tokens[i]), int(batch.num_scheduled_tokens[i])
        end = min(c + n, request.num_prompt_tokens - 1)  # [c, end) predict prompt tokens
        k = request.sampling_params.prompt_logprobs
        lo = c if request.score_from is None else max(c, request.score_from)
        wants_scores = request.score_from is not None and lo < end
        if not (wants_scores or (k is not None and c < end)):
            continue
        logits = compute_logits(hidden[int(starts[i]):int(starts[i]) + n])
        if k is not None and c < end:
            targets = torch.tensor(request.prompt_token_ids[c + 1:end + 1], device=device)
            lp = compute_prompt_logprobs(logits[:end - c], targets, k)
            prompt_lp[request.request_id] = LogprobsTensors(*(t.cpu() for t in lp))
        if wants_scores:
            scores[request.request_id] = (
                lo, torch.log_softmax(logits[lo - c:end - c].float(), -1).cpu())
    return prompt_lp, scores
