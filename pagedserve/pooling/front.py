"""The front's part of a pooling request: tokenizing its text as the model's
sentence-transformers setup does (with the tokenizer's special tokens: Qwen3-Embedding's
appends the end-of-text token its last-token pooling reads), checking and truncating the
prompt, and the sequence the engine core runs."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedserve.engine.core_messages import CoreRequest
from pagedserve.engine.output_processor import RequestState
from pagedserve.engine.outputs import RequestMetrics
from pagedserve.pooling.core_hooks import POOLING_SAMPLING
from pagedserve.pooling.params import (
    PoolingParams,
    check_params,
    fit_prompt,
    truncation_kwargs,
    truncation_length,
)

GENERATION_REFUSED = ("this is a pooling model (--runner pooling): it serves embeddings, "
                      "scores or classes (/v1/embeddings, /score, /rerank, /classify; "
                      "LLM.embed, LLM.score, LLM.classify), not generation")


def tokenize_inputs(tokenizer: Any, texts: list[str], max_length: int | None = None
                    ) -> list[list[int]]:
    """Token ids per text, special tokens included, in one batched call (a fast tokenizer
    encodes the batch in parallel); `max_length`: truncated by the tokenizer as
    sentence-transformers and vLLM truncate, its special tokens kept."""
    if not texts:
        return []
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids")
    backend = _plain_backend(tokenizer) if max_length is None else None
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=True)]
    truncation = truncation_kwargs(tokenizer, max_length, pair=False)
    return [list(ids) for ids in
            tokenizer(texts, add_special_tokens=True, **truncation)["input_ids"]]


def _plain_backend(tokenizer: Any) -> Any:
    """The fast tokenizer's `tokenizers` object when it neither truncates nor pads of its own
    (a tokenizer.json may save either; transformers' call switches them off): its
    `encode_batch` gives the same ids without transformers' per-text Python (the GIL held
    ~25 us a text while the engine runs). None where that does not hold."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    if getattr(backend, "truncation", 0) is not None or getattr(backend, "padding", 0) is not None:
        return None
    return backend


class ChunkedTokenizer:
    """Texts tokenized chunk by chunk on a thread (a fast tokenizer releases the GIL), so the
    engine embeds the first chunks while the rest tokenize: `LLM.embed` of 10,000 texts
    otherwise spent its first second or more tokenizing with the GPU idle."""

    chunk = 256  # texts a chunk

    def __init__(self, tokenizer: Any, texts: list[str], max_length: int | None) -> None:
        if texts and tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        n = self.chunk
        self._chunks = deque(self._pool.submit(tokenize_inputs, tokenizer, texts[i:i + n],
                                               max_length) for i in range(0, len(texts), n))

    @property
    def exhausted(self) -> bool:
        return not self._chunks

    def take(self, wait: bool) -> list[list[int]]:
        """The token ids of the chunks tokenized so far, in order (at least one chunk's when
        `wait` and any is left)."""
        ids: list[list[int]] = []
        while self._chunks and (self._chunks[0].done() or (wait and not ids)):
            ids.extend(self._chunks.popleft().result())
        return ids

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def add_pooling_request(engine: Any, request_id: str, prompt: str | list[int],
                        params: PoolingParams | None = None, arrival_time: float | None = None,
                        prompt_text: str | None = None) -> None:
    """Queue an embedding request on `engine` (an LLMEngine over a pooling model): its one
    output, a PoolingRequestOutput, comes when its prompt has run."""
    pooler = engine.pooler_config
    if pooler is None:
        raise ValueError("this model generates text: it serves no embeddings (start it with "
                         "--runner pooling for an embedding model)")
    engine._check_new_id(request_id)
    params = params or PoolingParams()
    check_params(params, pooler)
    text = prompt if isinstance(prompt, str) else prompt_text
    ids = tokenize_inputs(engine.tokenizer, [prompt],
                          truncation_length(params, engine.max_model_len))[0] \
        if isinstance(prompt, str) else list(prompt)
    vocab = engine.vocab_size
    # min/max run in C; the Python scan below only for a prompt that has a bad id
    in_range = not ids or (min(ids) >= 0 and max(ids) < vocab)
    bad = [] if in_range else [t for t in ids if not 0 <= t < vocab]
    if bad and pooler.num_token_types > 1:  # a pair's second segment rides in the ids
        from pagedserve.models.bert import TOKEN_TYPE_SHIFT

        bad = [t for t in bad if not (0 <= t & ((1 << TOKEN_TYPE_SHIFT) - 1) < vocab
                                      and t >> TOKEN_TYPE_SHIFT < pooler.num_token_types)]
    if bad:
        raise ValueError(f"input token id {bad[0]} is out of range [0, {vocab})")
    ids = fit_prompt(ids, params, engine.max_model_len,
                     engine.config.scheduler.max_num_batched_tokens)
    arrival = time.monotonic() if arrival_time is None else arrival_time
    state = RequestState(request_id, text, ids, [], RequestMetrics(arrival), stream=False)
    state.sequences = [engine.output_processor.new_sequence(request_id, 0, ids,
                                                            POOLING_SAMPLING, scoring=True)]
    engine._add(state, [CoreRequest(request_id, ids, POOLING_SAMPLING, arrival,
                                    pooling=params)])
