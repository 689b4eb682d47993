"""The `xgrammar` backend of guided decoding (the default): grammars compiled against the
tokenizer's vocabulary by xgrammar's compiler, a GrammarMatcher per sequence whose stop tokens
are that sequence's end tokens, and masks filled by its batch matcher (C++ threads for large
batches only)."""

from __future__ import annotations

import os
from typing import Any

import torch

from pagedserve.structured_output.drafts import accepted_prefix
from pagedserve.structured_output.grammar import parse_grammar


class XGrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # The manager keeps its own LRU cache; xgrammar's would hold a second copy.
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        # xgrammar's default ("auto"): half the machine's hardware threads.
        self.max_threads = max(1, (os.cpu_count() or 2) // 2)
        self._batch_matchers: dict[int, Any] = {}

    def compile(self, key: tuple[str, str]) -> Any:
        return self.compiler.compile_grammar(parse_grammar(key))

    def new_matcher(self, compiled: Any, stop_token_ids: list[int] | None) -> Any:
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)

    @staticmethod
    def validate_tokens(matcher: Any, token_ids: list[int]) -> int:
        """How many leading tokens the matcher accepts, its state unchanged."""
        return accepted_prefix(matcher, token_ids)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        threads = fill_threads(len(rows), self.max_threads)
        batch_matcher = self._batch_matchers.get(threads)
        if batch_matcher is None:
            batch_matcher = self._xgr.BatchGrammarMatcher(max_threads=threads)
            self._batch_matchers[threads] = batch_matcher
        batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)


# A fill thread per this many rows. xgrammar's batch fill starts its threads on every call,
# which costs more than small batches save: a step of the benchmark's JSON grammar at 64 rows
# fills in 0.51 ms on one thread and 0.83 ms on two (the 2-core machine); at 256 rows of one
# grammar state, 0.21 ms against 0.68 ms. On the H200's host the default eight threads took
# 1.95 ms a step at 64 rows (benchmarks/structured_output.py, docs/benchmarks.md).
ROWS_PER_FILL_THREAD = 256


def fill_threads(num_rows: int, max_threads: int) -> int:
    """Threads for one batch fill of `num_rows` masks: one until the rows are many."""
    return max(1, min(max_threads, num_rows // ROWS_PER_FILL_THREAD))
