"""What the model runner calls for speculative decoding: the verify step's layout, its
sampling (the rejection sampler) and the next drafts (the proposer), so that the runner only
coordinates."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedserve.pooling.config import resolve_pooler
from pagedserve.spec_decode.config import SpeculativeConfig, check_supported
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.spec_decode.eagle import EagleProposer
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.proposer import Drafts, Proposer, StepTokens
from pagedserve.spec_decode.rejection_sampler import RejectionSampler
from pagedserve.spec_decode.step_graphs import ProposerStep
from pagedserve.spec_decode.verify import VerifyLayout, build_layout

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.sampler import SamplerOutput, SamplingMetadata
    from pagedserve.kv_cache.groups import KVCacheLayout
    from pagedserve.scheduler import SchedulerOutput


def make_speculator(config: EngineConfig, runner: Any) -> Speculator | None:
    """The runner's speculator, None without --speculative-config; what the model cannot
    use is refused here, at start-up, with the reason. A draft model's attention layers are
    appended to the runner's `attn_layers` (before they are bound to the backend)."""
    spec = config.speculative
    if spec is None:
        return None
    check_supported(spec, tensor_parallel_size=runner.tp_size)
    if spec.num_speculative_tokens >= runner.max_model_len:
        # Drafts never pass the context's end: such a K only sizes buffers and graphs by it.
        raise ValueError(f"speculative_config: num_speculative_tokens "
                         f"{spec.num_speculative_tokens} is not below the max_model_len "
                         f"{runner.max_model_len}: no sequence has room for that many drafts "
                         "(a few, 1 to 8, is the usual choice)")
    if resolve_pooler(config.model) is not None:
        raise ValueError("speculative_config: a pooling model (--runner pooling) generates no "
                         "tokens to draft; drop --speculative-config")
    proposer = make_proposer(spec, runner.model, runner.dtype, runner.device,
                             runner.max_model_len, runner.vocab_size, config.model.model,
                             runner.tp_size)
    layers = proposer.attention_layers(len(runner.attn_layers))
    runner.attn_layers += layers
    return Speculator(spec, proposer, runner.device,
                      ProposerStep(proposer, layers, runner.max_num_tokens))


def make_proposer(spec: SpeculativeConfig, target: torch.nn.Module, dtype: torch.dtype,
                  device: torch.device, max_model_len: int, vocab_size: int,
                  target_path: str | None = None, tp_size: int = 1) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    if spec.method == "draft_model":
        whole = tp_size > 1 and spec.draft_tensor_parallel_size == 1
        return DraftModelProposer(spec.num_speculative_tokens, spec.model, dtype, device,
                                  max_model_len, vocab_size, whole)
    if spec.method in ("eagle", "eagle3", "mtp"):
        model = spec.model or target_path if spec.method == "mtp" else spec.model
        return EagleProposer(spec.num_speculative_tokens, spec.method, model, target,
                             dtype, device, max_model_len)
    raise ValueError(f"speculative_config: method {spec.method!r} is not implemented yet")


