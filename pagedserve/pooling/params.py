"""A pooling request's own settings, and the checks and truncation its prompt gets in the
front before it reaches the engine core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.pooling.config import PoolerConfig


@dataclass
class PoolingParams:
    # Matryoshka truncation: the embedding's first `dimensions` values (renormalised when the
    # model normalises). None: all of them.
    dimensions: int | None = None
    # At most k tokens (k = -1: the model's context length), as vLLM truncates: text through
    # the tokenizer (its truncation side, special tokens kept: an encoder's CLS, a pair's both
    # segments), a templated reranker pair by its document's end then its query's (the
    # template and the query kept), token ids to their last k; None: a prompt over the
    # context length is refused.
    truncate_prompt_tokens: int | None = None


def check_params(params: PoolingParams, pooler: PoolerConfig) -> None:
    d = params.dimensions
    if d is not None and pooler.task != "embed":
        raise ValueError(f"dimensions applies to embeddings; this model is a "
                         f"{'reranker' if pooler.task == 'score' else 'classifier'}")
    if d is not None and not 1 <= d <= pooler.hidden_size:
        raise ValueError(f"dimensions must be between 1 and the model's embedding size "
                         f"{pooler.hidden_size}, got {d}")
    k = params.truncate_prompt_tokens
    if k is not None and k != -1 and k < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 (the context length) or >= 1, "
                         f"got {k}")


def truncation_length(params: PoolingParams | None, max_model_len: int) -> int | None:
    """The most tokens `params` keeps of a prompt; None: no truncation (or a value
    check_params refuses)."""
    k = None if params is None else params.truncate_prompt_tokens
    if k == -1:
        return max_model_len
    return k if k is not None and k >= 1 else None


def truncation_kwargs(tokenizer: Any, max_length: int | None, pair: bool) -> dict[str, Any]:
    """The tokenizer's arguments for truncating to `max_length` tokens, special tokens kept;
    a limit below the special tokens alone is refused (the tokenizer would log an error and
    not truncate at all, and the last-k fallback would drop the CLS token)."""
    if max_length is None:
        return {}
    special = tokenizer.num_special_tokens_to_add(pair=pair)
    if max_length <= special:
        raise ValueError(f"truncate_prompt_tokens {max_length} leaves no room for text: the "
                         f"tokenizer adds {special} special tokens to "
                         f"{'a pair' if pair else 'an input'}")
    return {"truncation": True, "max_length": max_length}


def fit_prompt(token_ids: list[int], params: PoolingParams, max_model_len: int,
               max_num_batched_tokens: int) -> list[int]:
    """The prompt truncated as asked, or a clear error when it does not fit: a pooling
    request runs its whole prompt in one step, so it must fit the context length and the
    step's token budget."""
    k = truncation_length(params, max_model_len)
    if k is not None:
        token_ids = token_ids[-k:]
    n = len(token_ids)
    if not n:
        raise ValueError("the input is empty")
    if n > max_model_len:
        raise ValueError(f"this model's maximum context length is {max_model_len} tokens, but "
                         f"the input has {n} tokens: shorten it or set truncate_prompt_tokens")
    if n > max_num_batched_tokens:
        raise ValueError(f"the input has {n} tokens, more than max_num_batched_tokens="
                         f"{max_num_batched_tokens} (a pooling request runs in one step): "
                         "shorten it, set truncate_prompt_tokens, or raise "
                         "--max-num-batched-tokens")
    return token_ids
