"""BERT encoders (bge, e5, all-MiniLM; `BertModel`) and their sequence-classification heads
(cross-encoders: `BertForSequenceClassification`), served as pooling models.

Every attention layer is encoder-only (attention/encoder.py): bidirectional over the request's
own tokens, no KV cache; a request runs whole in one step. Post-norm layers as transformers'
BertLayer: x = LN(x + attn(x)); x = LN(x + W2 act(W1 x)). Embeddings: word + absolute position
+ token type, then LayerNorm.

Token types ride in the input ids: a token of segment s is `id + s << TOKEN_TYPE_SHIFT`
(`with_token_types`), so a cross-encoder's (query, document) pair needs no input beside its
ids; ids of a single text carry segment 0 and are unchanged. RoBERTa-like families
(xlm_roberta.py) subclass this one and change the positions and the head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve import envs
from pagedserve.attention.encoder import ENCODER_ONLY
from pagedserve.attention.layer import Attention

TOKEN_TYPE_SHIFT = 30
_ID_MASK = (1 << TOKEN_TYPE_SHIFT) - 1
_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def with_token_types(ids: list[int], token_types: list[int]) -> list[int]:
    """Ids with their segment folded in (see the module docstring)."""
    return [i + (t << TOKEN_TYPE_SHIFT) for i, t in zip(ids, token_types, strict=True)]


def activation(config: PretrainedConfig):
    name = getattr(config, "hidden_act", "gelu")
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: "
                         f"{', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


# cuBLASLt's GELU epilogue (torch._addmm_activation) is the tanh form: the same function for
# these, an approximation of the erf form ("gelu") within 4.8e-4.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
_FUSED_DTYPES = (torch.float16, torch.bfloat16)


def gelu_in_epilogue(config: PretrainedConfig) -> bool:
    """Whether the MLP's GELU runs inside its first projection's GEMM (CUDA, 16 bits), which
    saves a pass over the [T, intermediate] activations (~11% of the kernels' time in a bge-base
    step of 64 x 256 tokens on an H100). It applies GELU to the float32 sums, before the one
    rounding to 16 bits (eager rounds the GEMM's output, then GELU's). Its GELU is the tanh
    form, which is the model's own for `gelu_new` / `gelu_pytorch_tanh`. An erf-GELU model
    (`gelu`, bge's and e5's) keeps its GELU unfused unless PAGEDSERVE_APPROXIMATE_GELU=1: the
    tanh form moves a 16-bit value by at most one rounding step (in bf16, ~16% of values of a
    N(0, 1.5) spread), the size of the rounding the GEMM's output carries anyway, but it is not
    the model's function, so it is asked for, not assumed."""
    name = getattr(config, "hidden_act", "gelu")
    return name in _TANH_GELU or (name == "gelu" and envs.PAGEDSERVE_APPROXIMATE_GELU)


def epilogue_runs(x: torch.Tensor) -> bool:
    """Whether a GEMM over `x` takes the GELU epilogue (CUDA, 16 bits, rows of a step)."""
    return x.is_cuda and x.dtype in _FUSED_DTYPES and x.dim() == 2


def check_encoder_config(config: PretrainedConfig) -> None:
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"position_embedding_type {kind!r} is not supported (absolute only)")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("a BERT-style decoder (is_decoder / cross-attention) is not supported: "
                         "only encoders are served")


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids = input_ids & _ID_MASK
        token_types = input_ids >> TOKEN_TYPE_SHIFT
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_types))
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.head_size = h // heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn = Attention(heads, self.head_size, self.head_size ** -0.5, heads, layer_idx,
                              attn_type=ENCODER_ONLY)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(h, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.act = activation(config)
        self.gelu_epilogue = gelu_in_epilogue(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = self.attn_norm(x + self.attn_out(self.attn(q, k, v)))
        return self.out_norm(x + self.output(self.mlp_in(x)))

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        """act(W1 x + b1); on CUDA in 16 bits a GELU rides in the GEMM's epilogue
        (`gelu_in_epilogue`)."""
        w1 = self.intermediate
        if self.gelu_epilogue and w1.bias is not None and epilogue_runs(x):
            return torch._addmm_activation(w1.bias, x, w1.weight.t(), use_gelu=True)
        return self.act(w1(x))


class BertModel(nn.Module):
    """The encoder: (input ids with token types, positions) -> last hidden states [T, H]."""

    # Checkpoint prefix of the encoder inside a *ForSequenceClassification checkpoint.
    base_prefix = "bert."
    embeddings_cls = BertEmbeddings

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_encoder_config(config)
        self.config = config
        self.embeddings = self.embeddings_cls(config)
        self.layers = nn.ModuleList(BertLayer(config, i)
                                    for i in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no language-model head")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (bare, or under the classifier's `bert.` / `roberta.`); q, k
        and v go into the fused projection. Every parameter must be given."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, rows = self._our_name(name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            param = params[target]
            dst = param.data if rows is None else param.data[rows]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if rows is None else f"{target}[{rows.start}]")
        expected = {n for n in params if ".qkv." not in n}
        expected |= {f"{n}[{i * self.config.hidden_size}]" for n in params if ".qkv." in n
                     for i in range(3)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    _PARTS = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}
    _RENAMES = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                "intermediate.dense": "intermediate", "output.dense": "output",
                "output.LayerNorm": "out_norm"}
    # Tensors the served model does not use (BertModel's own pooler: sentence-transformers
    # pools the last hidden states; position ids buffers).
    _SKIPPED = ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")

    def _our_name(self, name: str) -> tuple[str | None, slice | None]:
        name = name.removeprefix(self.base_prefix)
        if name.startswith(self._SKIPPED):
            return None, None
        if not name.startswith("encoder.layer."):
            return name, None
        index, _, rest = name[len("encoder.layer."):].partition(".")
        module, _, leaf = rest.rpartition(".")
        h = self.config.hidden_size
        if module in self._PARTS:
            part = self._PARTS[module]
            return f"layers.{index}.qkv.{leaf}", slice(part * h, (part + 1) * h)
        if module in self._RENAMES:
            return f"layers.{index}.{self._RENAMES[module]}.{leaf}", None
        return name, None


class EncoderClassifier(nn.Module):
    """A classification head over an `encoder`: the head's tensors (checkpoint prefixes in
    `_HEAD`, mapped onto this module's names) load here, the rest through the encoder."""

    _HEAD: dict[str, str] = {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no language-model head")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        head: set[str] = set()

        def encoder_part() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                prefix = next((p for p in self._HEAD if name.startswith(p)), None)
                if prefix is None:
                    yield name, tensor
                    continue
                target = self._HEAD[prefix] + name[len(prefix):]
                params[target].data.copy_(tensor)
                head.add(target)

        self.encoder.load_weights(encoder_part())
        missing = sorted(n for n in params if not n.startswith("encoder.") and n not in head)
        if missing:
            raise ValueError(f"checkpoint is missing the classifier's tensors {missing}")


class BertForSequenceClassification(EncoderClassifier):
    """The encoder and BERT's classifier: tanh(W_pool h_CLS) -> W_cls (num_labels logits)."""

    encoder_cls = BertModel

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = self.encoder_cls(config)
        self.num_labels = config.num_labels
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, positions)

    def classify(self, first_token: torch.Tensor) -> torch.Tensor:
        """Each request's first-token hidden state [B, H] -> logits [B, num_labels] float32."""
        return self.classifier(torch.tanh(self.pooler(first_token))).float()

    _HEAD = {"bert.pooler.dense.": "pooler.", "classifier.": "classifier."}
