"""What the model runner calls for speculative decoding: the verify step's layout, its
sampling (the rejection sampler) and the next drafts (the proposer), so that the runner only
coordinates."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.spec_decode.config import SpeculativeConfig, check_supported
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.proposer import Drafts, Proposer
from pagedserve.spec_decode.rejection_sampler import RejectionSampler
from pagedserve.spec_decode.verify import VerifyLayout, build_layout

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.sampler import SamplerOutput, SamplingMetadata
    from pagedserve.scheduler import SchedulerOutput


def make_speculator(config: EngineConfig, device: torch.device, has_state_layers: bool,
                    tensor_parallel_size: int) -> Speculator | None:
    """The runner's speculator, None without --speculative-config; what the model cannot
    use is refused here, at start-up, with the reason."""
    spec = config.speculative
    if spec is None:
        return None
    check_supported(spec, has_state_layers=has_state_layers,
                    tensor_parallel_size=tensor_parallel_size)
    return Speculator(spec, device)


def make_proposer(spec: SpeculativeConfig) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    raise ValueError(f"speculative_config: method {spec.method!r} is not implemented yet")


class Speculator:
    def __init__(self, spec: SpeculativeConfig, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.proposer = make_proposer(spec)
        self.rejection_sampler = RejectionSampler(
            spec.synthetic_acceptance_rate if spec.synthetic else None)

    @property
    def num_speculative_tokens(self) -> int:
        return self.spec.num_speculative_tokens

    def layout(self, batch: SchedulerOutput, query_start_loc: np.ndarray
               ) -> VerifyLayout | None:
        """The layout of a step with drafts; None for a step without any."""
        if batch.num_draft_tokens is None:
            return None
        layout = build_layout(batch.num_draft_tokens, batch.draft_token_ids, query_start_loc,
                              self.device)
        if any(r.min_tokens for r in batch.requests):
            layout.min_tokens_left = np.fromiter(
                (max(r.min_tokens - r.num_output_tokens, 0) for r in batch.requests), np.int64,
                batch.num_reqs)
        return layout

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata, layout: VerifyLayout
               ) -> SamplerOutput:
        return self.rejection_sampler(logits, meta, layout)

    def propose(self, batch: SchedulerOutput, rows: np.ndarray, token_ids: np.ndarray,
                sampled: np.ndarray, current: np.ndarray,
                ineligible: Collection[str]) -> Drafts:
        """Drafts for the requests of a collected step whose tokens are in the token table
        (`current`: their rows still theirs), but for `ineligible` ones (guided, scoring,
        prompt logprobs: their steps keep one token's logits)."""
        seq_lens = (batch.num_computed_tokens + batch.num_scheduled_tokens).astype(np.int64)
        if sampled.ndim == 2:
            num_tokens = seq_lens - batch.num_draft_tokens + (sampled >= 0).sum(axis=1)
        else:
            num_tokens = seq_lens + 1
        eligible = batch.will_sample & current
        if ineligible:
            eligible &= np.fromiter((r.request_id not in ineligible for r in batch.requests),
                                    bool, batch.num_reqs)
        return self.proposer.propose(token_ids, rows, num_tokens, eligible)
