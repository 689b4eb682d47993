"""ModernBERT encoders (`ModernBertModel`; gte-modernbert, nomic-modernbert embedders) and
their classification head (`ModernBertForSequenceClassification`), served as pooling models.

Pre-norm layers (the first without its attention norm), a fused Wqkv, rotary positions with a
theta per layer kind, and alternating attention: every `global_attn_every_n_layers`-th layer
(`layer_types`: full_attention) sees the whole input, the others (sliding_attention) the keys
within `sliding_window` (local_attention // 2) positions on either side, which is an
encoder-only layer's two-sided window of sliding_window + 1 (attention/encoder.py). GLU MLP:
Wo(act(x W_in) * x W_gate). No KV cache, one pass per request, as every encoder.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.encoder import ENCODER_ONLY
from pagedserve.attention.layer import Attention
from pagedserve.models.bert import EncoderClassifier, activation
from pagedserve.models.layers import RotaryEmbedding, build_rope_caches


def _norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


def _act(config: PretrainedConfig, name: str):
    return activation(type("Act", (), {"hidden_act": name})())


class ModernBertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        head_dim = h // heads
        kind = config.layer_types[layer_idx]
        window = config.sliding_window + 1 if kind == "sliding_attention" else None
        self.attn_norm = nn.Identity() if layer_idx == 0 else _norm(config)
        self.Wqkv = nn.Linear(h, 3 * h, bias=config.attention_bias)
        self.rotary = RotaryEmbedding(config, head_dim, kind)
        self.attn = Attention(heads, head_dim, head_dim ** -0.5, heads, layer_idx,
                              sliding_window=window, attn_type=ENCODER_ONLY)
        self.attn_out = nn.Linear(h, h, bias=config.attention_bias)
        self.mlp_norm = _norm(config)
        self.Wi = nn.Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.mlp_out = nn.Linear(config.intermediate_size, h, bias=config.mlp_bias)
        self.act = _act(config, config.hidden_activation)
        self.heads, self.head_dim = heads, head_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.Wqkv(self.attn_norm(x)).chunk(3, dim=-1)
        q, k = self.rotary(positions, q.reshape(t, self.heads, self.head_dim),
                           k.reshape(t, self.heads, self.head_dim))
        x = x + self.attn_out(self.attn(q.reshape(t, -1), k.reshape(t, -1), v))
        up, gate = self.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp_out(self.act(up) * gate)


class ModernBertModel(nn.Module):
    base_prefix = "model."

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = _norm(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.tok_embeddings(input_ids))
        for layer in self.layers:
            x = layer(x, positions)
        return self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no language-model head")

    _RENAMES = {"embeddings.tok_embeddings.": "tok_embeddings.",
                "embeddings.norm.": "embed_norm."}
    _LAYER = {"attn.Wqkv.": "Wqkv.", "attn.Wo.": "attn_out.", "mlp.Wi.": "Wi.",
              "mlp.Wo.": "mlp_out.", "attn_norm.": "attn_norm.", "mlp_norm.": "mlp_norm."}

    def _our_name(self, name: str) -> str:
        name = name.removeprefix(self.base_prefix)
        for old, new in self._RENAMES.items():
            if name.startswith(old):
                return new + name[len(old):]
        if name.startswith("layers."):
            index, _, rest = name[len("layers."):].partition(".")
            for old, new in self._LAYER.items():
                if rest.startswith(old):
                    return f"layers.{index}.{new}{rest[len(old):]}"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            target = self._our_name(name)
            if target not in params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            if tuple(params[target].shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(params[target].shape)}")
            params[target].data.copy_(tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        emb = self.tok_embeddings.weight
        build_rope_caches(self, emb.device, emb.dtype)  # to_empty left the tables unset


class ModernBertForSequenceClassification(EncoderClassifier):
    """The encoder and ModernBERT's head over the first token: classifier(norm(act(dense)))."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if getattr(config, "classifier_pooling", "cls") != "cls":
            raise ValueError(f"classifier_pooling {config.classifier_pooling!r} is not "
                             "supported (cls only)")
        self.config = config
        self.encoder = ModernBertModel(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size,
                               bias=config.classifier_bias)
        self.head_norm = _norm(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.head_act = _act(config, config.classifier_activation)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, positions)

    def classify(self, first_token: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head_norm(self.head_act(self.dense(first_token)))).float()

    _HEAD = {"head.dense.": "dense.", "head.norm.": "head_norm.", "classifier.": "classifier."}
