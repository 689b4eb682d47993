"""Tiny random BERT and XLM-RoBERTa encoders saved as sentence-transformers saves them
(`modules.json`, `1_Pooling/config.json`, perhaps Normalize), their
`*ForSequenceClassification` cross-encoders, and word-level tokenizers with each family's
special tokens and pair template (BERT's token types). Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.pooling.st_model import NUM_WORDS

HIDDEN = 64


def tiny_encoder_tokenizer(family: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if family in ("bert", "modernbert"):
        specials = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
        cls, sep, pad, unk = "[CLS]", "[SEP]", "[PAD]", "[UNK]"
        post = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, 2), (sep, 3)])
    else:  # RoBERTa's: <s> A </s></s> B </s>, one segment
        specials = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        cls, sep, pad, unk = "<s>", "</s>", "<pad>", "<unk>"
        post = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} {sep} $B {sep}",
            special_tokens=[(cls, 0), (sep, 2)])
    vocab = dict(specials)
    vocab.update({f"w{i}": i + 4 for i in range(NUM_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = post
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token=unk,
                                   cls_token=cls, sep_token=sep, padding_side="right",
                                   model_input_names=["input_ids", "token_type_ids",
                                                      "attention_mask"]
                                   if family == "bert" else ["input_ids", "attention_mask"])


def encoder_config(family: str, max_positions: int = 128, num_labels: int | None = None,
                   heads: int = 4):
    from transformers import BertConfig, ModernBertConfig, XLMRobertaConfig

    common = dict(vocab_size=NUM_WORDS + 4, hidden_size=HIDDEN, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=heads, initializer_range=0.2,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if num_labels is not None:
        common["num_labels"] = num_labels
    if family == "modernbert":  # alternating global / local (window of 2 x 8 + 1) layers
        common.pop("hidden_dropout_prob"), common.pop("attention_probs_dropout_prob")
        return ModernBertConfig(max_position_embeddings=max_positions, pad_token_id=0,
                                num_hidden_layers=3, global_attn_every_n_layers=2,
                                local_attention=16, cls_token_id=2, sep_token_id=3,
                                bos_token_id=2, eos_token_id=3,
                                **{k: v for k, v in common.items() if k != "num_hidden_layers"})
    if family == "bert":
        return BertConfig(max_position_embeddings=max_positions, type_vocab_size=2,
                          pad_token_id=0, **common)
    return XLMRobertaConfig(max_position_embeddings=max_positions + 2, type_vocab_size=1,
                            pad_token_id=1, bos_token_id=0, eos_token_id=2, **common)


def tiny_encoder_embedder(path: Path, family: str, pooling: str = "cls",
                          normalize: bool = True, heads: int = 4) -> Path:
    from transformers import BertModel, ModernBertModel, XLMRobertaModel

    config = encoder_config(family, heads=heads)
    torch.manual_seed(0)
    model = {"bert": BertModel, "xlm-roberta": XLMRobertaModel,
             "modernbert": ModernBertModel}[family](config)
    model.save_pretrained(path)
    tiny_encoder_tokenizer(family).save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir()
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    wanted = {"cls": "cls_token", "mean": "mean_tokens"}[pooling]
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
    pooling_config = {"word_embedding_dimension": HIDDEN}
    pooling_config.update({f"pooling_mode_{m}": m == wanted for m in modes})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (path / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": 128, "do_lower_case": False}))
    return path


def tiny_cross_encoder(path: Path, family: str, num_labels: int = 1, heads: int = 4) -> Path:
    """A random `*ForSequenceClassification` with its tokenizer (what CrossEncoder loads)."""
    from transformers import (
        BertForSequenceClassification,
        ModernBertForSequenceClassification,
        XLMRobertaForSequenceClassification,
    )

    config = encoder_config(family, num_labels=num_labels, heads=heads)
    torch.manual_seed(1)
    cls = {"bert": BertForSequenceClassification,
           "xlm-roberta": XLMRobertaForSequenceClassification,
           "modernbert": ModernBertForSequenceClassification}[family]
    cls(config).save_pretrained(path)
    tiny_encoder_tokenizer(family).save_pretrained(path)
    return path
