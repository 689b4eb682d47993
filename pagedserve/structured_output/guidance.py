"""The `guidance` backend of guided decoding: llguidance's matchers (a lexer plus an Earley
parser, masks computed lazily per step) behind the interface the xgrammar backend has, so
the manager, the runner and the sampler do not know which one runs.

A spec's grammar is llguidance's own translation of it (`grammar_from`: JSON schema, regex,
choice list, GBNF/Lark); it is validated against the tokenizer once and kept as a prototype
matcher per spec, and each sequence gets a copy. Masks are llguidance's int32 bitmask, the
same layout as xgrammar's (bit set: token allowed), so one application kernel serves both.
Sequences end with the tokenizer's EOS (llguidance fixes end tokens per tokenizer, not per
sequence as xgrammar can) and a matcher counts as ended once it accepts nothing but EOS.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from pagedserve.structured_output.grammar import check_json_schema

_FORMATS = {"json": "json", "json+ws": "json", "regex": "regex", "choice": "choice",
            "grammar": "grammar", "json_object": "json"}
_WHAT = {"json": "JSON schema", "json+ws": "JSON schema", "regex": "regex",
         "choice": "choice list", "grammar": "grammar", "json_object": "JSON object grammar"}


class GuidanceMatcher:
    """One sequence's llguidance matcher, with the xgrammar matcher's method names."""

    def __init__(self, matcher: Any) -> None:
        self.ll = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.ll.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self.ll.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self.ll.rollback(num_tokens)


class GuidanceBackend:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor()

    def grammar_text(self, key: tuple[str, str]) -> str:
        kind, text = key
        if kind in ("json", "json+ws"):
            check_json_schema(json.loads(text))
            return self._ll.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": kind == "json+ws"})
        if kind == "json_object":
            return self._ll.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults={"whitespace_flexible": False})
        return self._ll.grammar_from(_FORMATS[kind], text)

    def compile(self, key: tuple[str, str]) -> Any:
        """A validated prototype matcher of a spec; ValueError naming what is wrong."""
        try:
            grammar = self.grammar_text(key)
        except ValueError as exc:
            raise ValueError(f"invalid {_WHAT[key[0]]}: {exc}") from None
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"invalid {_WHAT[key[0]]}: {messages[0]}")
        return self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)

    def new_matcher(self, compiled: Any, stop_token_ids: list[int] | None) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy())

    @staticmethod
    def validate_tokens(matcher: GuidanceMatcher, token_ids: list[int]) -> int:
        """How many leading tokens the matcher accepts, its state unchanged: llguidance's own
        check (a refused `consume_token` would leave its matcher in its error state for
        good), cut after a token that ends the grammar (it would take an EOS after that,
        which the sequence never gets: it ends on that token)."""
        ll = matcher.ll
        n = ll.validate_tokens(token_ids)
        for i in range(n):
            ll.consume_token(token_ids[i])
            if ll.is_stopped():
                ll.rollback(i + 1)
                return i + 1
        if n:
            ll.rollback(n)
        return n

    def fill(self, matchers: list[GuidanceMatcher], bitmask: torch.Tensor,
             rows: list[int]) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(m.ll, row) for m, row in zip(matchers, rows, strict=True)],
            bitmask)
