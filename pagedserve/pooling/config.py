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
from typing import Any

from pagedserve.pooling.base_models import is_base_model
from pagedserve.pooling.st_files import read_sentence_transformer

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

    @property
    def task(self) -> str:
        return "score" if self.score_tokens is not None else "embed"

    def describe(self) -> str:
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
    if runner == "auto":
        runner = "pooling" if st is not None or is_base_model(hf.get("architectures")) \
            else "generate"
    if runner == "generate":
        if method is not None or normalize is not None:
            raise ValueError("pooling_type and pooling_normalize apply to a pooling model only: "
                             "add --runner pooling")
        return None
    source = "flags"
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
    return PoolerConfig(method or DEFAULT_METHOD, True if normalize is None else normalize,
                        _hidden_size(model.model, hf), source)


def _model_dir(model: str | None) -> Path | None:
    if model is None or model.startswith("random:"):
        return None
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def _hidden_size(model: str | None, hf: dict[str, Any]) -> int:
    if "hidden_size" in hf:
        return int(hf["hidden_size"])
    if model is not None and model.startswith("random:"):
        from pagedserve.models.loader import random_model_config

        return int(random_model_config(model[len("random:"):]).hidden_size)
    raise ValueError(f"model {model!r}: a pooling model must be a Hugging Face directory with "
                     "a config.json (or random:<preset>)")
