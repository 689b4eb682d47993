"""Guided decoding with speculative drafts: how many leading drafts a grammar accepts (checked
before a step schedules them), and a verify step's bitmask, one row per draft position.

A request with K drafts gets 1+K logits rows in a verify step; row j predicts the token after
its j-th draft, so its mask is the grammar's state after drafts 1..j. The fill advances each
matcher over its drafts one position at a time (one batch fill of the rows at position j,
then every matcher accepts its draft j), then rolls the matchers back: after the step the
scheduler advances them by the tokens the step keeps, as for any step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def accepted_prefix(matcher: Any, token_ids: list[int]) -> int:
    """How many leading `token_ids` the matcher accepts, its state left as it was: accept in
    turn, then roll back (xgrammar's matcher refuses a token without changing its state)."""
    n = 0
    for token in token_ids:
        if not matcher.accept_token(token):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return n


def draft_rows(rows: list[int], drafts: list[list[int]]) -> list[int]:
    """Every bitmask row of a verify step's grammars: rows[i] .. rows[i] + len(drafts[i])."""
    return [row + j for row, ids in zip(rows, drafts, strict=True) for j in range(len(ids) + 1)]


def fill_over_drafts(fill: Callable[[list[Any], torch.Tensor, list[int]], None],
                     matchers: list[Any], bitmask: torch.Tensor, rows: list[int],
                     drafts: list[list[int]]) -> None:
    """Row rows[i] + j of `bitmask` for j = 0..len(drafts[i]): matcher i's mask after its
    first j drafts (`fill`: the backend's batch fill of (matchers, bitmask, rows)). The drafts
    were checked against the grammars (`accepted_prefix`), so each is accepted; a matcher
    that ends on one (its stop token) leaves the rows after it allowing every token (the
    sequence ends there if that draft is kept, and the tokens after are dropped). The
    matchers are as they were when it returns."""
    lengths = [len(ids) for ids in drafts]
    advanced = [0] * len(matchers)
    live = list(range(len(matchers)))
    for j in range(max(lengths, default=0) + 1):
        if not live:
            break
        fill([matchers[i] for i in live], bitmask, [rows[i] + j for i in live])
        still = []
        for i in live:
            if j == lengths[i]:
                continue
            matcher = matchers[i]
            if matcher.accept_token(drafts[i][j]):
                advanced[i] += 1
                if not matcher.is_terminated():
                    still.append(i)
                    continue
            else:  # never expected: the scheduler checked them
                logger.error("a grammar refused its draft token %d", drafts[i][j])
            with torch.inference_mode():  # (the buffer may be an inference tensor)
                bitmask[rows[i] + j + 1:rows[i] + lengths[i] + 1] = -1
        live = still
    for matcher, n in zip(matchers, advanced, strict=True):
        if n:
            matcher.rollback(n)
