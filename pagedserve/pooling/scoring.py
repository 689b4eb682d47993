"""Rerankers: a causal cross-encoder (sentence-transformers' Transformer + LogitScore, the form
Qwen3-Reranker is served in) scores a (query, document) pair. The pair is rendered as
sentence-transformers renders it: the tokenizer's chat template over two messages of roles
`query` and `document`, no generation prompt; the score is the step pooler's
(`methods.logit_score`). `LLM.score()` and `/score`, `/rerank`, `/v1/rerank` use this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.pooling.outputs import PoolingRequestOutput

# Probe pairs: a template that ignores a role renders two of them alike.
_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"))


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def scoring_output(output: PoolingRequestOutput, pooler: Any = None) -> ScoringRequestOutput:
    """A pair's score: a causal reranker's row is its score; an encoder cross-encoder's
    (`pooler.task` classify) its logit, through its activation."""
    return ScoringRequestOutput(output.request_id, output.prompt_token_ids,
                                ScoringOutput(row_score(output.outputs.data, pooler)))


def row_score(row: Any, pooler: Any) -> float:
    if pooler is not None and pooler.task == "classify":
        from pagedserve.pooling.classify import pair_score

        return pair_score(row, pooler)
    return float(row[0])


def pair_list(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one query against each document, or the two lists pairwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one "
                         "text_1, or as many as text_2")
    return list(zip(first, second, strict=True))


def pair_token_ids(tokenizer: Any, pairs: list[tuple[str, str]], pooler: Any = None,
                   max_length: int | None = None) -> list[list[int]]:
    """Each pair rendered with the model's chat template (query and document roles); for an
    encoder cross-encoder (`pooler.task` classify), its tokenizer's pair template, truncated to
    `max_length` there as CrossEncoder truncates. A rendered pair over `max_length` tokens loses
    the end of its document (then of its query, when the document alone cannot make it fit),
    so the template's instruction and suffix and the query stay (`_render_within`)."""
    if pooler is not None and pooler.task == "classify":
        from pagedserve.pooling.classify import encoder_pair_ids

        return encoder_pair_ids(tokenizer, pairs, pooler, max_length)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this reranker has no chat template to render (query, document) "
                         "pairs with")
    _check_roles(tokenizer)
    return [_render_within(tokenizer, query, document, max_length)
            for query, document in pairs]


def _render_within(tokenizer: Any, query: str, document: str, max_length: int | None
                   ) -> list[int]:
    """The pair's rendered ids, at most `max_length` of them: the document's tokens are cut
    from its end, then the query's, and the pair rendered again.

    vLLM tokenizes the whole rendered prompt with `truncation=True, max_length=k`, so the
    tokenizer's truncation side decides what goes: on the right (the default) the template's
    suffix, whose last token the score is read at, is dropped with the document's tail; on the
    left the instruction and the query. Cutting the texts instead keeps what the score means:
    the same as scoring the truncated document itself."""
    ids = _render(tokenizer, query, document)
    if max_length is None or len(ids) <= max_length:
        return ids
    document, ids = _shorten(tokenizer, document, ids, max_length,
                             lambda text: _render(tokenizer, query, text))
    if len(ids) > max_length:
        _, ids = _shorten(tokenizer, query, ids, max_length,
                          lambda text: _render(tokenizer, text, ""))
    if len(ids) > max_length:
        raise ValueError(f"the reranker's template takes {len(ids)} tokens with an empty query "
                         f"and document, more than the {max_length} to truncate to")
    return ids


def _shorten(tokenizer: Any, text: str, ids: list[int], max_length: int,
             render: Callable[[str], list[int]]) -> tuple[str, list[int]]:
    """`text` cut to a prefix of its tokens, by the rendering's overshoot each time (tokens
    can merge across a cut, so the rendering is measured again), until `render(prefix)` fits
    `max_length` or nothing of `text` is left: (the prefix, its rendering)."""
    prefix = _Prefixes(tokenizer, text)
    n = prefix.count
    while len(ids) > max_length and n > 0:
        n = max(0, n - (len(ids) - max_length))
        text = prefix(n)
        ids = render(text)
    return text, ids


class _Prefixes:
    """The text of a string's first n tokens: cut at the tokenizer's character offsets where
    it has them (a fast tokenizer: the original characters kept), else decoded."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.text = text
        self.tokenizer = tokenizer
        if getattr(tokenizer, "is_fast", False):
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            self.ends = [end for _, end in encoded["offset_mapping"]]
            self.ids = None
            self.count = len(self.ends)
        else:
            self.ends = None
            self.ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            self.count = len(self.ids)

    def __call__(self, n: int) -> str:
        if n <= 0:
            return ""
        if self.ends is not None:
            return self.text[:max(self.ends[:n])]
        return self.tokenizer.decode(self.ids[:n])


def _render(tokenizer: Any, query: str, document: str, tokenize: bool = True) -> Any:
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    ids = tokenizer.apply_chat_template(messages, tokenize=tokenize,
                                        add_generation_prompt=False)
    if not tokenize:
        return ids
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5: an encoding
        ids = ids["input_ids"]
    return list(ids)


def _check_roles(tokenizer: Any) -> None:
    """Refuse a template that drops the query or the document (one written for system, user
    and assistant only): its scores would not depend on them."""
    base, query, document = (_render(tokenizer, q, d, tokenize=False) for q, d in _PROBES)
    if base == query or base == document:
        raise ValueError("the model's chat template does not render the 'query' and 'document' "
                         "roles of a pair; give a reranker whose template does "
                         "(sentence-transformers' CrossEncoder format)")
