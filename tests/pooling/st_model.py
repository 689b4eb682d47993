"""A tiny random decoder embedder saved as sentence-transformers saves Qwen3-Embedding: a bare
Qwen3Model (no head), a small word-level tokenizer that appends an end token (the token
last-token pooling reads), `modules.json`, `1_Pooling/config.json` (last token) and a
Normalize module. Nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

NUM_WORDS = 300
HIDDEN = 64


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "<eos>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(NUM_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A <eos>",
                                                       special_tokens=[("<eos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="<eos>", padding_side="right")


def tiny_qwen3_embedder(path: Path, pooling: str = "lasttoken", normalize: bool = True,
                        max_positions: int = 256, head_dim: int = 16) -> Path:
    """`head_dim`: 64 for CUDA's kernels (16 runs on the CPU's only)."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(vocab_size=NUM_WORDS + 3, hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, max_position_embeddings=max_positions,
                         initializer_range=0.2, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3Model(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
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
    # The legacy format, as Qwen3-Embedding ships it.
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")
    wanted = {"cls": "cls_token", "mean": "mean_tokens", "lasttoken": "lasttoken"}[pooling]
    pooling_config = {"word_embedding_dimension": HIDDEN, "include_prompt": True}
    pooling_config.update({f"pooling_mode_{m}": m == wanted for m in modes})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (path / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": max_positions, "do_lower_case": False}))
    return path


def mixed_texts(n: int = 32, seed: int = 0, longest: int = 90) -> list[str]:
    """`n` texts of 1 to `longest` words (plus the end token), lengths spread."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(rng.randint(1, longest)))
            for _ in range(n)]


# Renders a (query, document) pair as sentence-transformers' CrossEncoder does: one message per
# role through the chat template.
RERANK_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'query' %}w1 {{ m['content'] }}"
                   "{% elif m['role'] == 'document' %} w2 {{ m['content'] }}{% endif %}"
                   "{% endfor %} w3")


def tiny_qwen3_reranker(path: Path, max_positions: int = 256) -> Path:
    """A tiny random Qwen3ForCausalLM with "yes" and "no" tokens, saved by
    sentence-transformers' CrossEncoder itself (Transformer + LogitScore(yes, no), sigmoid)."""
    from sentence_transformers import CrossEncoder
    from transformers import Qwen3Config, Qwen3ForCausalLM

    source = path.parent / (path.name + "_source")
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["yes", "no"])
    tokenizer.chat_template = RERANK_TEMPLATE
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=max_positions,
                         initializer_range=0.2, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(source)
    tokenizer.save_pretrained(source)
    CrossEncoder(str(source), device="cpu", local_files_only=True).save(str(path))
    return path
