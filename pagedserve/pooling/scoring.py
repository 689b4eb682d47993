"""Rerankers: a causal cross-encoder (sentence-transformers' Transformer + LogitScore, the form
Qwen3-Reranker is served in) scores a (query, document) pair. The pair is rendered as
sentence-transformers renders it: the tokenizer's chat template over two messages of roles
`query` and `document`, no generation prompt; the score is the step pooler's
(`methods.logit_score`). `LLM.score()` and `/score`, `/rerank`, `/v1/rerank` use this."""

from __future__ import annotations

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
    `max_length` there as CrossEncoder truncates (a rendered template is truncated later, to
    its last tokens)."""
    if pooler is not None and pooler.task == "classify":
        from pagedserve.pooling.classify import encoder_pair_ids

        return encoder_pair_ids(tokenizer, pairs, pooler, max_length)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this reranker has no chat template to render (query, document) "
                         "pairs with")
    _check_roles(tokenizer)
    return [_render(tokenizer, query, document) for query, document in pairs]


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
