"""The vectorised n-gram lookup against a plain per-row reference: the longest n in
[min, max] whose last-n suffix occurs earlier, its latest occurrence, the tokens after it."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.spec_decode.ngram import NgramProposer


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("min_n, max_n, k", [(1, 3, 4), (2, 2, 3), (1, 5, 1)])
def test_matches_the_reference(min_n, max_n, k):
    rng = np.random.default_rng(0)
    b, width = 300, 40
    table = rng.integers(0, 4, (b + 5, width))  # a small vocabulary: matches are frequent
    table[-5:] = 99  # rows no request uses
    rows = rng.permutation(b)
    lengths = rng.integers(1, width + 1, b)
    eligible = rng.random(b) < 0.9
    drafts = NgramProposer(k, min_n, max_n).propose(table, rows, lengths, eligible)
    for i in range(b):
        want = (_reference(table[rows[i], :lengths[i]].tolist(), k, min_n, max_n)
                if eligible[i] else [])
        assert drafts.row(i) == want, i


def test_nothing_to_propose():
    drafts = NgramProposer(3, 1, 2).propose(np.zeros((2, 8), np.int64), np.array([0, 1]),
                                            np.array([1, 5]), np.array([False, False]))
    assert drafts.counts.tolist() == [0, 0]
