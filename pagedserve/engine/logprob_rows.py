"""Where a completed step's logprob rows go in its StepOutput: one row per result (a verify
step's requests have one per kept token), and two steps' rows merged when one call completes
both."""

from __future__ import annotations

from typing import Any

import numpy as np


def logprob_rows(seq_ids: list[str], row_of: dict[str, int], sampled: np.ndarray
                  ) -> np.ndarray:
    """Each result row's row of the step's logprobs: its request's row, or in a verify step
    (samples [B, W]) row b * W + j for the request's j-th kept token."""
    rows = np.fromiter((row_of[s] for s in seq_ids), np.int64, len(seq_ids))
    if sampled.ndim == 1 or rows.size == 0:
        return rows
    # j counts the earlier results of the same request: a stable sort groups them in order.
    order = np.argsort(rows, kind="stable")
    grouped = rows[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    sizes = np.diff(np.r_[starts, grouped.size])
    rank = np.empty_like(rows)
    rank[order] = np.arange(grouped.size) - np.repeat(starts, sizes)
    return rows * sampled.shape[1] + rank


def merge_rows(first: tuple[Any, ...] | None, num_first: int, more: tuple[Any, ...] | None,
                num_more: int) -> tuple[Any, ...]:
    """Logprob rows of two steps completed in one call (the switch from overlapped to step by
    step); the rows of a step without logprobs are zeros, never read: its sequences asked for
    none."""
    if first is None or more is None:
        like = more if first is None else first
        zeros = tuple(np.zeros((num_first if first is None else num_more, *a.shape[1:]),
                               a.dtype) for a in like)
        first, more = (zeros, more) if first is None else (first, zeros)
    width = max(first[0].shape[1], more[0].shape[1])

    def pad(a: Any) -> Any:
        return a if a.ndim == 1 or a.shape[1] == width else np.pad(
            a, ((0, 0), (0, width - a.shape[1])))

    return tuple(np.concatenate([pad(a), pad(b)]) for a, b in zip(first, more, strict=True))
