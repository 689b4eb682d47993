"""`--speculative-config`: vLLM's JSON object of speculative decoding settings, checked once.

The fields and their meaning are vLLM's: `method` (ngram, draft_model, eagle, eagle3, mtp;
deepseek_mtp and qwen3_next_mtp read as mtp),
`model` (the draft or head), `num_speculative_tokens` (K, drafts per step),
`prompt_lookup_min` / `prompt_lookup_max` (n-gram sizes), `draft_tensor_parallel_size` (the
target's, or 1 for a draft model whole on every rank),
`disable_by_batch_size` (no drafts while this many requests run: at a large batch a step is
bound by its compute, not by reading the weights, and verifying drafts costs more than it
saves; the steps overlap again under async scheduling), and
the testing-only `rejection_sample_method: "synthetic"` with `synthetic_acceptance_rate`
(drafts accepted at that rate per position, whatever the target says: a way to time a draft or
head of random weights at a chosen acceptance length; the output is not the target's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# Methods whose proposer exists (all of them now; the check stays for new ones).
IMPLEMENTED = METHODS
# Under tensor parallelism every rank verifies the same drafts (the scheduler's, sent each
# step) and runs a draft model, EAGLE head or Qwen3-Next MTP block split like the target
# (DeepSeek's MTP layer, whose target does not split, is refused where it loads: mtp_head.py).
# The refusal below stays for a method that cannot split.
TP_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
SINGLE_RANK_METHODS = tuple(m for m in METHODS if m not in TP_METHODS)
REJECTION_METHODS = ("strict", "synthetic")
# vLLM's per-model names of `mtp` for the targets we run it over (Qwen3-Next's model card
# gives qwen3_next_mtp); vLLM reads them as mtp too.
MTP_ALIASES = ("deepseek_mtp", "qwen3_next_mtp")
# vLLM's defaults for n-gram sizes when neither is given.
DEFAULT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_tensor_parallel_size: int | None = None
    disable_by_batch_size: int | None = None
    rejection_sample_method: str = "strict"
    synthetic_acceptance_rate: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not one of "
                             f"{', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer "
                             f">= 1, got {k!r}")
        if self.method == "ngram":
            self._check_lookup()
            if self.model is not None:
                raise ValueError("speculative_config: method 'ngram' looks drafts up in the "
                                 "sequence itself and takes no model; drop 'model'")
        elif self.model is None and self.method != "mtp":
            raise ValueError(f"speculative_config: method {self.method!r} needs 'model' (the "
                             "draft model or head)")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                                  or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer "
                             f">= 1, got {limit!r}")
        tp = self.draft_tensor_parallel_size
        if tp is not None and (not isinstance(tp, int) or tp < 1):
            raise ValueError(f"speculative_config: draft_tensor_parallel_size must be an "
                             f"integer >= 1, got {tp!r}")
        self._check_rejection()

    def _check_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got "
                                 f"{value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min {lo} is above "
                             f"prompt_lookup_max {hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def _check_rejection(self) -> None:
        if self.rejection_sample_method not in REJECTION_METHODS:
            raise ValueError(f"speculative_config: rejection_sample_method "
                             f"{self.rejection_sample_method!r} is not one of "
                             f"{', '.join(REJECTION_METHODS)}")
        rate = self.synthetic_acceptance_rate
        if self.rejection_sample_method == "synthetic":
            if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 <= rate <= 1:
                raise ValueError("speculative_config: rejection_sample_method 'synthetic' needs "
                                 f"synthetic_acceptance_rate in [0, 1], got {rate!r}")
        elif rate is not None:
            raise ValueError("speculative_config: synthetic_acceptance_rate applies only to "
                             "rejection_sample_method 'synthetic'")

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"


def parse_speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None
                             ) -> SpeculativeConfig | None:
    """A JSON string (the flag), a dict (LLM(...), YAML) or a config -> SpeculativeConfig."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(known))})")
    if "method" not in value and isinstance(value.get("model"), str):
        value = {**value, "method": method_of_model(value["model"])}
    if value.get("method") in MTP_ALIASES:
        value = {**value, "method": "mtp"}
    for name in ("method", "num_speculative_tokens"):
        if name not in value:
            raise ValueError(f"speculative_config needs {name!r}")
    return SpeculativeConfig(**value)


def method_of_model(model: str) -> str:
    """vLLM's reading of a `model` given without a `method`: an EAGLE head by its name
    (EAGLE3-..., EAGLE-...), else a draft model."""
    name = model.rstrip("/").rpartition("/")[2].lower()
    if "eagle3" in name:
        return "eagle3"
    return "eagle" if "eagle" in name else "draft_model"


def check_model_path(spec: SpeculativeConfig) -> None:
    """The draft model or head is a local directory or .gguf file (or a `random:` preset):
    said with the flags, not after the target has loaded."""
    if spec.model is None or spec.model.startswith("random:"):
        return
    from pagedserve.models.loader import model_path

    try:
        model_path(spec.model)
    except ValueError as exc:
        raise ValueError(f"speculative_config: {exc}") from None


def check_supported(spec: SpeculativeConfig, *, tensor_parallel_size: int) -> None:
    """Refuse at start-up, with the reason, what this engine cannot run. (Every method runs
    over a target with state layers: verify steps keep each draft position's state,
    attention/state_verify.py; what a proposer cannot use of a target, a draft model with state
    layers or a decoder an EAGLE head cannot tap, its proposer refuses by name.)"""
    if spec.method not in IMPLEMENTED:
        raise ValueError(f"speculative_config: method {spec.method!r} is not implemented yet "
                         f"(implemented: {', '.join(IMPLEMENTED)})")
    if tensor_parallel_size > 1 and spec.method in SINGLE_RANK_METHODS:
        raise ValueError(f"speculative_config: method {spec.method!r} with "
                         f"tensor_parallel_size {tensor_parallel_size} is not implemented yet "
                         f"(under tensor parallelism: {', '.join(TP_METHODS)})")
    # A draft model also runs whole on every rank (1); a head splits like the target only
    # (n-gram has nothing to split).
    draft_tp = spec.draft_tensor_parallel_size
    allowed = (None, tensor_parallel_size) + ((1,) if spec.method in ("draft_model", "ngram")
                                              else ())
    if draft_tp not in allowed:
        raise ValueError(f"speculative_config: draft_tensor_parallel_size {draft_tp} with "
                         f"method {spec.method!r} and tensor_parallel_size "
                         f"{tensor_parallel_size} is not implemented yet (the target's size"
                         + {"draft_model": ", or 1 for a whole draft on every rank)",
                            "ngram": ", or 1)"}.get(spec.method, ")"))
