"""Guided decoding (structured outputs): a grammar per request, compiled from a JSON schema, a
regex, a choice list or an EBNF grammar with xgrammar (or llguidance: the `guidance` backend);
each step a token bitmask for the rows that have one, applied to the logits before sampling.
See docs/structured_outputs.md.

Both libraries are imported lazily: an engine that never sees a guided request loads neither,
and one on a machine without them starts and refuses guided requests only.
"""

from pagedserve.structured_output.grammar import GRAMMAR_KINDS, grammar_key, parse_grammar
from pagedserve.structured_output.manager import (
    BACKENDS,
    RequestGrammar,
    StructuredOutputManager,
    apply_token_bitmask,
    check_backend,
    guided_decoding_unavailable,
)

__all__ = [
    "BACKENDS",
    "GRAMMAR_KINDS",
    "RequestGrammar",
    "StructuredOutputManager",
    "apply_token_bitmask",
    "check_backend",
    "grammar_key",
    "guided_decoding_unavailable",
    "parse_grammar",
]
