"""Acceptance counters under vLLM's names, and the figures derived from them."""

from __future__ import annotations

from typing import Any

import numpy as np


class SpecDecodeStats:
    """Running totals: requests that verified drafts (`num_drafts`), drafts verified, drafts
    kept, and drafts kept at each position 1..K."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = np.zeros(num_speculative_tokens, dtype=np.int64)
        self.propose_seconds = 0.0  # the proposer's host wall time (device work waited for)

    def observe(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step's requests: drafts verified and kept, [B] each (rows without drafts
        count for nothing)."""
        has = num_drafts > 0
        self.num_drafts += int(has.sum())
        self.num_draft_tokens += int(num_drafts.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
        k = len(self.num_accepted_tokens_per_pos)
        # Position p (1-based) is kept by every request that kept at least p drafts.
        self.num_accepted_tokens_per_pos += (num_accepted[has, None]
                                             >= np.arange(1, k + 1)[None, :]).sum(axis=0)


    def counters(self) -> dict[str, Any]:
        """The counters under vLLM's metric names (CoreStats' fields)."""
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos":
                    self.num_accepted_tokens_per_pos.tolist(),
                "spec_decode_propose_seconds": self.propose_seconds}


def describe_acceptance(stats: Any) -> str:
    """Mean acceptance length, acceptance rate and per-position acceptance of counters named
    as vLLM's (CoreStats)."""
    drafts = stats.spec_decode_num_drafts
    per_pos = [round(n / drafts, 3) if drafts else 0.0
               for n in stats.spec_decode_num_accepted_tokens_per_pos]
    accepted = stats.spec_decode_num_accepted_tokens
    rate = acceptance_rate(stats.spec_decode_num_draft_tokens, accepted)
    return (f"mean acceptance length {mean_acceptance_length(drafts, accepted):.2f}, "
            f"acceptance rate {100 * rate:.1f}%, per position {per_pos}")


def acceptance_rate(num_draft_tokens: int, num_accepted_tokens: int) -> float:
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0


def mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    """Tokens a verify step gives a request on average: the kept drafts plus the one the
    target always adds (vLLM's definition)."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 0.0
