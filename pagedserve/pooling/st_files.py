"""What a sentence-transformers model directory says about pooling: `modules.json` lists the
modules in order (a Transformer, then Pooling, then perhaps Normalize), and the Pooling
module's folder holds its `config.json`.

Both the old Pooling config (`pooling_mode_cls_token`, `pooling_mode_mean_tokens`,
`pooling_mode_lasttoken`, ... as booleans, `word_embedding_dimension`) and sentence-transformers
6's (`pooling_mode`, `embedding_dimension`) are read. Modules we do not run (Dense, max pooling,
several modes at once) are refused by name rather than skipped: skipping one would serve
different vectors than the model's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' mode names -> ours.
_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Modules that change nothing the engine computes (the Transformer is the model itself).
_PASSIVE = ("Transformer",)


@dataclass(frozen=True)
class SentenceTransformerPooling:
    method: str | None  # "cls" | "mean" | "last"; None: modules.json has no Pooling module
    normalize: bool
    # A causal cross-encoder's LogitScore module: (true token id, false token id or None); its
    # score is logit[true] - logit[false] at the last token, then the activation.
    score_tokens: tuple[int, int | None] | None = None
    activation: str = "sigmoid"  # "sigmoid" | "identity" (config_sentence_transformers.json)


def read_sentence_transformer(path: Path) -> SentenceTransformerPooling | None:
    """The pooling a sentence-transformers directory declares; None when it has no
    modules.json."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    method, normalize, score_tokens = None, False, None
    for entry in json.loads(modules_file.read_text()):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            method = _pooling_mode(path / entry.get("path", ""))
        elif kind == "Normalize":
            normalize = True
        elif kind == "LogitScore":
            score_tokens = _logit_score(path / entry.get("path", ""))
        elif kind not in _PASSIVE:
            raise ValueError(f"{modules_file}: the sentence-transformers module {kind!r} is not "
                             "supported (supported: Transformer, Pooling, Normalize, "
                             "LogitScore)")
    if score_tokens is not None:
        return SentenceTransformerPooling("last", False, score_tokens, _activation(path))
    return SentenceTransformerPooling(method, normalize)


def _logit_score(folder: Path) -> tuple[int, int | None]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder}: a LogitScore module without its config.json")
    config = json.loads(config_file.read_text())
    if config.get("module_input_name", "causal_logits") != "causal_logits":
        raise ValueError(f"{config_file}: LogitScore reads {config['module_input_name']!r}; only "
                         "the causal model's logits are supported")
    false_id = config.get("false_token_id")
    return int(config["true_token_id"]), None if false_id is None else int(false_id)


def _activation(path: Path) -> str:
    """A cross-encoder's activation: sentence-transformers' default for one score is the
    sigmoid; config_sentence_transformers.json may name another."""
    config_file = path / "config_sentence_transformers.json"
    name = (json.loads(config_file.read_text()).get("activation_fn")
            if config_file.is_file() else None)
    if name is None or name.endswith(".Sigmoid"):
        return "sigmoid"
    if name.endswith(".Identity"):
        return "identity"
    raise ValueError(f"{config_file}: activation_fn {name!r} is not supported (Sigmoid or "
                     "Identity)")


def _pooling_mode(folder: Path) -> str:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder}: a Pooling module without its config.json")
    config = json.loads(config_file.read_text())
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [mode for key, mode in _LEGACY_KEYS.items() if config.get(key)]
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{config_file}: include_prompt=false (instruction tokens left out of "
                         "the pooling) is not supported")
    if len(modes) != 1 or modes[0] not in _MODES:
        raise ValueError(f"{config_file}: pooling mode {modes} is not supported (supported: "
                         "one of cls, mean, lasttoken)")
    return _MODES[modes[0]]
