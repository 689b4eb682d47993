"""EngineCore: the scheduler, the KV cache manager and the model runner, and the step over them.

The core takes requests already tokenized and checked (`CoreRequest`, one per sequence; a
request's `n` sequences are added together) and aborts, and turns each completed step into one
compact `StepOutput`: per sequence its new token, its finish if the core ended it (EOS, a stop
token id, the length limit, its grammar), its logprobs as arrays. Text, stop strings and
RequestOutputs are the front's (`LLMEngine` and its `OutputProcessor`). The same core runs in
the front's process or in a process of its own (`core_process.py`); the messages it takes and
gives are in `core_messages.py`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from pagedserve.config import EngineConfig, resolve_dtype
from pagedserve.engine.core_messages import (
    CoreInfo,
    CoreRequest,
    CoreStats,
    StepOutput,
    share_feature_data,
)
from pagedserve.engine.cpu_threads import configure_cpu_threads
from pagedserve.engine.logprob_rows import logprob_rows, merge_rows
from pagedserve.engine.runner_outputs import ModelRunnerOutput, PendingStep
from pagedserve.engine.stats_log import maybe_log_stats
from pagedserve.kv_cache import KVCacheManager
from pagedserve.kv_cache.specs import bytes_per_slot
from pagedserve.lora.step_cap import AdapterCap
from pagedserve.multimodal.encoder_cache import encoder_cache_for
from pagedserve.multimodal.processing import ProcessorSettings
from pagedserve.pooling.core_hooks import pooling_request, record_embeddings
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput, ScoringTask
from pagedserve.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

# A scoring request samples nothing it keeps: greedy, so no generator or filter is built.
SCORING_PARAMS = SamplingParams(temperature=0)


class EngineCore:
    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        from pagedserve.executor import create_executor
        from pagedserve.quantization.registry import resolve_quantization

        self.config = config
        # Sequence groups whose grammars compile off the step path (seconds for a big schema).
        self._awaiting_grammar: list[tuple[Future, list[CoreRequest]]] = []
        self._grammar_pool: ThreadPoolExecutor | None = None
        device = config.torch_device
        if device.type == "cpu":
            configure_cpu_threads()
        m = config.model
        quantization = resolve_quantization(m.quantization, m.model, m.dtype, device)
        dtype = resolve_dtype(m.dtype, device)
        if quantization == "int8":
            logger.info("%s weight-only linears (bfloat16 products) with %s activations on the "
                        "CPU (float32 weights: --dtype float32 or --quantization none)",
                        quantization, dtype)
        t0 = time.perf_counter()
        # The executor first: with tensor parallelism it starts the other ranks and joins
        # their group, so the load below takes this process's (rank 0's) shard.
        self.runner = create_executor(config, dtype, quantization)
        device = config.torch_device  # Ray may have given rank 0 another GPU
        try:  # a failure from here on stops the ranks the executor started
            self._start(config, dtype, device, quantization, t0)
        except BaseException:
            self.runner.shutdown()
            raise
        spec, speculator = config.speculative, self.runner.speculator
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len,
                                   spec.num_speculative_tokens if spec else 0,
                                   bool(speculator and speculator.uses_kv_cache),
                                   spec.disable_by_batch_size if spec else None)
        if config.lora.enable_lora:
            self.scheduler.lora_cap = AdapterCap(config.lora.max_loras)
        self.scheduler.encoder_cache = encoder_cache_for(self.loaded, config.scheduler,
                                                         ProcessorSettings.of(config.model))
        self.async_scheduling = config.use_async_scheduling
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        # Live sequences whose sampling needs all earlier tokens on the host (see step()).
        self._sync_requests: set[str] = set()
        # Rows of scored distributions already sent per scoring sequence (a request recomputing
        # its prompt after preemption computes some again).
        self._num_scored: dict[str, int] = {}
        self.log_stats = log_stats
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.step_seconds = 0.0
        self._last_log = time.monotonic()
        self._logged_tokens = 0

    def _start(self, config: EngineConfig, dtype: torch.dtype, device: torch.device,
               quantization: str | None, t0: float) -> None:
        """Load this rank's weights, start the runner, size and allocate the cache."""
        from pagedserve.models.loader import load_model, text_config_of

        m = config.model
        loaded = load_model(m.model, dtype, device, m.max_model_len, m.tokenizer,
                            m.generation_config, quantization)
        self.loaded = loaded
        self.max_model_len = loaded.max_model_len
        eos_ids = list(loaded.eos_token_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        logger.info("loaded %s (%s, %s) in %.1f s", loaded.name, dtype, device,
                    time.perf_counter() - t0)

        self.runner.start_runner(loaded.model, text_config_of(loaded.hf_config).vocab_size,
                                 self.max_model_len, self.eos_token_id)
        self.structured_output = StructuredOutputManager(
            loaded.tokenizer, self.runner.vocab_size, device, config.scheduler.max_num_seqs,
            config.guided_decoding_backend, config.guided_decoding_workers,
            config.speculative.num_speculative_tokens if config.speculative else 0)
        self.runner.structured_output = self.structured_output
        num_blocks, num_slots = self.runner.determine_cache_size()
        self.runner.allocate_kv_cache(num_blocks, num_slots)
        self.runner.warmup()
        # Requests without a seed sample from torch's global generator: seeded once the
        # warm-up has drawn from it, as vLLM seeds its workers, so a run's samples repeat.
        torch.manual_seed(config.model.seed)
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
        if getattr(self.runner, "encoder_only", False):
            logger.info("encoder-only model: no KV cache; each request runs whole in one step "
                        "(backend %s)", self.runner.backend.get_name())
        if num_slots:
            logger.info("state layers: %d slots (one per running request), %d bytes per slot"
                        "%s", num_slots, bytes_per_slot(self.runner.state_specs),
                        f", each with {self.runner.state_slot_copies - 1} verify scratch slots"
                        if self.runner.state_slot_copies > 1 else "")
            if config.cache.enable_prefix_caching:
                logger.info("prefix caching is off: state layers keep one state per request, "
                            "not one per block")

    def info(self) -> CoreInfo:
        loaded = self.loaded
        return CoreInfo(loaded.name, loaded.tokenizer, loaded.chat_template,
                        loaded.generation_config, self.max_model_len, self.runner.vocab_size,
                        list(loaded.eos_token_ids), self.kv_cache.num_blocks,
                        self.kv_cache_bytes_per_token())

    # ---- requests -----------------------------------------------------------------------

    def add_requests(self, requests: list[CoreRequest]) -> None:
        """A request's sequences: every part of the core learns them, or none does. A grammar
        not compiled yet is compiled in a worker thread first (`_admit_compiled`)."""
        uncompiled = [r.params.guided_decoding for r in requests
                      if r.scoring_mode is None and r.params.guided_decoding is not None
                      and not self.structured_output.is_compiled(r.params.guided_decoding)]
        if uncompiled:
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="core-grammar")
            future = self._grammar_pool.submit(self.structured_output.compile_all, uncompiled)
            self._awaiting_grammar.append((future, requests))
            return
        self._add_now(requests)

    def _admit_compiled(self, out: StepOutput) -> None:
        """Add the groups whose grammars are compiled; fail those whose compile failed."""
        ready = [f.done() for f, _ in self._awaiting_grammar]  # once: a compile may end now
        done = [entry for entry, r in zip(self._awaiting_grammar, ready, strict=True) if r]
        self._awaiting_grammar = [e for e, r in zip(self._awaiting_grammar, ready, strict=True)
                                  if not r]
        for future, group in done:
            try:
                future.result()
                self._add_now(group)
            except Exception as exc:  # the front checked the spec: this request alone fails
                text = " ".join(str(exc).split())
                for request in group:
                    out.failed[request.request_id] = f"{type(exc).__name__}: {text}"

    def _add_now(self, requests: list[CoreRequest]) -> None:
        share_feature_data(requests)  # n > 1: the images' tensors came with the first only
        built = [self._build(r) for r in requests]
        added: list[str] = []
        try:
            for request in built:
                self.scheduler.add_request(request)
                added.append(request.request_id)
                self.runner.add_request(request)
                if request.needs_host_history:
                    self._sync_requests.add(request.request_id)
                if request.scoring is not None:
                    self._num_scored[request.request_id] = 0
        except BaseException:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            self._forget(added)
            raise

    def _build(self, r: CoreRequest) -> Request:
        if r.pooling is not None:
            return pooling_request(r, self.eos_token_id)
        if r.scoring_mode is not None:
            task = ScoringTask(r.scoring_mode, tuple(r.continuation or ()))
            return Request(r.request_id, r.prompt_token_ids, SCORING_PARAMS, self.eos_token_id,
                           r.arrival_time, scoring=task)
        if r.lora is not None:  # read (and checked against the model) before it is queued
            self._lora_manager().add_request(r.lora)
        request = Request(r.request_id, r.prompt_token_ids, r.params, self.eos_token_id,
                          r.arrival_time, r.cache_salt, lora_request=r.lora,
                          mm_features=[f.feature() for f in r.mm_features or ()],
                          mrope_positions=r.mrope_positions, mrope_delta=r.mrope_delta)
        if r.params.guided_decoding is not None:
            # One matcher per sequence; the grammar is compiled once (or found in the cache).
            request.grammar = self.structured_output.new_grammar(r.params.guided_decoding,
                                                                 request.end_token_ids)
        return request

    def _lora_manager(self) -> Any:
        if self.scheduler.lora_cap is None:
            raise ValueError("a request names a LoRA adapter, but LoRA is off: start the "
                             "engine with --enable-lora")
        return self.runner.lora

    def abort_requests(self, seq_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish sequences wherever they are (aborts, and stop strings found by the front);
        their blocks are free at once. Unknown or finished ids are ignored."""
        if self._awaiting_grammar:
            gone = set(seq_ids)
            kept = [(f, [r for r in group if r.request_id not in gone])
                    for f, group in self._awaiting_grammar]
            self._awaiting_grammar = [(f, group) for f, group in kept if group]
        self.scheduler.finish_requests(seq_ids, status)
        self._forget(seq_ids)

    def _forget(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._sync_requests.discard(seq_id)
            self._num_scored.pop(seq_id, None)
            self.runner.finish_request(seq_id)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting, running, or with a sample still in flight. A step in flight whose
        requests have all finished (their last sample was wasted) is completed by the next
        step() and needs none."""
        if self.scheduler.has_unfinished_requests() or self._awaiting_grammar:
            return True
        return self._in_flight is not None and not all(
            r.is_finished for r in self._in_flight[0].requests)

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Schedule and launch one step; return what the step that completed produced.

        With async scheduling the step launched here runs on the GPU while the host finishes
        the previous one; on the next call it schedules the step after: outputs come one call
        later. Requests whose sampling needs every earlier token on the host (penalties,
        min_tokens, teacher forcing) make the core run step by step while any of them is
        live."""
        start = time.perf_counter()
        out = StepOutput()
        if self._awaiting_grammar:
            if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
                # Nothing else to run: wait for a compile rather than spin.
                wait([f for f, _ in self._awaiting_grammar], timeout=0.01,
                     return_when=FIRST_COMPLETED)
            self._admit_compiled(out)
        overlap = (self.async_scheduling and not self._sync_requests
                   and not self.scheduler.speculating)
        if self._in_flight is not None and not overlap:
            self._complete(*self._in_flight, out)
            self._in_flight = None
        batch = self.scheduler.schedule()
        launched = None
        if not batch.is_empty:
            self._note_scheduled(batch, out)
            if self.scheduler.lora_cap is not None:  # the step's adapters into their slots
                self.runner.lora.set_batch(batch)
            launched = (batch, self.runner.launch(batch))
        if self._in_flight is not None:
            self._complete(*self._in_flight, out)
        self._in_flight = launched if overlap else None
        if launched is not None and not overlap:
            self._complete(*launched, out)
        out.time = time.monotonic()
        self.num_steps += 1
        self.step_seconds += time.perf_counter() - start
        maybe_log_stats(self)
        return out

    def _note_scheduled(self, batch: SchedulerOutput, out: StepOutput) -> None:
        if not batch.num_prefills and not any(batch.is_new):  # decodes only (most steps)
            return
        now = time.monotonic()
        for i in np.flatnonzero(batch.is_new).tolist():
            # The front keeps the first (a preempted request is admitted again).
            out.scheduled[batch.requests[i].request_id] = (now, int(batch.num_computed_tokens[i]))
        self.prompt_tokens += int(batch.num_scheduled_tokens.sum()) - int(
            (batch.num_scheduled_tokens == 1).sum())
        if (drafts := batch.num_draft_tokens) is not None:  # verify steps' 1+K: no prompt
            self.prompt_tokens -= int(drafts.sum()) + int((drafts > 0).sum())

    def _complete(self, batch: SchedulerOutput, pending: PendingStep, out: StepOutput) -> None:
        output = self.runner.collect(pending)
        results = self.scheduler.update_from_output(batch, output.sampled_token_ids,
                                                    output.draft_token_ids)
        if results:
            self._record(batch, output, results, out)

    def _record(self, batch: SchedulerOutput, output: ModelRunnerOutput,
                results: list[tuple[Request, int | None]], out: StepOutput) -> None:
        """A completed step's results into `out` (appended: a call may complete two steps)."""
        seq_ids = [r.request_id for r, _ in results]
        tokens = np.fromiter((-1 if t is None else t for _, t in results), np.int64,
                             len(results))
        first_row = len(out.seq_ids)
        out.seq_ids += seq_ids
        out.tokens = tokens if out.tokens is None else np.concatenate([out.tokens, tokens])
        finished: list[str] = []
        for request, token in results:
            if request.num_preemptions:
                out.num_preemptions[request.request_id] = request.num_preemptions
            if token is None or not request.is_finished:
                continue
            finished.append(request.request_id)
            stop_token = None
            # EOS and stop token ids end the sequence without adding their text; a stop token
            # id is its stop reason, EOS none. A grammar that can accept nothing more ends it
            # on an ordinary token (llguidance), whose text is kept.
            grammar = request.grammar
            on_end_token = request.status == RequestStatus.FINISHED_STOPPED and (
                token in request.end_token_ids
                or (grammar is not None and grammar.is_terminated
                    and grammar.ends_on_stop_token))
            if on_end_token and token in request.sampling_params.stop_token_ids:
                stop_token = token
            out.finished[request.request_id] = (request.status.finish_reason, stop_token,
                                                on_end_token)
        self.generation_tokens += int((tokens >= 0).sum())
        if output.pooled is not None:
            record_embeddings(batch, output.pooled, results, out)
        # Logprobs, prompt logprobs and scores are rare: looked at only when the step has any.
        new_lp = None
        if output.logprobs is not None or output.prompt_logprobs:
            row_of = {r.request_id: i for i, r in enumerate(batch.requests)}
            if output.logprobs is not None:
                rows = logprob_rows(seq_ids, row_of, output.sampled_token_ids)
                lp = output.logprobs
                new_lp = (lp.logprobs.numpy()[rows], lp.token_ids.numpy()[rows],
                          lp.ranks.numpy()[rows])
            for seq_id, lp in output.prompt_logprobs.items():
                first = int(batch.num_computed_tokens[row_of[seq_id]]) + 1
                out.prompt_logprobs[seq_id] = (first, lp.logprobs.numpy(), lp.token_ids.numpy(),
                                               lp.ranks.numpy())
        if new_lp is not None or out.logprobs is not None:
            out.logprobs = merge_rows(out.logprobs, first_row, new_lp, len(seq_ids))
        if output.score_logprobs or output.forced_logprobs:
            self._record_scores(output, results, out)
        self._forget(finished)

    def _record_scores(self, output: ModelRunnerOutput,
                       results: list[tuple[Request, int | None]], out: StepOutput) -> None:
        for request, token in results:
            seq_id = request.request_id
            chunks = []
            if seq_id in output.score_logprobs:
                # Rows by position: a request recomputing its prompt after preemption sends
                # positions it already sent.
                first, rows = output.score_logprobs[seq_id]
                skip = request.score_from + self._num_scored[seq_id] - first
                assert skip >= 0, "a gap in the scored positions"
                if skip < rows.shape[0]:
                    chunks.append(rows[skip:])
            if token is not None and seq_id in output.forced_logprobs:
                chunks.append(output.forced_logprobs[seq_id][None])
            if chunks:
                rows = torch.cat(chunks).float().numpy()
                self._num_scored[seq_id] += rows.shape[0]
                if seq_id in out.scores:
                    rows = np.concatenate([out.scores[seq_id], rows])
                out.scores[seq_id] = rows

    # ---- stats and utilities ------------------------------------------------------------

    def stats(self) -> CoreStats:
        kv, timer = self.kv_cache, getattr(self.runner, "device_timer", None)
        spec = self.scheduler.spec_stats
        return CoreStats(len(self.scheduler.running), len(self.scheduler.waiting), kv.usage,
                         self.scheduler.num_preemptions, kv.prefix_queries, kv.prefix_hits,
                         self.prompt_tokens, self.generation_tokens, kv.num_blocks,
                         kv.num_free_blocks, kv.all_free(), self.num_steps, self.step_seconds,
                         self.runner.wait_seconds,
                         timer.total_seconds() if timer is not None else 0.0,
                         **(spec.counters() if spec is not None else {}),
                         **self._mm_counters())

    def _mm_counters(self) -> dict[str, int]:
        mm = getattr(self.runner, "multimodal", None)
        if mm is None:
            return {}
        return {"mm_images_encoded": mm.num_encoded, "mm_encoder_calls": mm.num_encoder_calls,
                "mm_encoder_seconds": mm.encoder_seconds}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing done) while a request holds blocks."""
        return self.kv_cache.pool.reset_prefix_cache()

    def call_utility(self, name: str) -> Any:
        """The calls a front may make by name (the core process answers them between steps)."""
        if name == "stats":
            return self.stats()
        if name == "reset_prefix_cache":
            return self.reset_prefix_cache()
        if name == "ping":
            return "pong"
        raise ValueError(f"unknown engine core utility {name!r}")

    def shutdown(self) -> None:
        """Stop the model's other ranks, if any (idempotent)."""
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.structured_output.shutdown()
        self.runner.shutdown()

    def check_health(self) -> None:
        """Raise WorkerError once a tensor-parallel rank has failed, died or hung; an idle
        engine asks now and then, so that it fails (and /health with it) without waiting for a
        request."""
        self.runner.check_health()

    def kv_cache_bytes_per_token(self) -> int:
        """What one token's K/V (or MLA latent) costs over every attention layer, in the
        cache's layout (0 without attention layers)."""
        layout = self.runner.kv_layout
        if layout is None:
            return 0
        return layout.bytes_per_block * len(layout.groups) // self.runner.block_size
