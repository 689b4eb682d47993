"""N-gram prompt lookup: the drafts are the tokens that followed the latest earlier occurrence
of the sequence's last n tokens (the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs), from the prompt or the output so far. Vectorised over the batch: one pass per n over
a [B, L] table, never a loop over tokens."""

from __future__ import annotations

import numpy as np

from pagedserve.spec_decode.proposer import Drafts, Proposer


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        super().__init__(num_speculative_tokens)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray,
                eligible: np.ndarray) -> Drafts:
        b = len(rows)
        drafts = Drafts(np.zeros((b, self.k), dtype=np.int64), np.zeros(b, dtype=np.int32))
        if not b or not eligible.any():
            return drafts
        num_tokens = np.where(eligible, num_tokens, 0).astype(np.int64)
        width = int(num_tokens[eligible].max())
        table = token_ids[rows, :width]
        last = find_matches(table, num_tokens, eligible, self.min_n, self.max_n)
        found = last >= 0
        # The draft is what followed the match, up to the sequence's end (known tokens only).
        counts = np.where(found, np.minimum(self.k, num_tokens - 1 - last), 0)
        cols = np.minimum(last[:, None] + 1 + np.arange(self.k), width - 1)
        drafts.token_ids = np.take_along_axis(table, np.maximum(cols, 0), axis=1)
        drafts.counts = counts.astype(np.int32)
        return drafts


def find_matches(table: np.ndarray, num_tokens: np.ndarray, eligible: np.ndarray,
                 min_n: int, max_n: int) -> np.ndarray:
    """Per row the end index e of the latest match of its last n tokens, table[e-n+1..e] ==
    table[len-n..len-1] with e < len - 1, for the longest n in [min_n, max_n] that has one;
    -1 where none. `agree` after pass k holds, for every end e, whether the k tokens ending at
    e equal the row's last k: one comparison of the table per k."""
    b, width = table.shape
    ends = np.arange(width)
    agree = np.ones((b, width), dtype=bool)
    best = np.full(b, -1, dtype=np.int64)
    arange_b = np.arange(b)
    for k in range(1, max_n + 1):
        has_k = eligible & (num_tokens > k)  # the suffix and at least one token before it
        if not has_k.any():
            break
        # The row's k-th token from the end, compared with the token k-1 before each end.
        suffix = table[arange_b, np.maximum(num_tokens - k, 0)]
        agree[:, k - 1:] &= table[:, :width - k + 1] == suffix[:, None]
        agree[:, :k - 1] = False
        if k < min_n:
            continue
        valid = agree & (ends[None, :] < (num_tokens - 1)[:, None]) & has_k[:, None]
        any_match = valid.any(axis=1)
        latest = width - 1 - np.argmax(valid[:, ::-1], axis=1)
        best = np.where(any_match, latest, best)  # a longer n wins over a shorter one
    return best
