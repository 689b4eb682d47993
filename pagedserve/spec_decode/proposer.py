"""The proposer interface: what the model runner calls to get each request's drafts, with every
hook declared here (and its default), as the attention backends' base classes do."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Drafts:
    """Each batch row's drafts: `token_ids` int64 [B, K] (columns past a row's count are
    garbage), `counts` int32 [B] (0: no draft for that row)."""

    token_ids: np.ndarray
    counts: np.ndarray

    def row(self, i: int) -> list[int]:
        return self.token_ids[i, :int(self.counts[i])].tolist()


class Proposer:
    """Proposes up to `num_speculative_tokens` drafts per request after each step."""

    # The proposal reads the step's accepted tokens on the host (n-gram lookup): each step is
    # completed before the next is scheduled. A device proposer (draft model, EAGLE) would keep
    # its drafts on the device and let steps overlap.
    needs_host_tokens: bool = True
    # It keeps K/V of its own (a draft model, a head): a cache group and lookahead slots.
    uses_kv_cache: bool = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def load(self, target: object) -> None:
        """Load the draft's weights (a head may share the target's embedding and head)."""

    def kv_cache_specs(self) -> list:
        """The draft's own attention layers' cache specs (none for a model-free proposer)."""
        return []

    def add_request(self, request_id: str) -> None:
        """A request the proposer will be asked about."""

    def finish_request(self, request_id: str) -> None:
        """A request gone (finished, aborted): drop whatever the proposer kept for it."""

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray,
                eligible: np.ndarray) -> Drafts:
        """Drafts for the batch rows `rows` of the runner's token table `token_ids` [R, L],
        whose verified tokens are `num_tokens` [B]; rows where `eligible` is False get none."""
        raise NotImplementedError
