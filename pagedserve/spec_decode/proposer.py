"""The proposer interface: what the model runner calls to get each request's drafts, with every
hook declared here (and its default), as the attention backends' base classes do."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Drafts:
    """Each batch row's drafts: `token_ids` int64 [B, K] (columns past a row's count are
    garbage), `counts` int32 [B] (0: no draft for that row)."""

    token_ids: np.ndarray
    counts: np.ndarray
    seconds: float = 0.0  # host wall time the proposal took (device work waited for)
    # Drafts still on their way from the device (counts are known): fills `token_ids`, called
    # once, when a row is first read. The host does the step's other bookkeeping meanwhile.
    pending: Callable[[], None] | None = None

    def resolve(self) -> Drafts:
        """Wait for the drafts still on the device, if any (the wait counts in `seconds`)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            start = time.perf_counter()
            pending()
            self.seconds += time.perf_counter() - start
        return self

    def row(self, i: int) -> list[int]:
        self.resolve()
        return self.token_ids[i, :int(self.counts[i])].tolist()


@dataclass
class StepTokens:
    """A collected step as a proposer with K/V of its own sees it, per batch row: the
    runner's table `rows`, the tokens cached before the step and scheduled in it, the verified
    tokens after it, whether it sampled, whether its row is still its request's (`current`),
    whether it may get drafts, its newest token (at position num_tokens - 1), what the
    proposer's `forward_step` captured from the step's forward (a head's hidden states, one
    row per scheduled token in batch order), and the step's requests in batch order (an
    M-RoPE head reads their prompt positions and deltas)."""

    rows: np.ndarray
    num_computed: np.ndarray
    num_scheduled: np.ndarray
    num_tokens: np.ndarray
    will_sample: np.ndarray
    current: np.ndarray
    eligible: np.ndarray
    newest: np.ndarray
    captured: Any = None
    requests: Any = None


class Proposer:
    """Proposes up to `num_speculative_tokens` drafts per request after each step: `propose`
    from the token table (a model-free proposer), or `propose_from` with the runner's caches
    (one with K/V of its own, `uses_kv_cache`)."""

    # The proposal reads the step's accepted tokens on the host (n-gram lookup): each step is
    # completed before the next is scheduled. A device proposer (draft model, EAGLE) would keep
    # its drafts on the device and let steps overlap.
    needs_host_tokens: bool = True
    # It keeps K/V of its own (a draft model, a head): a cache group and lookahead slots.
    uses_kv_cache: bool = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def attention_layers(self, first_index: int) -> list[Any]:
        """A proposer with K/V of its own: its attention layers, renumbered from
        `first_index`, which join the target's cache (their cache specs and tensors follow
        from them). None for a model-free proposer."""
        return []

    def forward_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor) -> Any:
        """Under a step's forward context, after the target (whose final hidden states are
        `hidden`): the proposer's own K/V for the step's tokens (a draft model), or what it
        reads from the step (a head's hidden states), returned: the runner keeps it with the
        step and hands it back as `StepTokens.captured`. The target's CUDA graphs capture this
        call too (spec_decode/step_graphs.py: padded input ids, positions and metadata, the
        result copied into a persistent buffer), so it must queue device work only, of a
        shape set by the step's token count."""
        return None

    def setup_graphs(self, runner: Any, capture: bool = True) -> None:
        """At start-up, where the runner could capture decode graphs: a proposer with K/V of
        its own captures its one-token draft steps in CUDA graphs (spec_decode/draft_graphs.py;
        left eager where that fails); `capture=False` keeps their padded path but runs it
        eagerly (tests without CUDA). Default: nothing to capture."""

    def add_request(self, request_id: str) -> None:
        """A request the proposer will be asked about."""

    def finish_request(self, request_id: str) -> None:
        """A request gone (finished, aborted): drop whatever the proposer kept for it."""

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray,
                eligible: np.ndarray) -> Drafts:
        """Drafts for the batch rows `rows` of the runner's token table `token_ids` [R, L],
        whose verified tokens are `num_tokens` [B]; rows where `eligible` is False get none."""
        raise NotImplementedError

    def propose_from(self, runner: Any, step: StepTokens) -> Drafts:
        """A proposer with K/V of its own (`uses_kv_cache`): drafts from each eligible row's
        newest token, on the runner's block table, metadata builders and caches."""
        raise NotImplementedError
