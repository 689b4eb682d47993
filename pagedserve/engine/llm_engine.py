"""LLMEngine: the front of the engine. Requests in (tokenized and checked here), one batched
step at a time, RequestOutputs out (detokenized, stop strings found, logprobs made here).

The scheduler, the KV cache manager and the model runner are the engine core's
(`engine/core.py`), reached through a client (`engine/core_client.py`): in this process, or in
a process of its own (`--engine-core-process`) so that text work never stalls the step loop.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.engine.core import SCORING_PARAMS
from pagedserve.engine.core_client import InprocClient, MPClient
from pagedserve.engine.core_messages import (
    CoreRequest,
    CoreStats,
    StepOutput,
    sequence_features,
)
from pagedserve.engine.dp_client import DPClient
from pagedserve.engine.gc_heap import freeze_startup_heap, thaw_heap
from pagedserve.engine.output_processor import OutputProcessor, RequestState
from pagedserve.engine.outputs import RequestMetrics, RequestOutput
from pagedserve.engine.settings_checks import check_settings
from pagedserve.lora import LoRARequest
from pagedserve.lora.adapter import check_adapter_dir
from pagedserve.multimodal.front import ImageFront
from pagedserve.multimodal.inputs import MultiModalPrompt
from pagedserve.pooling import PoolingParams, resolve_pooler
from pagedserve.pooling.front import GENERATION_REFUSED, add_pooling_request
from pagedserve.sampling_params import SamplingParams, default_sampling
from pagedserve.scheduler import ScoringTask
from pagedserve.structured_output import StructuredOutputManager, guided_decoding_unavailable

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    # Speculative decoding (CoreStats' counters of the same names; empty per-position list:
    # off).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        self.config = config
        thaw_heap()  # an engine dropped since the last start-up can be collected
        self._checked_loras: set[LoRARequest] = set()  # adapters whose files were checked
        chat_template = check_settings(config)  # before the (slow) load
        self.pooler_config = resolve_pooler(config.model)  # None: a generating model
        self.client = make_client(config, log_stats)
        info = self.client.info
        self.tokenizer = info.tokenizer
        self.chat_template = chat_template or info.chat_template
        # The model's recommended sampling settings, under a request's own.
        self.default_sampling = default_sampling(info.generation_config)
        if self.default_sampling:
            logger.info("default sampling settings from the model's generation config: %s",
                        self.default_sampling)
        self.max_model_len = info.max_model_len
        self.model_name = info.model_name
        self.vocab_size = info.vocab_size
        eos_ids = list(info.eos_token_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.extra_eos_ids = eos_ids[1:]
        self.output_processor = OutputProcessor(self.tokenizer)
        if self.pooler_config is not None:
            logger.info("pooling model: %s", self.pooler_config.describe())
        self._structured_output: StructuredOutputManager | None = None
        # Images in prompts (multimodal/front.py): the model's processor (None: a text-only
        # model; a server renders chats with its placeholder) and the limits per prompt.
        self.images = ImageFront(config, self.tokenizer, self.model_name,
                                 generating=self.pooler_config is None)
        self.mm_processor = self.images.processor
        self.mm_limits = self.images.limits
        freeze_startup_heap()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- the core's parts, in this process only -----------------------------------------

    @property
    def core(self) -> Any:
        """The EngineCore when it runs in this process (tests and debugging look inside)."""
        if not isinstance(self.client, InprocClient):
            raise AttributeError("the engine core runs in its own process "
                                 "(--no-engine-core-process keeps it here)")
        return self.client.core

    def __getattr__(self, name: str) -> Any:
        """The in-process core's other attributes (loaded, async_scheduling, ...), read-only:
        what tests and benchmarks inspect."""
        client = self.__dict__.get("client")
        if name.startswith("__") or client is None:
            raise AttributeError(name)
        if not isinstance(client, InprocClient):
            raise AttributeError(f"LLMEngine.{name}: the engine core runs in its own process "
                                 "(engine_core_process=False keeps it here)")
        return getattr(client.core, name)

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def runner(self) -> Any:
        return self.core.runner

    @property
    def kv_cache(self) -> Any:
        return self.core.kv_cache

    @property
    def structured_output(self) -> StructuredOutputManager:
        """Grammars compiled here check a request before it is sent (the core compiles its
        own, from its cache)."""
        if isinstance(self.client, InprocClient):
            return self.client.core.structured_output
        if self._structured_output is None:
            import torch

            self._structured_output = StructuredOutputManager(
                self.tokenizer, self.vocab_size, torch.device("cpu"),
                self.config.scheduler.max_num_seqs, self.config.guided_decoding_backend)
        return self._structured_output

    # ---- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str, add_special_tokens: bool = False) -> list[int]:
        # A request's text prompt takes the special tokens (a Llama BOS), as vLLM's do.
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter: LoRA must be on, and the request a LoRARequest."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a pagedserve.lora.LoRARequest, got "
                            f"{type(lora_request).__name__}")
        if not self.config.lora.enable_lora:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is "
                             f"off: start the engine with --enable-lora")
        if lora_request not in self._checked_loras:  # what needs no model, here, once
            check_adapter_dir(lora_request.lora_path, lora_request.lora_name,
                              self.config.lora.max_lora_rank)
            self._checked_loras.add(lora_request)

    def check_sampling(self, params: SamplingParams) -> None:
        """What a request's sampling settings must respect of this engine and model."""
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be <= {limit} (the server's --max-logprobs), "
                                 f"got {value}")
        check_stop_limits(params, self.config.model)
        if params.stop and self.tokenizer is None:
            raise ValueError(STOP_NEEDS_TOKENIZER)
        vocab = self.vocab_size
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids",
                     "bad_words_token_ids"):
            ids = getattr(params, name) or ()
            if name == "bad_words_token_ids":
                ids = [t for word in ids for t in word]
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} must hold token ids below the vocabulary size "
                                 f"{vocab}, got {bad[0]}")
        if params.bad_words and (self.tokenizer is None or self.config.speculative_config):
            raise ValueError("bad_words need the model's tokenizer, and no --speculative-config")
        if params.guided_decoding is not None:
            if self.tokenizer is None:
                raise ValueError("guided_decoding needs the model's tokenizer, and this model "
                                 "has none")
            missing = guided_decoding_unavailable(self.config.guided_decoding_backend)
            if missing is not None:
                raise ValueError(missing)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but the model's context length is "
                             f"{self.max_model_len} tokens (no room to generate)")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{n + params.max_tokens} were requested ({n} in the prompt, "
                f"{params.max_tokens} to generate)")

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, stream: bool = True,
                    prompt_text: str | None = None, lora_request: LoRARequest | None = None,
                    multi_modal_data: Mapping[str, Any] | MultiModalPrompt | None = None
                    ) -> None:
        """Queue a request; `n` > 1 fans out into n sequences sharing the prompt (a seeded
        request's i-th sequence uses seed + i). With `stream=False` step() reports the request
        only when it finishes. `prompt_text`: the text of token-id `prompt` (its outputs'
        `prompt`), when the caller tokenized it. `multi_modal_data`: the prompt's images,
        {"image": PIL image, tensor of embeddings, or a list of them}, one placeholder each in
        the prompt, expanded here (outputs' prompt_token_ids are the expanded ids); or a
        MultiModalPrompt that `multimodal.front.process_prompt` made already (its ids are the
        prompt, `prompt` only its text)."""
        self._check_new_id(request_id)
        if self.pooler_config is not None:
            raise ValueError(GENERATION_REFUSED)
        params = params or SamplingParams()
        if cache_salt is not None:
            cache_salt.encode("utf-8")  # hashed with the blocks: UnicodeEncodeError here, not there
        text = prompt if isinstance(prompt, str) else prompt_text
        token_ids = (self.tokenize(prompt, add_special_tokens=True) if isinstance(prompt, str)
                     else list(prompt))
        token_ids = params.truncated_prompt(token_ids, self.max_model_len)
        mm = self.images.prepare(token_ids, multi_modal_data)
        if mm is not None:
            token_ids = mm.prompt_token_ids
        self.validate_prompt(token_ids, params)
        self.check_sampling(params)
        if params.guided_decoding is not None and not isinstance(self.client, InprocClient):
            self.structured_output.compile(params.guided_decoding)  # refused here, not there
        params = params.with_bad_words_tokenized(self.tokenizer)
        if params.max_tokens is None:
            params = copy.copy(params)
            params.max_tokens = self.max_model_len - len(token_ids)
        children = [self._child_params(params, i) for i in range(params.n)]
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, text, token_ids, [], RequestMetrics(arrival),
                             stream=stream)
        state.sequences = [self.output_processor.new_sequence(seq_id, i, token_ids, child)
                           for i, (seq_id, child) in enumerate(zip(ids, children, strict=True))]
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.check_lora(lora_request)
        features = sequence_features(mm.features if mm else None, len(ids))
        mrope = dict(mrope_positions=mm.mrope_positions,
                     mrope_delta=mm.mrope_delta) if mm and mm.mrope_positions is not None else {}
        self._add(state, [CoreRequest(seq_id, token_ids, child, arrival, cache_salt,
                                      lora=lora_request, mm_features=seq_features, **mrope)
                          for seq_id, child, seq_features in zip(ids, children, features,
                                                                 strict=True)])

    def add_scoring_request(self, request_id: str, prompt: list[int], continuation: list[int],
                            mode: str = "decode", stream: bool = False) -> None:
        """Queue a scoring request (scheduler.ScoringTask): its one output carries, in
        `forced_logprobs`, the full next-token log-distributions [len(continuation), V] before
        each continuation token, computed by decode steps (`mode="decode"`) or as one prefill
        of prompt + continuation (`mode="prefill"`)."""
        self._check_new_id(request_id)
        if self.pooler_config is not None:
            raise ValueError(GENERATION_REFUSED)
        task = ScoringTask(mode, tuple(continuation))
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        total = len(token_ids) + len(task.continuation)
        if total >= self.max_model_len:
            raise ValueError(
                f"a prompt of {len(token_ids)} tokens and a continuation of "
                f"{len(task.continuation)} tokens do not fit this model's context length for "
                f"scoring: {total} tokens must be fewer than max_model_len={self.max_model_len}")
        self.validate_prompt(token_ids + list(task.continuation), SamplingParams(max_tokens=1))
        arrival = time.monotonic()
        state = RequestState(request_id, None, token_ids, [], RequestMetrics(arrival),
                             stream=stream)
        state.sequences = [self.output_processor.new_sequence(request_id, 0, token_ids,
                                                              SCORING_PARAMS, scoring=True)]
        self._add(state, [CoreRequest(request_id, token_ids, SCORING_PARAMS, arrival,
                                      scoring_mode=mode, continuation=list(continuation))])

    def add_pooling_request(self, request_id: str, prompt: str | list[int],
                            params: PoolingParams | None = None,
                            arrival_time: float | None = None,
                            prompt_text: str | None = None) -> None:
        """Queue an embedding request (pooling/front.py); its one output is a
        PoolingRequestOutput."""
        add_pooling_request(self, request_id, prompt, params, arrival_time, prompt_text)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Sequence `index` of n: seed + index, prompt logprobs on the first only, and every
        end token of the model (generation_config may list several) among its stop ids."""
        child = params
        if params.n > 1:
            child = copy.copy(params)
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + index
            if index > 0:
                child.prompt_logprobs = None
        if self.extra_eos_ids and not child.ignore_eos:
            child = copy.copy(child)
            child.stop_token_ids = list(dict.fromkeys([*child.stop_token_ids,
                                                       *self.extra_eos_ids]))
        return child

    def _add(self, state: RequestState, requests: list[CoreRequest]) -> None:
        """The core learns every sequence of the request, or none (then this raises)."""
        self.client.add_requests(requests)
        self.output_processor.add(state)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (by the id given to add_request); their blocks are freed before the
        next step."""
        seq_ids: list[str] = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.output_processor.remove(request_id)
            if state is not None:
                seq_ids += [s.seq_id for s in state.sequences]
        if seq_ids:
            self.client.abort_requests(seq_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet: in this process, waiting or running in the core or with
        a sample in flight; with a core process, those whose final output has not come."""
        if isinstance(self.client, InprocClient):
            return self.client.has_unfinished_requests()
        return bool(self.output_processor.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # ---- one step -----------------------------------------------------------------------

    def step(self, timeout: float = 0.05) -> list[RequestOutput]:
        """The outputs of the next completed step. In this process: schedule and launch one
        step (with async scheduling its outputs come one call later). With a core process:
        send what was queued, then wait up to `timeout` seconds for the core's next step
        (an empty list when none came)."""
        out = self.client.get_output(timeout)
        if out is None:
            return []
        return self._process(out)

    def _process(self, out: StepOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for seq_id, why in out.failed.items():
            logger.error("the engine core refused sequence %s: %s", seq_id, why)
            failed = self.output_processor.fail(seq_id)
            if failed is not None:
                outputs.append(failed)
                self.abort_request(failed.request_id)
        processed = self.output_processor.process(out)
        if processed.stopped:  # stop strings: the core frees them before its next step
            self.client.abort_requests(processed.stopped, stopped=True)
        outputs += processed.outputs
        return outputs

    # ---- stats and utilities ------------------------------------------------------------

    def core_stats(self) -> CoreStats:
        """The core's counters: as of its last step with a core process (call_utility("stats")
        asks for current ones)."""
        return self.client.stats()

    def stats(self) -> EngineStats:
        s = self.client.stats()
        return EngineStats(s.num_running, s.num_waiting, s.kv_cache_usage, s.num_preemptions,
                           s.prefix_cache_queries, s.prefix_cache_hits, s.prompt_tokens,
                           s.generation_tokens, s.spec_decode_num_drafts,
                           s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens,
                           list(s.spec_decode_num_accepted_tokens_per_pos))

    def call_utility(self, name: str) -> Any:
        """A core utility by name: "stats" (CoreStats, current), "reset_prefix_cache",
        "ping"."""
        return self.client.call_utility(name)

    def kv_cache_bytes_per_token(self) -> int:
        """What one token's K/V (or MLA latent) costs over every attention layer, in the
        cache's layout (0 without attention layers)."""
        return self.client.info.kv_cache_bytes_per_token

    def check_blocks_free(self) -> bool:
        """True when no request holds a KV block (all free or cached-evictable) or a state
        slot."""
        return self.client.call_utility("stats").all_free

    @property
    def idle_poll_s(self) -> float | None:
        """How often an idle driver (AsyncLLM) should still read the core's messages."""
        return self.client.idle_poll_s

    def check_alive(self) -> None:
        """Raise EngineDeadError once the core process has died (in this process: WorkerError
        once a tensor-parallel rank has failed or hung)."""
        self.client.check_alive()

    def on_core_death(self, callback: Callable[[], None]) -> None:
        """`callback()`, from another thread, when the core process dies (never in-process)."""
        self.client.on_death(callback)

    def shutdown(self) -> None:
        """Stop the core process, if there is one, and the model's other ranks, if any (also
        done when the engine is collected and at exit)."""
        self.client.shutdown()


