"""Which runner an engine is (`--runner`), and for a pooling engine how it pools: from the
flags, else the model's sentence-transformers files, else defaults.

`auto` picks pooling for a directory with sentence-transformers' `modules.json` or a bare
checkpoint (`Qwen3Model`: no language-model head), and generation otherwise. The front and the
model runner resolve it alike from the same config and files, so nothing about it crosses
between processes."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.models.registry import ENCODER_ARCHITECTURES
from pagedserve.pooling.base_models import is_base_model
from pagedserve.pooling.st_files import read_sentence_transformer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "generate", "pooling")
METHODS = ("cls", "mean", "last")
# A decoder attends causally: only its last token has seen the whole input.
DEFAULT_METHOD = "last"


@dataclass(frozen=True)
class PoolerConfig:
    method: str  # one of METHODS
    normalize: bool  # L2-normalise each embedding (after any `dimensions` truncation)
    hidden_size: int  # the embedding's full width
    source: str  # where the settings came from (for the log line)
    # A reranker (a causal cross-encoder): it scores (query, document) pairs by
    # logit[true] - logit[false] at the last token, then `activation`, instead of embedding.
    score_tokens: tuple[int, int | None] | None = None
    activation: str = "sigmoid"
    # A classifier (`*ForSequenceClassification`: an encoder and its head over the first
    # token): its labels; the step's rows are its logits. With one label it is a
    # cross-encoder: it scores pairs by activation(logit).
    num_labels: int | None = None
    labels: tuple[str, ...] = ()  # a classifier's label names (config.json's id2label)
    # Segments the model's token-type table holds (BERT's 2): ids may carry them
    # (models/bert.py `with_token_types`).
    num_token_types: int = 1

    @property
    def task(self) -> str:
        if self.score_tokens is not None:
            return "score"
        return "embed" if self.num_labels is None else "classify"

    @property
    def scores_pairs(self) -> bool:
        """Serves /score, /rerank and LLM.score: a causal reranker or a one-label
        cross-encoder."""
        return self.task == "score" or self.num_labels == 1

    def describe(self) -> str:
        if self.task == "classify":
            return (f"a classifier of {self.num_labels} labels over the first token"
                    + (f", scoring pairs by {self.activation}(logit)" if self.scores_pairs
                       else "") + f" (from {self.source})")
        if self.task == "score":
            return (f"a reranker: {self.activation}(logit[{self.score_tokens[0]}] - "
                    f"logit[{self.score_tokens[1]}]) at the last token (from {self.source})")
        name = {"cls": "first-token (CLS)", "mean": "mean", "last": "last-token"}[self.method]
        normed = "L2-normalised" if self.normalize else "not normalised"
        return f"{name} pooling, {normed}, {self.hidden_size} dimensions (from {self.source})"


def resolve_pooler(model: Any) -> PoolerConfig | None:
    """The pooling of an engine over `model` (a ModelConfig), or None for a generating
    engine."""
    runner = getattr(model, "runner", "auto")
    method, normalize = getattr(model, "pooling_type", None), getattr(model, "pooling_normalize",
                                                                       None)
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if method is not None and method not in METHODS:
        raise ValueError(f"pooling_type must be one of {', '.join(METHODS)}, got {method!r}")
    path = _model_dir(model.model)
    hf = json.loads((path / "config.json").read_text()) if path is not None and (
        path / "config.json").is_file() else {}
    st = read_sentence_transformer(path) if path is not None else None
    architectures = hf.get("architectures") or []
    encoder = any(a in ENCODER_ARCHITECTURES for a in architectures)
    if runner == "auto":
        runner = "pooling" if st is not None or encoder or is_base_model(architectures) \
            else "generate"
    if runner == "generate" and encoder:
        raise ValueError(f"{architectures[0]} is an encoder (bidirectional attention, no "
                         "language-model head): it cannot generate; serve it with --runner "
                         "pooling")
    if runner == "generate":
        if method is not None or normalize is not None:
            raise ValueError("pooling_type and pooling_normalize apply to a pooling model only: "
                             "add --runner pooling")
        return None
    source = "flags" if method is not None or normalize is not None else "the defaults"
    token_types = int(hf.get("type_vocab_size", 1) or 1) if encoder else 1
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return _classifier(hf, architectures[0], method, normalize, token_types)
    if st is not None:
        source = "the model's sentence-transformers files"
        if st.score_tokens is not None:
            if method not in (None, "last") or normalize:
                raise ValueError("a cross-encoder (LogitScore) scores the last token's logits: "
                                 "pooling_type and pooling_normalize do not apply")
            return PoolerConfig("last", False, _hidden_size(model.model, hf), source,
                                st.score_tokens, st.activation)
        method = method or st.method
        normalize = st.normalize if normalize is None else normalize
    # An encoder's first token has seen the whole input (BERT's CLS); a decoder's last one.
    default = "cls" if encoder else DEFAULT_METHOD
    return PoolerConfig(method or default, True if normalize is None else normalize,
                        _hidden_size(model.model, hf), source, num_token_types=token_types)


def _classifier(hf: dict[str, Any], architecture: str, method: str | None,
                normalize: bool | None, token_types: int) -> PoolerConfig:
    """A `*ForSequenceClassification` checkpoint: its head reads the first token. The
    activation of its pair scores is sentence-transformers' CrossEncoder's: config.json's
    `sentence_transformers.activation_fn`, else the sigmoid."""
    if method not in (None, "cls") or normalize:
        raise ValueError(f"{architecture} classifies its first token: pooling_type and "
                         "pooling_normalize do not apply")
    labels = hf.get("id2label")
    num_labels = int(hf.get("num_labels", len(labels) if labels else 2))
    name = (hf.get("sentence_transformers") or {}).get("activation_fn")
    if name is None or name.endswith(".Sigmoid"):
        activation = "sigmoid"
    elif name.endswith(".Identity"):
        activation = "identity"
    else:
        raise ValueError(f"activation_fn {name!r} is not supported (Sigmoid or Identity)")
    names = {str(k): str(v) for k, v in (labels or {}).items()}
    return PoolerConfig("cls", False, int(hf["hidden_size"]), "the checkpoint's classifier",
                        activation=activation, num_labels=num_labels,
                        labels=tuple(names.get(str(i), f"LABEL_{i}") for i in range(num_labels)),
                        num_token_types=token_types)


POOLING_CUDA_STEP_TOKENS = 16384


def default_step_tokens(model: Any, device: torch.device, default: int) -> int:
    """The default max_num_batched_tokens for the engine of `model` (a ModelConfig) on
    `device`: a pooling model's on CUDA holds max(16384, its context) tokens, so that any
    input fits its one step and steps are large enough to keep the GPU busy; `default`
    otherwise (on the CPU a longer input is refused with the flag to raise: the CPU's encoder
    attention holds a [L, L] score grid per head). A settings error is left to the checks
    that report it."""
    try:
        pooling = resolve_pooler(model) is not None
    except (ValueError, OSError):
        pooling = False
    if not pooling or device.type != "cuda":
        return default
    context = getattr(model, "max_model_len", None)
    if context is None and (path := _model_dir(model.model)) is not None:
        try:
            context = json.loads((path / "config.json").read_text()).get(
                "max_position_embeddings")
        except (OSError, ValueError):
            context = None
    return max(POOLING_CUDA_STEP_TOKENS, int(context or 0))


def _model_dir(model: str | None) -> Path | None:
    if model is None or model.startswith("random:"):
        return None
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def _hidden_size(model: str | None, hf: dict[str, Any]) -> int:
    if "hidden_size" in hf:
        return int(hf["hidden_size"])
    if model is not None and model.startswith("random:"):
        from pagedserve.models.random_models import random_model_config

        return int(random_model_config(model[len("random:"):]).hidden_size)
    name = repr(model) if model is not None else "the bundled SmolLM2 .gguf"
    raise ValueError(f"model {name}: a pooling model must be a Hugging Face directory with "
                     "a config.json (or random:<preset>)")
