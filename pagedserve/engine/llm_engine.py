"""LLMEngine: requests in, one batched step at a time, RequestOutputs out."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import EngineConfig, resolve_dtype
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.model_runner import ModelRunner, ModelRunnerOutput, PendingStep
from pagedserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.engine.sampler import LogprobsTensors
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kv_cache import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """Engine-side state of one sequence (one of a request's `n` samples)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    text: str = ""  # streamed so far
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    # Scoring (teacher-forced or by prefill): chunks [rows, V] of next-token log-distributions.
    forced_logprobs: list[Any] | None = None
    num_scored: int = 0  # rows in forced_logprobs


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    finished_seqs: set[int] = field(default_factory=set)
    # False: only the final RequestOutput is made (offline generation needs no per-step ones).
    stream: bool = True

    @property
    def finished(self) -> bool:
        return len(self.finished_seqs) == len(self.sequences)


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
        from pagedserve.models.loader import load_model

        self.config = config
        device = config.torch_device
        dtype = resolve_dtype(config.model.dtype, device)
        t0 = time.perf_counter()
        loaded = load_model(config.model.model, dtype, device, config.model.max_model_len)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.model_name = config.model.served_model_name or loaded.name
        eos_ids = list(loaded.eos_token_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.extra_eos_ids = eos_ids[1:]
        logger.info("loaded %s (%s, %s) in %.1f s", self.model_name, dtype, device,
                    time.perf_counter() - t0)

        self.runner = ModelRunner(config, loaded.model, loaded.hf_config.vocab_size,
                                  self.max_model_len,
                                  self.eos_token_id)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.warmup()
        if self.runner.mamba_layers:
            # Per-request state, not per block: no prefix caching (turned off automatically).
            self.kv_cache = KVCacheManager.for_state_slots(num_blocks, self.runner.block_size)
            logger.info("Mamba state: %d slots (one per running request); backend %s",
                        num_blocks, self.runner.backend.get_name())
        else:
            self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size,
                                           config.cache.enable_prefix_caching)
            logger.info("KV cache: %d blocks of %d tokens (%d tokens); backend %s", num_blocks,
                        config.cache.block_size, num_blocks * config.cache.block_size,
                        self.runner.backend.get_name())
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self.states: dict[str, RequestState] = {}
        self.async_scheduling = config.use_async_scheduling
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        # Live sequences whose sampling needs all earlier tokens on the host (see step()).
        self._sync_requests: set[str] = set()
        self._seq_of: dict[str, tuple[RequestState, SequenceState]] = {}
        self.log_stats = log_stats
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._last_log = time.monotonic()
        self._logged_tokens = 0
        # Hooks for the server's metrics: called with (state) when a request finishes.
        self.on_finish: Callable[[RequestState], None] | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

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
                    cache_salt: str | None = None,
                    forced_output_ids: list[int] | None = None, stream: bool = True,
                    score_prompt_from: int | None = None) -> None:
        """Queue a request; `n` > 1 fans out into n sequences sharing the prompt (a seeded
        request's i-th sequence uses seed + i). `forced_output_ids` makes it a teacher-forced
        scoring request: those tokens are emitted instead of sampled ones and the full
        next-token log-distribution before each is returned (`forced_logprobs`).
        `score_prompt_from=s` scores by prefill instead: the prompt is computed as usual
        (chunked, never from the prefix cache) and `forced_logprobs` holds the full
        log-distributions at prompt positions s..len(prompt)-2, i.e. those predicting prompt
        tokens s+1..; the request generates one token, which the caller ignores. With
        `stream=False` step() reports the request only when it finishes."""
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if forced_output_ids is not None and score_prompt_from is not None:
            raise ValueError("forced_output_ids and score_prompt_from are two scoring modes: "
                             "pass one")
        if forced_output_ids is not None:
            self._validate_scoring(len(token_ids), len(forced_output_ids))
            params = copy.copy(params)
            params.max_tokens, params.ignore_eos, params.n = len(forced_output_ids), True, 1
            self.validate_prompt(token_ids + list(forced_output_ids), SamplingParams(max_tokens=1))
        if score_prompt_from is not None:
            if not 0 <= score_prompt_from < len(token_ids) - 1:
                raise ValueError(
                    f"score_prompt_from={score_prompt_from} must be in [0, {len(token_ids) - 2}]"
                    f" for a {len(token_ids)}-token prompt (at least one token to score)")
            self._validate_scoring(score_prompt_from + 1, len(token_ids) - score_prompt_from - 1)
            params = copy.copy(params)
            params.max_tokens, params.ignore_eos, params.n = 1, True, 1
        self.validate_prompt(token_ids, params)
        if params.max_tokens is None:
            params = copy.copy(params)
            params.max_tokens = self.max_model_len - len(token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, text, token_ids, [], RequestMetrics(arrival),
                             stream=stream)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        requests = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = copy.copy(params)
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + i
                if i > 0:
                    child_params.prompt_logprobs = None
            child_params = self._with_extra_eos(child_params)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(seq_id, token_ids, child_params, self.eos_token_id, arrival,
                              cache_salt, score_prompt_from)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, child_params)
            wants_lp = child_params.logprobs is not None
            seq = SequenceState(request, i, detok, [] if wants_lp else None,
                                0.0 if wants_lp else None)
            if forced_output_ids is not None:
                request.forced_output_ids = list(forced_output_ids)
            if forced_output_ids is not None or score_prompt_from is not None:
                seq.forced_logprobs = []
            if forced_output_ids is not None or _needs_host_history(child_params):
                self._sync_requests.add(seq_id)
            state.sequences.append(seq)
            requests.append(request)
        for request in requests:
            self.scheduler.add_request(request)
            self.runner.add_request(request)
        self.states[request_id] = state
        for seq in state.sequences:
            self._seq_of[seq.request.request_id] = (state, seq)

    def _validate_scoring(self, num_prompt: int, num_scored: int) -> None:
        if num_scored < 1:
            raise ValueError("the continuation to score is empty")
        if num_prompt + num_scored >= self.max_model_len:
            raise ValueError(
                f"a prompt of {num_prompt} tokens and a continuation of {num_scored} tokens do not"
                f" fit this model's context length for scoring: {num_prompt + num_scored} tokens"
                f" must be fewer than max_model_len={self.max_model_len}")

    def _with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """Models with several end tokens (generation_config) stop on all of them."""
        if not self.extra_eos_ids or params.ignore_eos:
            return params
        params = copy.copy(params)
        params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *self.extra_eos_ids]))
        return params

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (by the id given to add_request); their blocks are freed at once."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.states.pop(request_id, None)
            if state is None:
                continue
            seq_ids = [s.request.request_id for s in state.sequences]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            for seq_id in seq_ids:
                self._seq_of.pop(seq_id, None)
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
        return len(self.states)

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
            state, _ = self._seq_of[batch.requests[i].request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                state.num_cached_tokens = int(batch.num_computed_tokens[i])
        self.prompt_tokens += int(batch.num_scheduled_tokens.sum()) - int(
            (batch.num_scheduled_tokens == 1).sum())

    def _complete(self, batch: SchedulerOutput, pending: PendingStep) -> list[RequestOutput]:
        output = self.runner.collect(pending)
        results = self.scheduler.update_from_output(batch, output.sampled_token_ids)
        return self._process(batch, output, results)

    def _process(self, batch, output: ModelRunnerOutput, results) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        may_finish: set[str] = set()  # states one of whose sequences may have just ended
        # Logprobs, prompt logprobs, scores and teacher forcing are rare: the loop below
        # looks at them only when the step produced any.
        extras = bool(output.prompt_logprobs or output.score_logprobs
                      or output.forced_logprobs or output.logprobs is not None)
        # Batch rows, needed only to find logprobs (results skip finished requests).
        row_of = ({r.request_id: i for i, r in enumerate(batch.requests)}
                  if output.prompt_logprobs or output.logprobs is not None else {})
        stopped: list[str] = []
        for request, token in results:
            state, seq = self._seq_of[request.request_id]
            if extras:
                self._record_prompt_extras(batch, output, row_of, request, state, seq)
            if token is None:
                continue
            if extras:
                self._record_token_extras(output, row_of, request, token, seq)
            touched[state.request_id] = state
            self.generation_tokens += 1
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            if request.status == RequestStatus.FINISHED_STOPPED:
                # EOS and stop token ids end the sequence without adding their text.
                if token in request.stop_token_ids:
                    seq.stop_reason = token
            elif seq.detokenizer is not None and not seq.detokenizer.finished:
                stop = seq.detokenizer.update([token])
                if stop is not None:
                    seq.stop_reason = stop
                    if not request.is_finished:
                        stopped.append(request.request_id)
                    else:  # the length limit and a stop string met on the same token
                        request.status = RequestStatus.FINISHED_STOPPED
            if request.is_finished or seq.stop_reason is not None:
                may_finish.add(state.request_id)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        outputs = [self._make_output(state, now) for state in touched.values()
                   if state.stream or (state.request_id in may_finish
                                       and _has_new_finish(state))]
        self._maybe_log_stats()
        return outputs

    def _record_prompt_extras(self, batch, output: ModelRunnerOutput, row_of: dict[str, int],
                              request: Request, state: RequestState, seq) -> None:
        """Prompt logprobs and prefill scores a step computed for a request."""
        if request.request_id in output.prompt_logprobs and state.prompt_logprobs is not None:
            # This chunk predicted prompt positions computed+1..; a request recomputing its
            # prompt after preemption already has the first of them.
            first = int(batch.num_computed_tokens[row_of[request.request_id]]) + 1
            positions = self._positions(output.prompt_logprobs[request.request_id])
            state.prompt_logprobs.extend(positions[len(state.prompt_logprobs) - first:])
        if request.request_id in output.score_logprobs and seq.forced_logprobs is not None:
            # Rows by position: a request recomputing its prompt after preemption sends
            # positions it already sent.
            first, rows = output.score_logprobs[request.request_id]
            skip = request.score_from + seq.num_scored - first
            assert skip >= 0, "a gap in the scored positions"
            if skip < rows.shape[0]:
                seq.forced_logprobs.append(rows[skip:])
                seq.num_scored += rows.shape[0] - skip

    def _record_token_extras(self, output: ModelRunnerOutput, row_of: dict[str, int],
                             request: Request, token: int, seq) -> None:
        """A teacher-forced token's distribution and a sampled token's logprobs."""
        if request.forced_output_ids is not None and seq.forced_logprobs is not None:
            seq.forced_logprobs.append(output.forced_logprobs[request.request_id][None])
            seq.num_scored += 1
        if seq.logprobs is not None and output.logprobs is not None:
            row = row_of[request.request_id]
            k = request.sampling_params.logprobs
            lp = LogprobsTensors(output.logprobs.logprobs[row:row + 1, :k + 1],
                                 output.logprobs.token_ids[row:row + 1, :k + 1],
                                 output.logprobs.ranks[row:row + 1])
            position = self._positions(lp)[0]
            seq.logprobs.append(position)
            seq.cumulative_logprob += position[token].logprob

    def _positions(self, lp: LogprobsTensors) -> list[PositionLogprobs]:
        """LogprobsTensors rows -> per-position dicts {token id: Logprob}; column 0 is the
        chosen token (its rank computed), the rest the top alternatives ranked 1..K."""
        ids = lp.token_ids.tolist()
        values = lp.logprobs.tolist()
        ranks = lp.ranks.tolist()
        out = []
        for row_ids, row_values, rank in zip(ids, values, ranks, strict=True):
            position: PositionLogprobs = {}
            for j, (tid, value) in enumerate(zip(row_ids, row_values, strict=True)):
                if tid in position:
                    continue
                position[tid] = Logprob(value, rank if j == 0 else j, self._token_text(tid))
            out.append(position)
        return out

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _make_output(self, state: RequestState, now: float) -> RequestOutput:
        completions = []
        for seq in state.sequences:
            request = seq.request
            finish_reason = request.status.finish_reason
            if finish_reason is not None and seq.index not in state.finished_seqs:
                state.finished_seqs.add(seq.index)
                self._seq_of.pop(request.request_id, None)
                self._sync_requests.discard(request.request_id)
                self.runner.finish_request(request.request_id)
            delta = ""
            if seq.detokenizer is not None:
                delta = seq.detokenizer.get_next_delta(finished=finish_reason is not None)
                seq.text += delta
            new_ids = request.output_token_ids[seq.num_sent_tokens:]
            seq.num_sent_tokens = request.num_output_tokens
            delta_lp = None
            if seq.logprobs is not None:
                delta_lp = seq.logprobs[seq.num_sent_logprobs:]
                seq.num_sent_logprobs = len(seq.logprobs)
            completions.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(request.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
                finish_reason=finish_reason, stop_reason=seq.stop_reason, delta_text=delta,
                delta_token_ids=new_ids, delta_logprobs=delta_lp,
                forced_logprobs=_concat(seq.forced_logprobs) if finish_reason else None))
        state.metrics.num_preemptions = sum(s.request.num_preemptions for s in state.sequences)
        if state.finished:
            state.metrics.finished_time = now
            self.states.pop(state.request_id, None)
            if self.on_finish is not None:
                self.on_finish(state)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             state.prompt_logprobs, completions, state.finished, state.metrics,
                             state.num_cached_tokens)

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

    def check_blocks_free(self) -> bool:
        """True when no request holds a KV block (all free or cached-evictable); for a Mamba
        model the manager's blocks are its state slots, so this covers them too."""
        return self.kv_cache.num_free_blocks == self.kv_cache.num_blocks


def _needs_host_history(params: SamplingParams) -> bool:
    """Penalties and min_tokens read the request's earlier output tokens on the host when the
    step is launched, so its previous sample must be back first."""
    return bool(params.repetition_penalty != 1.0 or params.presence_penalty
                or params.frequency_penalty or params.min_tokens)


def _has_new_finish(state: RequestState) -> bool:
    return any(seq.request.is_finished and seq.index not in state.finished_seqs
               for seq in state.sequences)


def _concat(chunks: list[Any] | None) -> Any:
    if not chunks:
        return None
    import torch

    return torch.cat(chunks)