# Stop strings are searched for in the detokenized text, which a model without a tokenizer does
# not have: refused, as vLLM refuses them, rather than never matched.
STOP_NEEDS_TOKENIZER = ("stop strings need a tokenizer to find them in the generated text, and "
                        "this model has none: give one (--tokenizer DIR; offline, "
                        "LLM(..., tokenizer=DIR)), or stop on token ids with stop_token_ids")


def check_stop_limits(params: SamplingParams, model: ModelConfig) -> None:
    """A request's stop strings and stop ids within the engine's limits: the front searches
    every stop string at every token, and the core looks the stop ids up at every step."""
    stop = params.stop or []
    if len(stop) > model.max_stop_strings:
        raise ValueError(f"stop must hold at most {model.max_stop_strings} strings (the "
                         f"engine's --max-stop-strings), got {len(stop)}")
    longest = max((len(s) for s in stop), default=0)
    if longest > model.max_stop_string_length:
        raise ValueError(f"stop strings must be at most {model.max_stop_string_length} "
                         f"characters long (the engine's --max-stop-string-length), got one "
                         f"of {longest}")
    num_ids = len(params.stop_token_ids or ())
    if num_ids > model.max_stop_token_ids:
        raise ValueError(f"stop_token_ids must hold at most {model.max_stop_token_ids} ids (the "
                         f"engine's --max-stop-token-ids), got {num_ids}")


def make_client(config: EngineConfig, log_stats: bool = False
                ) -> InprocClient | MPClient | DPClient:
    """The core in this process, in a process of its own, or (data parallelism) several."""
    if config.data_parallel_size > 1:
        return DPClient(config, log_stats)
    if config.use_engine_core_process:
        return MPClient(config, log_stats)
    return InprocClient(config, log_stats)