class Speculator:
    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, device: torch.device,
                 graph_step: ProposerStep | None = None) -> None:
        self.spec = spec
        self.device = device
        self.proposer = proposer
        # The proposer's part of the target's graphed steps (step_graphs.py).
        self.graph_step = graph_step or ProposerStep(proposer, [], 0)
        self._captured: Any = None
        self.rejection_sampler = RejectionSampler(
            spec.synthetic_acceptance_rate if spec.synthetic else None)

    @property
    def num_speculative_tokens(self) -> int:
        return self.spec.num_speculative_tokens

    @property
    def uses_kv_cache(self) -> bool:
        return self.proposer.uses_kv_cache

    def check_layout(self, layout: KVCacheLayout | None) -> None:
        """A draft model proposes on the first cache group's block table: its layers and the
        target's must form one group."""
        if self.uses_kv_cache and layout is not None and len(layout.groups) > 1:
            raise ValueError("speculative_config: a draft model beside KV cache groups of "
                             "several kinds (sliding windows) is not implemented yet")

    def forward_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor) -> None:
        """Under a step's forward context, after the target: a draft model's K/V for the
        step's tokens, or what a head reads of the step (kept until `take_captured`)."""
        self._captured = self.proposer.forward_step(input_ids, positions, hidden)

    def forward_in_graph(self, input_ids: torch.Tensor, positions: torch.Tensor,
                         hidden: torch.Tensor) -> None:
        """`forward_step` inside the target's graphed forward (what its CUDA graph holds):
        what it captures goes to a persistent buffer, read after the replay (`replayed`)."""
        self.graph_step.run(input_ids, positions, hidden)

    def replayed(self, num_tokens: int) -> None:
        """After a graphed step of `num_tokens` real tokens: its captured rows are the step's
        (kept until `take_captured`)."""
        self._captured = self.graph_step.captured(num_tokens)

    def take_captured(self) -> Any:
        """What the last forward captured for the proposer, for the runner to keep with its
        step (a warm-up forward's is simply dropped by the next)."""
        captured, self._captured = self._captured, None
        return captured

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

    def propose_after(self, runner: Any, pending: Any, ineligible: Collection[str]) -> None:
        """The collected step `pending`'s drafts into `pending.drafts`. The runner calls it at
        collect on every rank, never inside a later launch (a guided launch records the step
        before on rank 0 alone): a draft model's collectives meet there on every rank. A
        head's captured hidden states are freed once read."""
        current = runner.input_batch.generation[pending.rows] == pending.generations
        pending.drafts = self.propose(runner, pending.batch, pending.rows, pending.sampled,
                                      current, ineligible, pending.captured)
        pending.captured = None

    def propose(self, runner: Any, batch: SchedulerOutput, rows: np.ndarray,
                sampled: np.ndarray, current: np.ndarray,
                ineligible: Collection[str], captured: Any = None) -> Drafts | None:
        """Drafts for the requests of a collected step whose tokens are in the token table
        (`current`: their rows still theirs), but for `ineligible` ones (scoring, prompt
        logprobs: their steps keep one token's logits). A guided request's drafts are
        proposed as any other's; the scheduler keeps those its grammar accepts.

        Under tensor parallelism rank 0's drafts are the scheduler's (every rank verifies
        them, sent with the step): another rank proposes only to run a draft model's steps,
        whose collectives meet rank 0's, and a model-free proposer not at all (None)."""
        if runner.tp_rank > 0 and not self.uses_kv_cache:
            return None
        seq_lens = (batch.num_computed_tokens + batch.num_scheduled_tokens).astype(np.int64)
        if sampled.ndim == 2:
            num_tokens = seq_lens - batch.num_draft_tokens + (sampled >= 0).sum(axis=1)
        else:
            num_tokens = seq_lens + 1
        eligible = batch.will_sample & current
        if ineligible:
            eligible &= np.fromiter((r.request_id not in ineligible for r in batch.requests),
                                    bool, batch.num_reqs)
        start = time.perf_counter()
        if not self.uses_kv_cache:
            drafts = self.proposer.propose(runner.input_batch.token_ids, rows, num_tokens,
                                           eligible)
        else:
            # Each row's newest token (its first input): the step's sample, or its last kept.
            newest = (sampled if sampled.ndim == 1 else np.take_along_axis(
                sampled, np.maximum((sampled >= 0).sum(axis=1) - 1, 0)[:, None], axis=1)[:, 0])
            drafts = self.proposer.propose_from(runner, StepTokens(
                rows, batch.num_computed_tokens, batch.num_scheduled_tokens, num_tokens,
                batch.will_sample, current, eligible, newest, captured, batch.requests))
        drafts.seconds = time.perf_counter() - start
        return drafts
