"""Per-request sampling parameters (vLLM-compatible names and defaults)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from pagedserve.config import setting

# Temperatures below this are treated as greedy: dividing logits by a near-zero value
# overflows float32 and the result is argmax anyway.
SAMPLING_EPS = 1e-5
MAX_SEED = 2**64 - 1


def _bad(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{name} must be {rule}, got {value!r}")


# OpenAI's range for a logit bias.
MAX_LOGIT_BIAS = 100.0

# Set while the engine core decodes the front's requests: msgspec runs __post_init__ on every
# dataclass it decodes, and parsing a JSON schema again (jsonschema's check and xgrammar's
# conversion, ~1.7 ms for a schema of a few objects) held the core's GIL for ~110 ms per 64
# guided requests, which the front had parsed already.
_SPEC_PARSED_BY_SENDER: ContextVar[bool] = ContextVar("spec_parsed_by_sender", default=False)


@contextmanager
def specs_parsed_by_sender() -> Iterator[None]:
    """GuidedDecodingParams made in this context only compute their key: their sender parsed
    them."""
    token = _SPEC_PARSED_BY_SENDER.set(True)
    try:
        yield
    finally:
        _SPEC_PARSED_BY_SENDER.reset(token)


@dataclass
class GuidedDecodingParams:
    """Constrain a request's output to a grammar: exactly one of a JSON schema (`json`, a dict
    or its JSON text), a `regex`, a `choice` of strings, an EBNF `grammar` (xgrammar's
    dialect, rule `root`), or `json_object` (any JSON object). Parsed when made: a bad schema,
    regex or grammar raises ValueError saying what is wrong. JSON from a schema is compact
    (`", "` and `": "` between items) unless `any_whitespace`."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        from pagedserve.structured_output.grammar import grammar_key, parse_grammar

        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("guided_decoding needs exactly one of json, regex, choice, grammar "
                             f"or json_object, got {', '.join(given) or 'none'}")
        self._kind = kind = given[0]
        value = getattr(self, kind)
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise _bad(f"guided_decoding.{kind}", value, "a non-empty string")
        if kind == "choice":
            if (not isinstance(value, list | tuple) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise _bad("guided_decoding.choice", value, "a non-empty list of non-empty "
                                                            "strings")
            self.choice = list(value)
        if kind == "json_object" and value is not True:
            raise _bad("guided_decoding.json_object", value, "true")
        if kind == "json" and not isinstance(value, str | dict):
            raise _bad("guided_decoding.json", value, "a JSON schema (an object or its text)")
        try:
            self._key = grammar_key(kind, getattr(self, kind), self.any_whitespace)
            if not _SPEC_PARSED_BY_SENDER.get():
                parse_grammar(self._key)
        except ValueError as exc:
            raise ValueError(f"guided_decoding.{kind}: {exc}") from None

    @property
    def kind(self) -> str:
        """json, regex, choice, grammar or json_object."""
        return self._kind

    @property
    def key(self) -> tuple[str, str]:
        """The spec's cache key: its kind and canonical text."""
        return self._key


@dataclass
class SamplingParams:
    n: int = setting(1, "sequences to generate for the prompt")
    temperature: float = setting(1.0, "sampling temperature; 0 is greedy")
    top_p: float = setting(1.0, "nucleus sampling: the smallest set of tokens whose "
                                "probability reaches top_p")
    top_k: int = setting(0, "sample among the k most likely tokens; 0 or -1: all")
    min_p: float = setting(0.0, "drop tokens less likely than min_p times the most likely")
    seed: int | None = setting(None, "seed of this request's sampling", flag_name="sample-seed")
    presence_penalty: float = setting(0.0, "penalty for a token that has appeared, in [-2, 2]")
    frequency_penalty: float = setting(0.0, "penalty per appearance of a token, in [-2, 2]")
    repetition_penalty: float = setting(1.0, "divide the logits of tokens already seen (>1 "
                                             "discourages repeats)")
    max_tokens: int | None = setting(16, "most tokens to generate")
    min_tokens: int = setting(0, "generate at least this many tokens before EOS or a stop id")
    stop: str | list[str] | None = setting(None, "stop strings (not included in the output)",
                                           nargs="+")
    stop_token_ids: list[int] | None = setting(None, "token ids that end the sequence")
    ignore_eos: bool = setting(False, "keep generating past EOS")
    logprobs: int | None = setting(None, "log-probabilities of the top N alternatives per "
                                         "token; 0 = the sampled token only")
    prompt_logprobs: int | None = setting(None, "log-probabilities of the prompt tokens")
    skip_special_tokens: bool = setting(True, "leave special tokens out of the text")
    include_stop_str_in_output: bool = setting(False, "keep the stop string in the text")
    # Offline and API only: no flags.
    truncate_prompt_tokens: int | None = setting(
        None, "keep the prompt's last k tokens; -1: the context length", flag=False)
    detokenize: bool = setting(True, "False: token ids only, no text (and no stop strings)",
                               flag=False)
    allowed_token_ids: list[int] | None = setting(
        None, "sample only these token ids", flag=False)
    bad_words: list[str] | None = setting(
        None, "words never generated (each as the tokenizer writes it, with and without a "
              "leading space)", flag=False)
    # The engine's tokenization of bad_words, one id list per spelling.
    bad_words_token_ids: list[list[int]] | None = setting(None, "", flag=False)
    guided_decoding: GuidedDecodingParams | None = setting(
        None, "constrain the output to a JSON schema, regex, choice or grammar", flag=False)
    logit_bias: dict[int, float] | None = setting(
        None, "token id -> bias added to its logit, in [-100, 100]", flag=False)

    def __post_init__(self) -> None:
        # Normalise the "one or many" fields first so validation sees lists only; a value of
        # another kind is named as given (list("12") would be ['1', '2']).
        if not (self.stop is None or isinstance(self.stop, str | list | tuple)):
            raise _bad("stop", self.stop, "a string or a list of strings")
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple)):
            raise _bad("stop_token_ids", self.stop_token_ids, "a list of ints >= 0")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if isinstance(self.guided_decoding, dict):
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        for name in ("allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        self._validate()

    def _validate(self) -> None:
        # Comparisons are written as `not (ok)` so NaN fails them too.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_number(name, getattr(self, name))
        _check_int("n", self.n)
        if not self.n >= 1:
            raise _bad("n", self.n, ">= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise _bad("temperature", self.temperature, "finite and >= 0")
        if not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "in (0, 1]")
        _check_int("top_k", self.top_k)
        if not self.top_k >= -1:
            raise _bad("top_k", self.top_k, ">= -1 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed)
            # The i-th of n sequences samples with seed + i, a torch.Generator seed (< 2**64).
            if not 0 <= self.seed <= MAX_SEED - (self.n - 1):
                raise _bad("seed", self.seed, f"in [0, {MAX_SEED - (self.n - 1)}] for n="
                                              f"{self.n} (each of n sequences seeds seed + i)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise _bad(name, value, "in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise _bad("repetition_penalty", self.repetition_penalty, "finite and > 0")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if not self.max_tokens >= 1:
                raise _bad("max_tokens", self.max_tokens, ">= 1 or None")
        _check_int("min_tokens", self.min_tokens)
        if not self.min_tokens >= 0:
            raise _bad("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(name, value)
            # The upper limit is the engine's (--max-logprobs): LLMEngine.check_sampling.
            if not value >= 0:
                raise _bad(name, value, ">= 0 or None")
        assert isinstance(self.stop, list) and self.stop_token_ids is not None
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", self.stop, "a non-empty string or list of non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise _bad("stop_token_ids", self.stop_token_ids, "a list of ints >= 0")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1):
                raise _bad("truncate_prompt_tokens", self.truncate_prompt_tokens,
                           ">= 1, or -1 for the context length")
        if not isinstance(self.detokenize, bool):
            raise _bad("detokenize", self.detokenize, "True or False")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: they are found in the text "
                             "(stop_token_ids work without it)")
        if self.bad_words is not None and not (isinstance(self.bad_words, list) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise _bad("bad_words", self.bad_words, "a list of non-empty strings")
        words = self.bad_words_token_ids
        if words is not None and not (isinstance(words, list) and all(
                isinstance(w, list) and w and all(_is_token_id(t) for t in w) for w in words)):
            raise _bad("bad_words_token_ids", words, "a list of non-empty lists of token ids")
        allowed = self.allowed_token_ids
        if allowed is not None and not (isinstance(allowed, list) and allowed and all(
                _is_token_id(t) for t in allowed)):
            raise _bad("allowed_token_ids", allowed, "a non-empty list of token ids (ints >= 0)")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding,
                                                               GuidedDecodingParams):
            raise _bad("guided_decoding", self.guided_decoding, "a GuidedDecodingParams")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def needs_host_history(self) -> bool:
        """Penalties and min_tokens read the request's earlier output tokens on the host when
        a step is launched, so its previous sample must be back first (no async overlap). A
        grammar needs that sample too, but only for its bitmask, which the runner fills while
        the step's forward runs (engine/guided.py)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.min_tokens or self.bad_words_token_ids)

    def end_token_ids(self, eos_token_id: int | None) -> frozenset[int]:
        """The token ids that end a sequence: `stop_token_ids`, and EOS unless `ignore_eos`.
        Before `min_tokens` outputs the sampler bans them and the request does not stop."""
        ids = set(self.stop_token_ids or ())
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return frozenset(ids)

    def truncated_prompt(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens (-1: max_model_len) tokens, as vLLM keeps."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        return token_ids[-(max_model_len if keep == -1 else keep):]

    def clone(self) -> SamplingParams:
        """A deep copy, as vLLM's SamplingParams.clone."""
        return copy.deepcopy(self)

    def with_bad_words_tokenized(self, tokenizer: Any) -> SamplingParams:
        """A copy whose bad_words_token_ids spell each bad word as the tokenizer writes it alone
        and after a space (a word mid-sentence), as vLLM bans them."""
        if not self.bad_words:
            return self
        spellings = {tuple(tokenizer.encode(text, add_special_tokens=False))
                     for word in self.bad_words or () for text in (word.lstrip(),
                                                                  " " + word.lstrip())}
        params = copy.copy(self)
        params.bad_words_token_ids = sorted(list(ids) for ids in spellings if ids)
        return params

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        allowed = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in allowed:
                raise ValueError(f"unknown sampling parameter {key!r}")
        return cls(**d)


def _checked_logit_bias(bias: Any) -> dict[int, float]:
    """{token id: bias}; ids may come as decimal strings (JSON object keys)."""
    if not isinstance(bias, dict):
        raise _bad("logit_bias", bias, "a mapping of token id to bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str):
            token = int(key) if key.strip().lstrip("-").isdigit() else None
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise _bad("logit_bias", key, "keyed by token ids (ints >= 0)")
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise _bad("logit_bias", value, f"bias values in [-{MAX_LOGIT_BIAS:g}, "
                                            f"{MAX_LOGIT_BIAS:g}] (token {token})")
        out[token] = float(value)
    return out


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, value, "a number")


def _check_int(name: str, value: Any) -> None:
    # bool is an int subclass; `n=True` is almost certainly a client bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, value, "an int")


# generation_config.json keys that are sampling settings (vLLM reads the same ones).
GENERATION_CONFIG_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling(generation_config: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling settings a model's generation config recommends (request fields win)."""
    config = generation_config or {}
    return {k: config[k] for k in GENERATION_CONFIG_SAMPLING if config.get(k) is not None}
