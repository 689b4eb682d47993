"""The step's bidirectional image spans, for models whose image tokens attend to each other
both ways (Gemma 3: `SupportsMultiModal.bidirectional_image_spans`): the runs of embedding
tokens of the images the step's tokens reach (an image's whole placeholder range, or one run
per pan-and-scan crop), which the common metadata builder turns into each token's
`attend_limit` (attention/metadata.py). The scheduler never splits such a span across steps
(encoder_cache.py), so every span the step reaches ends inside it."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.attention.metadata import BidirectionalSpans


def step_spans(batch: Any) -> BidirectionalSpans | None:
    """The spans of `batch` (a SchedulerOutput) its new tokens reach, by request index in the
    batch; None when there are none. A loop over the step's requests with images and their
    images (not over tokens); the per-token work is the builder's, vectorised."""
    req: list[np.ndarray] = []
    start: list[np.ndarray] = []
    end: list[np.ndarray] = []
    computed = batch.num_computed_tokens
    scheduled = batch.num_scheduled_tokens
    for i, request in enumerate(batch.requests):
        if not request.mm_features or scheduled[i] < 2:  # one token sees no later one
            continue
        lo = int(computed[i])
        hi = lo + int(scheduled[i])
        for feature in request.mm_features:
            p = feature.placeholder
            if p.offset >= hi:
                break
            if p.end > lo and p.length > 1:
                # One span per run of embedding tokens: a pan-and-scan image's crops each
                # attend within themselves, and the text between them causally.
                starts, ends = p.embed_runs
                req.append(np.full(len(starts), i, dtype=np.int64))
                start.append(starts)
                end.append(ends)
    if not req:
        return None
    return BidirectionalSpans(np.concatenate(req), np.concatenate(start), np.concatenate(end))
