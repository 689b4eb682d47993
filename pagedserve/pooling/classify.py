"""Classifiers and encoder cross-encoders (`*ForSequenceClassification`): the step's rows are
the head's logits over each request's first token (pooling/step.py); here they become what
`LLM.classify()` and `POST /classify` return (probabilities: softmax over the labels, the
sigmoid for a single label, as vLLM does) and a cross-encoder's pair score (one label:
activation(logit), sentence-transformers' CrossEncoder's sigmoid unless its config names
Identity). A pair is tokenized as CrossEncoder does, by the tokenizer's pair template (BERT's
segments folded into the ids: models/bert.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.models.bert import with_token_types
from pagedserve.pooling.config import PoolerConfig
from pagedserve.pooling.outputs import PoolingRequestOutput
from pagedserve.pooling.params import truncation_kwargs


@dataclass
class ClassificationOutput:
    logits: np.ndarray  # float32 [num_labels]
    probs: np.ndarray  # float32 [num_labels]

    @property
    def num_classes(self) -> int:
        return len(self.logits)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


def probabilities(logits: np.ndarray) -> np.ndarray:
    """Softmax over the labels (the last axis); the sigmoid for one label."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.shape[-1] == 1:
        return (1 / (1 + np.exp(-logits))).astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)


def classification_output(output: PoolingRequestOutput) -> ClassificationRequestOutput:
    logits = output.outputs.data
    return ClassificationRequestOutput(output.request_id, output.prompt,
                                       output.prompt_token_ids,
                                       ClassificationOutput(logits, probabilities(logits)))


def pair_score(row: np.ndarray, pooler: PoolerConfig) -> float:
    """A one-label cross-encoder's relevance from its logit row."""
    logit = float(row[0])
    return float(1 / (1 + np.exp(-logit))) if pooler.activation == "sigmoid" else logit


def encoder_pair_ids(tokenizer: Any, pairs: list[tuple[str, str]], pooler: PoolerConfig,
                     max_length: int | None = None) -> list[list[int]]:
    """Each (query, document) through the tokenizer's pair template, in one batched call;
    segments folded into the ids where the model has a token-type table. `max_length`: the
    longer text truncated first, both segments' special tokens kept (CrossEncoder's way)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer to encode (query, document) pairs with")
    if not pairs:
        return []
    truncation = truncation_kwargs(tokenizer, max_length, pair=True)
    encoded = tokenizer([q for q, _ in pairs], [d for _, d in pairs], add_special_tokens=True,
                        **truncation)
    types = encoded.get("token_type_ids")
    if types is None or pooler.num_token_types < 2:
        return [list(ids) for ids in encoded["input_ids"]]
    return [with_token_types(list(ids), list(t))
            for ids, t in zip(encoded["input_ids"], types, strict=True)]
