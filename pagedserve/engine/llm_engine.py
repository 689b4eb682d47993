"""LLMEngine: requests in, one batched step at a time, RequestOutputs out."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.config import EngineConfig, resolve_dtype
from pagedserve.engine.cpu_threads import configure_cpu_threads
from pagedserve.engine.model_runner import ModelRunnerOutput, PendingStep
from pagedserve.engine.output_processor import OutputProcessor, RequestState
from pagedserve.engine.outputs import RequestMetrics, RequestOutput
from pagedserve.kv_cache import KVCacheManager
from pagedserve.kv_cache.specs import bytes_per_slot
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput, ScoringTask
from pagedserve.structured_output import StructuredOutputManager, check_backend

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


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        from pagedserve.executor import create_executor
        from pagedserve.models.loader import load_model
        from pagedserve.models.quantization import resolve_quantization

        self.config = config
        chat_template = check_settings(config)  # before the (slow) load
        device = config.torch_device
        if device.type == "cpu":
            configure_cpu_threads()
        m = config.model
        quantization = resolve_quantization(m.quantization, m.model, m.dtype, device)
        # Weight-only int8 runs with bfloat16 activations unless a dtype was asked for.
        dtype = (torch.bfloat16 if quantization and m.dtype == "auto"
                 else resolve_dtype(m.dtype, device))
        if quantization:
            logger.info("%s weight-only linears with %s activations on the CPU (exact float32: "
                        "--dtype float32 or --quantization none)", quantization, dtype)
        t0 = time.perf_counter()
        # The executor first: with tensor parallelism it starts the other ranks and joins
        # their group, so the load below takes this process's (rank 0's) shard.
        self.runner = create_executor(config, dtype, quantization)
        device = config.torch_device  # Ray may have given rank 0 another GPU
        try:
            loaded = load_model(m.model, dtype, device, m.max_model_len, m.tokenizer,
                                m.generation_config, quantization)
        except BaseException:
            self.runner.shutdown()
            raise
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.chat_template = chat_template or loaded.chat_template
        # The model's recommended sampling settings, under a request's own.
        self.default_sampling = default_sampling(loaded.generation_config)
        if self.default_sampling:
            logger.info("default sampling settings from the model's generation config: %s",
                        self.default_sampling)
        self.max_model_len = loaded.max_model_len
        self.model_name = loaded.name
        eos_ids = list(loaded.eos_token_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.extra_eos_ids = eos_ids[1:]
        logger.info("loaded %s (%s, %s) in %.1f s", self.model_name, dtype, device,
                    time.perf_counter() - t0)

        self.runner.start_runner(loaded.model, loaded.hf_config.vocab_size,
                                 self.max_model_len, self.eos_token_id)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.runner.vocab_size, device, config.scheduler.max_num_seqs,
            config.guided_decoding_backend)
        self.runner.structured_output = self.structured_output
        num_blocks, num_slots = self.runner.determine_cache_size()
        self.runner.allocate_kv_cache(num_blocks, num_slots)
        self.runner.warmup()
        layout = self.runner.kv_layout
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size,
                                       config.cache.enable_prefix_caching, num_slots,
                                       windows=layout.windows if layout else None)
        if num_blocks:
            logger.info("KV cache: %d blocks of %d tokens (%d tokens, %d bytes per token over "
                        "all layers); backend %s", num_blocks, config.cache.block_size,
                        num_blocks * config.cache.block_size, self.kv_cache_bytes_per_token(),
                        self.runner.backend.get_name())
            if len(layout.groups) > 1:
                logger.info("KV cache groups share %d blocks of %d bytes (%s)", num_blocks,
                            layout.bytes_per_block, layout.describe())
        if num_slots:
            logger.info("state layers: %d slots (one per running request), %d bytes per slot",
                        num_slots, bytes_per_slot(self.runner.state_specs))
            if config.cache.enable_prefix_caching:
                logger.info("prefix caching is off: state layers keep one state per request, "
                            "not one per block")
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.async_scheduling = config.use_async_scheduling
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        # Live sequences whose sampling needs all earlier tokens on the host (see step()).
        self._sync_requests: set[str] = set()
        self.log_stats = log_stats
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._last_log = time.monotonic()
        self._logged_tokens = 0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def check_sampling(self, params: SamplingParams) -> None:
        """What a request's sampling settings must respect of this engine and model."""
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be <= {limit} (the server's --max-logprobs), "
                                 f"got {value}")
        vocab = self.runner.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids below the vocabulary size "
                             f"{vocab}, got {bad[0]}")
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias must be keyed by token ids below the vocabulary size "
                             f"{vocab}, got {bad[0]}")
        if params.guided_decoding is not None and self.tokenizer is None:
            raise ValueError("guided_decoding needs the model's tokenizer, and this model has "
                             "none")

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.runner.vocab_size
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
                    prompt_text: str | None = None) -> None:
        """Queue a request; `n` > 1 fans out into n sequences sharing the prompt (a seeded
        request's i-th sequence uses seed + i). With `stream=False` step() reports the request
        only when it finishes. `prompt_text`: the text of token-id `prompt` (its outputs'
        `prompt`), when the caller tokenized it."""
        self._check_new_id(request_id)
        params = params or SamplingParams()
        if cache_salt is not None:
            cache_salt.encode("utf-8")  # hashed with the blocks: UnicodeEncodeError here, not there
        text = prompt if isinstance(prompt, str) else prompt_text
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids, params)
        self.check_sampling(params)
        if params.max_tokens is None:
            params = copy.copy(params)
            params.max_tokens = self.max_model_len - len(token_ids)
        children = [self._child_params(params, i) for i in range(params.n)]
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        arrival = time.monotonic() if arrival_time is None else arrival_time
        requests = [Request(seq_id, token_ids, child, self.eos_token_id, arrival, cache_salt)
                    for seq_id, child in zip(ids, children, strict=True)]
        if params.guided_decoding is not None:
            # One matcher per sequence; the grammar is compiled once (or found in the cache).
            for request in requests:
                request.grammar = self.structured_output.new_grammar(
                    params.guided_decoding, request.end_token_ids)
        state = RequestState(request_id, text, token_ids, [], RequestMetrics(arrival),
                             stream=stream)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self._add(state, requests)

    def add_scoring_request(self, request_id: str, prompt: list[int], continuation: list[int],
                            mode: str = "decode", stream: bool = False) -> None:
        """Queue a scoring request (scheduler.ScoringTask): its one output carries, in
        `forced_logprobs`, the full next-token log-distributions [len(continuation), V] before
        each continuation token, computed by decode steps (`mode="decode"`) or as one prefill
        of prompt + continuation (`mode="prefill"`)."""
        self._check_new_id(request_id)
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
        request = Request(request_id, token_ids, SCORING_PARAMS, self.eos_token_id, arrival,
                          scoring=task)
        self._add(RequestState(request_id, None, token_ids, [], RequestMetrics(arrival),
                               stream=stream), [request])

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

    def _add(self, state: RequestState, requests: list[Request]) -> None:
        """Every part of the engine learns the request's sequences, or none does."""
        state.sequences = [self.output_processor.new_sequence(r, i)
                           for i, r in enumerate(requests)]
        added: list[str] = []
        try:
            for request in requests:
                self.scheduler.add_request(request)
                added.append(request.request_id)
                self.runner.add_request(request)
                if request.needs_host_history:
                    self._sync_requests.add(request.request_id)
        except BaseException:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            self._forget(added)
            raise
        self.output_processor.add(state)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (by the id given to add_request); their blocks are freed at once."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.output_processor.remove(request_id)
            if state is None:
                continue
            seq_ids = [s.request.request_id for s in state.sequences]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            self._forget(seq_ids)

    def _forget(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._sync_requests.discard(seq_id)
            self.runner.finish_request(seq_id)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting, running, or with a sample still in flight. A step in flight whose
        requests have all finished (their last sample was wasted) is completed by the next
        step() and needs none."""
        if self.scheduler.has_unfinished_requests():
            return True
        return self._in_flight is not None and not all(
            r.is_finished for r in self._in_flight[0].requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that completed.

        With async scheduling the step launched here runs on the GPU while the host finishes
        the previous one (its samples, stop checks, detokenization) and, on the next call,
        schedules the step after: outputs come one call later. Requests whose sampling needs
        every earlier token on the host (penalties, min_tokens, teacher forcing) make the
        engine run step by step while any of them is live."""
        outputs: list[RequestOutput] = []
        overlap = self.async_scheduling and not self._sync_requests
        if self._in_flight is not None and not overlap:
            outputs += self._complete(*self._in_flight)
            self._in_flight = None
        batch = self.scheduler.schedule()
        launched = None
        if not batch.is_empty:
            self._note_scheduled(batch)
            launched = (batch, self.runner.launch(batch))
        if self._in_flight is not None:
            outputs += self._complete(*self._in_flight)
        self._in_flight = launched if overlap else None
        if launched is not None and not overlap:
            outputs += self._complete(*launched)
        return outputs

    def _note_scheduled(self, batch: SchedulerOutput) -> None:
        now = time.monotonic()
        for i in (i for i, is_new in enumerate(batch.is_new) if is_new):
            state, _ = self.output_processor.seq_of[batch.requests[i].request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                state.num_cached_tokens = int(batch.num_computed_tokens[i])
        self.prompt_tokens += int(batch.num_scheduled_tokens.sum()) - int(
            (batch.num_scheduled_tokens == 1).sum())

    def _complete(self, batch: SchedulerOutput, pending: PendingStep) -> list[RequestOutput]:
        output = self.runner.collect(pending)
        results = self.scheduler.update_from_output(batch, output.sampled_token_ids)
        return self._process(batch, output, results)

    def _process(self, batch: SchedulerOutput, output: ModelRunnerOutput,
                 results: list[tuple[Request, int | None]]) -> list[RequestOutput]:
        processed = self.output_processor.process(
            batch, output, results, time.monotonic(),
            lambda ids: self.scheduler.finish_requests(ids, RequestStatus.FINISHED_STOPPED))
        self._forget(processed.finished)
        self.generation_tokens += processed.num_tokens
        self._maybe_log_stats()
        return processed.outputs

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.usage, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache.prefix_queries,
            prefix_cache_hits=self.kv_cache.prefix_hits, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens)

    def _maybe_log_stats(self, interval: float = 10.0) -> None:
        if not self.log_stats:
            return
        now = time.monotonic()
        if now - self._last_log < interval:
            return
        s = self.stats()
        rate = (s.generation_tokens - self._logged_tokens) / (now - self._last_log)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0
        logger.info("generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
                    "prefix cache hit rate %.1f%%, preemptions %d", rate, s.num_running,
                    s.num_waiting, 100 * s.kv_cache_usage, 100 * hit_rate, s.num_preemptions)
        self._last_log, self._logged_tokens = now, s.generation_tokens

    def shutdown(self) -> None:
        """Stop the model's other ranks, if any (idempotent)."""
        self.runner.shutdown()

    def kv_cache_bytes_per_token(self) -> int:
        """What one token's K/V (or MLA latent) costs over every attention layer, in the
        cache's layout (0 without attention layers)."""
        layout = self.runner.kv_layout
        if layout is None:
            return 0
        return layout.bytes_per_block * len(layout.groups) // self.runner.block_size

    def check_blocks_free(self) -> bool:
        """True when no request holds a KV block (all free or cached-evictable) or a state
        slot."""
        return self.kv_cache.all_free()


def check_settings(config: EngineConfig) -> str | None:
    """The settings that can be wrong, checked before anything loads; returns the chat
    template `--chat-template` names (its text), if any."""
    from pagedserve.attention.registry import requested_backend
    from pagedserve.models.loader import model_path

    config.check_device()
    requested_backend(config.attention_backend)
    check_backend(config.guided_decoding_backend)
    m = config.model
    if not (m.model or "").startswith("random:"):
        model_path(m.model)
    if m.generation_config not in ("auto", "vllm") and not (
            Path(m.generation_config).expanduser() / "generation_config.json").is_file():
        raise ValueError(f"generation_config {m.generation_config!r}: give 'auto', 'vllm' or a "
                         "directory holding a generation_config.json")
    if m.tokenizer is not None and not Path(m.tokenizer).expanduser().exists():
        raise ValueError(f"tokenizer {m.tokenizer!r} does not exist as a local directory or "
                         ".gguf file")
    if m.chat_template is None:
        return None
    path = Path(m.chat_template).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in m.chat_template or "{%" in m.chat_template:
        return m.chat_template
    raise ValueError(f"chat_template {m.chat_template!r} is neither a file nor a Jinja template")


# generation_config.json keys that are sampling settings (vLLM reads the same ones).
GENERATION_CONFIG_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling(generation_config: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling settings a model's generation config recommends (request fields win)."""
    config = generation_config or {}
    return {k: config[k] for k in GENERATION_CONFIG_SAMPLING if config.get(k) is not None}


# A scoring request samples nothing it keeps: greedy, so no generator or filter is built.
SCORING_PARAMS = SamplingParams(temperature=0)
