"""The `xgrammar` backend of guided decoding (the default): grammars compiled against the
tokenizer's vocabulary by xgrammar's compiler, a GrammarMatcher per sequence whose stop tokens
are that sequence's end tokens, and masks filled by its batch matcher in C++ threads."""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.structured_output.grammar import parse_grammar


class XGrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # The manager keeps its own LRU cache; xgrammar's would hold a second copy.
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch_matcher = xgr.BatchGrammarMatcher()

    def compile(self, key: tuple[str, str]) -> Any:
        return self.compiler.compile_grammar(parse_grammar(key))

    def new_matcher(self, compiled: Any, stop_token_ids: list[int] | None) -> Any:
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
