"""Python's cyclic garbage collector and a started engine's heap.

A started engine holds a few hundred thousand container objects that live as long as it does
(torch's and transformers' modules, the model, the tokenizer's tables). Every full collection
walks all of them, and serving allocates enough that one runs every few hundred requests:
adding a 256-token embedding request spent 55% of its time there (68 of 123 us on a 2-core
CPU). `freeze_startup_heap` at the end of start-up moves them out of the collector's sight,
as vLLM's engine core does (without its collection first: a process that starts many
engines, as the tests do, would pay ~50 ms a start; the start-up's garbage waits for the
next thaw). `thaw_heap` gives them back before an engine is dropped, so that its reference
cycles (the engine's parts refer to each other) can still be freed.

`collector_paused` keeps the collector from running automatically through an offline pooling
call (`LLM.embed` and its kin). Such a call holds every request and output it makes until it
returns, each with lists of its prompt's ids, which the collector walks id by id at every
collection that reaches them: with 10,000 prompts of 256 tokens queued, collections took
~0.4 s of a 0.9 s call on a 2-core CPU (the forward stubbed), most of it two full ones. The
pooling step path makes no reference cycles (a test counts them), so the pause frees nothing
later that it would have freed sooner.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap() -> None:
    """Leave every object alive now out of later collections."""
    gc.freeze()


def thaw_heap() -> None:
    """Objects frozen by `freeze_startup_heap` become collectable again."""
    gc.unfreeze()


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block (one already paused, by the caller or by
    `gc.disable()`, stays as it was)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
