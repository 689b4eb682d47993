"""XLM-RoBERTa and RoBERTa encoders (bge-m3's dense output, e5-multilingual;
`XLMRobertaModel`, `RobertaModel`) and their classification heads (bge-reranker:
`XLMRobertaForSequenceClassification`): BERT's layers (bert.py) with RoBERTa's positions
(position p of a sequence reads row p + padding_idx + 1 of the table: transformers counts
non-padding tokens from padding_idx + 1) and its two-layer head over the first token."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from pagedserve.models.bert import BertEmbeddings, BertForSequenceClassification, BertModel


def usable_positions(config: PretrainedConfig) -> int:
    """Tokens a sequence may hold: the table's rows past padding_idx + 1."""
    return int(config.max_position_embeddings) - int(config.pad_token_id) - 1


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.offset = int(config.pad_token_id) + 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids, positions + self.offset)


class XLMRobertaModel(BertModel):
    base_prefix = "roberta."
    embeddings_cls = RobertaEmbeddings


class XLMRobertaForSequenceClassification(BertForSequenceClassification):
    """RoBERTa's head: out_proj(tanh(dense(h_first)))."""

    encoder_cls = XLMRobertaModel
    _HEAD = {"classifier.dense.": "pooler.", "classifier.out_proj.": "classifier."}
