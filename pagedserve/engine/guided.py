"""A step's guided-decoding host work: which rows get a grammar bitmask, and advancing the
matchers by a step's samples ahead of the scheduler.

With async scheduling step N+1 is launched before step N is collected. A guided row's mask for
N+1 needs its matcher to have accepted N's sample, so the runner queues N+1's forward first,
then waits for N's samples (the device stays busy with N+1's forward), advances the matchers
by them (`advance_by_step`) and starts the bitmask's fill in a worker thread (`BitmaskFiller`).
The step's sampling waits for it at the latest moment: when the next step is launched (its
forward needs this step's samples) or when this step is collected. Meanwhile the host completes
the previous step, returns its outputs and schedules the next, the work the fill used to wait
behind. The scheduler's own accept of the same tokens is then a no-op (`RequestGrammar.accept`
by position), and nothing else asks the matchers anything while a fill runs: whether a grammar
failed or ended is kept on `RequestGrammar`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pagedserve.scheduler import SchedulerOutput
from pagedserve.structured_output import StructuredOutputManager


class BitmaskFiller:
    """Fills a step's bitmask on the host in one worker thread; the step's sampling joins it."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="bitmask-fill")

    def start(self, grammars: list, rows: list[int], num_rows: int) -> Future:
        return self._pool.submit(self.manager.fill_bitmask_host, grammars, rows, num_rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)  # idempotent


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
