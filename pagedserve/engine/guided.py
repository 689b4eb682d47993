"""A step's guided-decoding host work: which rows get a grammar bitmask, and advancing the
matchers by a step's samples ahead of the scheduler.

With async scheduling step N+1 is launched before step N is collected. A guided row's mask for
N+1 needs its matcher to have accepted N's sample, so the runner queues N+1's forward first,
then waits for N's samples (the device stays busy with N+1's forward), and `start_mask`
advances the matchers by them and starts the mask's fill (on the structured-output manager's
fill thread or its grammar workers). N+1's sampling is queued first thing in the next launch
(or by N+1's collect): the host's work in between (collecting N, the scheduler's update and
next schedule) overlaps the fill, and the device's copy of the mask and its sampling overlap
the next step's input building, so the samples that launch waits for are mostly there. The
fill thread's xgrammar runs without the GIL (tvm-ffi, its binding, releases it by default: on
the CPU machine a Python thread kept spinning at full speed through a stream of fills). The
scheduler's own accept of the same tokens is then a no-op (`RequestGrammar.accept` by
position).

A step that verifies drafts (speculative decoding) is never launched with an earlier step in
flight (the engine completes each step while speculating): its grammars have accepted every
sample, and each guided request with K drafts (checked against its grammar by the scheduler)
gets 1+K mask rows at its logits rows, the masks after 0..K of its drafts
(`structured_output/drafts.py`).

History: the fill ran on the engine's thread between the forward and the sampler until
2026-12-02 (0.21-0.41 ms a step on the H200 at batch 64, on the host's critical path). A worker
thread tried earlier had waited for the GIL to start: the engine thread's Python between the
fill's submission and its use never released it, so `start_fill` now waits until the fill is
under way.
"""

from __future__ import annotations

import numpy as np

from pagedserve.engine.runner_outputs import PendingStep
from pagedserve.scheduler import SchedulerOutput
from pagedserve.spec_decode.verify import VerifyLayout
from pagedserve.structured_output.manager import BitmaskFill, StructuredOutputManager


def advance_by_step(batch: SchedulerOutput, sampled: np.ndarray) -> set[str]:
    """Advance each live guided sequence that sampled in `batch` by its sample; the ids of
    the sequences advanced."""
    advanced: set[str] = set()
    for i, (request, samples) in enumerate(zip(batch.requests, batch.will_sample.tolist(),
                                               strict=True)):
        if request.grammar is None or not samples or request.is_finished:
            continue
        request.grammar.accept(int(sampled[i]), len(request.output_token_ids))
        advanced.add(request.request_id)
    return advanced


def rows_to_mask(batch: SchedulerOutput, advanced: set[str]) -> tuple[list[int], list]:
    """The rows of `batch` that sample under a grammar, and their grammars. Every earlier
    sample is accepted by now (by the scheduler, or for `advanced` by `advance_by_step`). A
    grammar that has ended (its sequence finishes with the step in flight) gets no mask: that
    row's sample is dropped."""
    rows, grammars = [], []
    for i, (request, samples) in enumerate(zip(batch.requests, batch.will_sample.tolist(),
                                               strict=True)):
        grammar = request.grammar
        if grammar is None or not samples or grammar.failed or grammar.is_terminated:
            continue
        if batch.is_new[i]:
            # Readmitted after preemption: recompute keeps every output token, so this is a
            # no-op unless a sample was dropped; the matcher follows the tokens kept.
            grammar.rollback_to(request.num_output_tokens + (request.request_id in advanced))
        rows.append(i)
        grammars.append(grammar)
    return rows, grammars


def start_mask(manager: StructuredOutputManager, batch: SchedulerOutput,
               prev: PendingStep | None = None, verify: VerifyLayout | None = None
               ) -> BitmaskFill | None:
    """Advance the matchers by the samples of `prev` (the step before `batch`, uncollected,
    its samples on the host; None: none) and start filling the bitmask of `batch`'s guided
    rows (None when it has none). `verify`: the layout of a step with drafts, whose mask has
    a row per logits row."""
    if verify is not None:
        assert prev is None, "a verify step is launched with no step in flight"
        return _start_verify_mask(manager, batch, verify)
    if prev is None:
        rows, grammars = rows_to_mask(batch, set())
    elif prev.batch.requests == batch.requests and not any(batch.is_new):  # most decode steps
        assert prev.sampled is not None
        # Every row sampling in both steps: the same rows have a grammar (the workers check
        # that none may have ended).
        if (prev.fill is not None and prev.batch.will_sample.all()
                and batch.will_sample.all()):
            fill = manager.repeat_fill(prev.fill, prev.sampled)
            if fill is not None:
                return fill
        rows, grammars = _advance_and_rows(batch, prev.batch.will_sample, prev.sampled)
    else:
        assert prev.sampled is not None
        rows, grammars = rows_to_mask(batch, advance_by_step(prev.batch, prev.sampled))
    if not rows:
        return None
    return manager.start_fill(grammars, rows, batch.num_reqs)


def _start_verify_mask(manager: StructuredOutputManager, batch: SchedulerOutput,
                       verify: VerifyLayout) -> BitmaskFill | None:
    rows, grammars = rows_to_mask(batch, set())
    if not rows:
        return None
    drafts = batch.draft_token_ids
    assert drafts is not None
    return manager.start_fill(grammars, verify.row_start[rows].tolist(), verify.num_rows,
                              [drafts[i] for i in rows])


def _advance_and_rows(batch: SchedulerOutput, sampled_before: np.ndarray, sampled: np.ndarray
                      ) -> tuple[list[int], list]:
    """`advance_by_step` and `rows_to_mask` in one pass, for a batch of the same requests in
    the same rows as the step before it (a row per request a step: the host's time is the
    step's at batch 64 on a fast GPU)."""
    rows, grammars = [], []
    for i, (request, was_sampled, samples, token) in enumerate(zip(
            batch.requests, sampled_before.tolist(), batch.will_sample.tolist(),
            sampled.tolist(), strict=True)):
        grammar = request.grammar
        if grammar is None:
            continue
        if was_sampled and not request.is_finished:
            grammar.accept(token, len(request.output_token_ids))
        if samples and not grammar.failed and not grammar.is_terminated:
            rows.append(i)
            grammars.append(grammar)
    return rows, grammars
