"""A step's guided-decoding host work: which rows get a grammar bitmask, and advancing the
matchers by a step's samples ahead of the scheduler.

With async scheduling step N+1 is launched before step N is collected. A guided row's mask for
N+1 needs its matcher to have accepted N's sample, so the runner queues N+1's forward first,
then waits for N's samples (the device stays busy with N+1's forward), counts them as accepted
(`advance_by_step`) and hands the matchers' accepts and then the mask's fill to the
structured-output manager's fill thread (`start_mask`). N+1's sampling is queued by the next
launch (or by N+1's collect): the host's work in between (collecting N, the scheduler's update
and next schedule, the next step's inputs) overlaps the thread's, which xgrammar runs without
the GIL (tvm-ffi, its binding, releases it). The scheduler's own accept of the same tokens is
then a no-op (`RequestGrammar.accept` by position).

Accepts that decide something before the thread runs stay on the engine's thread: a token that
may end the grammar (whether it ended is read when the next mask's rows are chosen and by the
scheduler's stop check), any accept of the guidance backend (llguidance has no batch accept),
and every accept of a step that readmits a guided sequence (its rollback must follow them).

History: the fill ran on the engine's thread between the forward and the sampler until
2026-12-02 (0.21-0.41 ms a step on the H200 at batch 64, on the host's critical path); then on a
worker thread with the accepts on the engine's thread (0.25 ms a step at batch 64 on the H200)
and a wait for the fill to start (a thread pool's wake-up, 0.18 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedserve.scheduler import SchedulerOutput
from pagedserve.structured_output.manager import (
    BitmaskFill,
    RequestGrammar,
    StructuredOutputManager,
)


@dataclass
class Advance:
    """The sequences a step's samples advanced, and the accepts left to the fill thread:
    each grammar of `deferred` counts its token of `tokens` already."""

    advanced: set[str] = field(default_factory=set)
    deferred: list[RequestGrammar] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def run_here(self) -> None:
        """Run the deferred accepts on this thread (no fill follows them)."""
        for grammar, token in zip(self.deferred, self.tokens, strict=True):
            grammar.accept_deferred(token)
        self.deferred, self.tokens = [], []


def advance_by_step(batch: SchedulerOutput, sampled: np.ndarray, defer: bool) -> Advance:
    """Advance each live guided sequence that sampled in `batch` by its sample; with `defer`
    the accepts that may wait are left to the fill thread."""
    advance = Advance()
    for request, samples, token in zip(batch.requests, batch.will_sample.tolist(),
                                       sampled.tolist(), strict=True):
        grammar = request.grammar
        if grammar is None or not samples or request.is_finished:
            continue
        position = request.num_output_tokens
        if defer and grammar.defer_accept(token, position):
            advance.deferred.append(grammar)
            advance.tokens.append(token)
        else:
            grammar.accept(token, position)
        advance.advanced.add(request.request_id)
    return advance


def rows_to_mask(batch: SchedulerOutput, advanced: set[str]) -> tuple[list[int], list]:
    """The rows of `batch` that sample under a grammar, and their grammars. Every earlier
    sample is accepted by now, or counted and left to the fill thread (by the scheduler, or
    for `advanced` by `advance_by_step`). A grammar that has ended (its sequence finishes with
    the step in flight) gets no mask: that row's sample is dropped."""
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
               advance: Advance) -> BitmaskFill | None:
    """Start the fill thread on `advance`'s deferred accepts and then the bitmask of
    `batch`'s guided rows (None when it has none). A mask of every row is applied without an
    index."""
    if advance.deferred and any(batch.is_new):
        advance.run_here()  # a readmitted row's rollback must follow its accepts
    rows, grammars = rows_to_mask(batch, advance.advanced)
    if not rows:
        advance.run_here()
        return None
    fill = manager.start_fill(grammars, rows, batch.num_reqs, advance.deferred, advance.tokens)
    if len(rows) == batch.num_reqs:
        fill.rows = None
    return fill
