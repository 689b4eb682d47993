"""Continuous batching: FCFS admission under seat and token budgets, chunked prefill, and
preemption by recompute when the KV pool runs out."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Iterable

import numpy as np

from pagedserve.config import DEFAULT_STEP_TOKENS, SchedulerConfig
from pagedserve.kv_cache import KVCacheManager
from pagedserve.multimodal.encoder_cache import EncoderCacheManager, check_encoder_budget
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.spec_decode.metrics import SpecDecodeStats
from pagedserve.spec_decode.proposer import Drafts

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, num_speculative_tokens: int = 0,
                 draft_has_kv: bool = False, disable_by_batch_size: int | None = None) -> None:
        if config.max_num_batched_tokens is None:  # a bare SchedulerConfig (tests, benchmarks)
            config = dataclasses.replace(config, max_num_batched_tokens=DEFAULT_STEP_TOKENS)
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._freed_ids: list[str] = []
        self.num_preemptions = 0
        # Speculative decoding's acceptance counters (None: off).
        self.spec_stats = (SpecDecodeStats(num_speculative_tokens)
                           if num_speculative_tokens else None)
        # A draft model writes its K/V up to K - 1 positions past a step's last token while it
        # proposes: each allocation reserves K slots more (within max_model_len).
        self.lookahead = num_speculative_tokens if draft_has_kv else 0
        # Drafts are verified only while fewer requests than this run (None: always).
        self.disable_by_batch_size = disable_by_batch_size
        self._drafting = False  # this step's: decided once, as it starts
        # The last completed step's drafts, given to its requests as the next step starts.
        self._pending_drafts: tuple[SchedulerOutput, Drafts] | None = None
        # LoRA's cap on distinct adapters per step (pagedserve.lora.step_cap; None: LoRA off).
        self.lora_cap = None
        # Images: the encoder cache's budget (multimodal.encoder_cache; None: a text model).
        self.encoder_cache: EncoderCacheManager | None = None

    @property
    def speculating(self) -> bool:
        """Whether the next step may verify drafts. Drafts follow each step's kept tokens, read
        on the host: the engine then completes each step before scheduling the next (a verify
        step in flight would leave the next one's positions unknown)."""
        limit = self.disable_by_batch_size
        return self.spec_stats is not None and (limit is None or len(self.running) < limit)

    # ---- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        worst_case = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        # Over every KV cache group: a sliding-window group needs only its window's blocks.
        needed = self.kv.blocks_needed(worst_case, self.config.max_num_batched_tokens)
        if needed > self.kv.num_blocks:
            groups = (f" ({needed} blocks over {self.kv.num_groups} cache groups)"
                      if self.kv.num_groups > 1 else "")
            raise ValueError(
                f"request {request.request_id!r} may need {worst_case} tokens of KV cache"
                f"{groups} but the pool holds only {self.kv.num_blocks * self.kv.block_size}: "
                "raise the KV cache memory or lower max_tokens")
        if request.mm_features:
            if self.encoder_cache is None:
                raise ValueError(f"request {request.request_id!r} has images, but this model "
                                 "takes none")
            ec = self.encoder_cache
            check_encoder_budget(request.mm_features, ec.cache_size, ec.compute_budget,
                                 ec.span_limit)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (stop string) or abort requests wherever they are; unknown ids are ignored so
        an abort racing a normal finish is harmless. Their blocks are freed at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.mm_features:
            self.encoder_cache.release(request)
        self.kv.free(request)
        self.kv.forget(request)
        del self.requests[request.request_id]
        request.grammar = None  # frees its matcher now (a slot in a grammar worker)
        self._freed_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step. A request's scheduled tokens count as computed from here on (their
        K/V is written by the step), and a step that reaches the end of a request's sequence
        leaves a placeholder for its sample, so with async scheduling the following step can be
        scheduled before this one's samples are back (the runner puts them into the next
        step's inputs before launching it)."""
        self._keep_pending_drafts()
        budget = self.config.max_num_batched_tokens
        self._drafting = self.speculating
        step = _StepPlan()
        num_preempted = 0
        kv = self.kv
        kv.begin_step()
        no_blocks = kv.no_blocks
        max_model_len = self.max_model_len
        add_request, add_num_new = step.requests.append, step.num_new.append
        add_computed, add_sample = step.computed.append, step.samples.append
        add_block_ids, add_is_new = step.block_ids.append, step.is_new.append
        lora_cap = self.lora_cap
        if lora_cap is not None:
            lora_cap.begin()
        encoder_cache = self.encoder_cache
        if encoder_cache is not None:
            encoder_cache.begin_step()

        # Running requests first (decodes and unfinished prompt chunks), in admission order.
        # The per-request work of a long batch of decodes lives here: kept flat on purpose.
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            request = running[i]
            if lora_cap is not None and not lora_cap.admits(request.lora_int_id):
                i += 1  # its adapter has no slot this step: the next one
                continue
            pending = request.num_output_placeholders
            if pending and (request.num_output_tokens + pending >= request.max_tokens
                            or request.num_tokens + pending >= max_model_len):
                i += 1  # its in-flight sample is its last: another step would be wasted
                continue
            num_new = min(request.num_tokens + pending - request.num_computed_tokens, budget)
            to_encode = None
            if (encoder_cache is not None and request.mm_features  # (text models: no look)
                    and request.num_computed_tokens < request.mm_features[-1].placeholder.end):
                # a prompt chunk that may reach an image
                num_new, to_encode = encoder_cache.plan(request, request.num_computed_tokens,
                                                        num_new)
                if not num_new:
                    i += 1  # its next image must wait for a step with room for its encoder
                    continue
            drafts = request.spec_token_ids
            if drafts:  # its last verified token, then as many drafts as fit (used once)
                request.spec_token_ids = []
                drafts = self._fit_drafts(request, drafts, budget - num_new)
                num_new += len(drafts)
            slots = (num_new + self._lookahead(request.num_computed_tokens + num_new)
                     if self.lookahead else num_new)
            blocks = kv.allocate_slots(request, slots)
            while blocks is None:
                victim = running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
                blocks = kv.allocate_slots(request, slots)
            if blocks is None:
                break
            if to_encode is not None:
                step.add_images(request, to_encode, request.num_computed_tokens, num_new,
                                encoder_cache)
            # _StepPlan.add, inlined for the hot loop.
            computed = request.num_computed_tokens
            sample = computed + num_new >= request.num_tokens + pending
            request.num_computed_tokens = computed + num_new
            request.num_output_placeholders = pending + sample
            add_request(request)
            add_num_new(num_new)
            add_computed(computed)
            add_sample(sample)
            # No new block (most decodes): the manager's shared empty lists, one per group.
            add_block_ids(blocks if blocks is no_blocks
                          else tuple([b.block_id for b in group] for group in blocks))
            add_is_new(False)
            if drafts:
                step.drafts[len(step.requests) - 1] = drafts
            budget -= num_new
            i += 1

        # Then admit waiting requests, FCFS, unless this step had to preempt.
        context_written_in_step = False
        while (not num_preempted and self.waiting and budget > 0
               and len(running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if lora_cap is not None and not lora_cap.admits(request.lora_int_id):
                break  # FCFS: it and those behind it wait for a step with a free slot
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if request.pooling is not None and num_new < request.num_tokens:
                break  # a pooling request runs whole: it waits for a step with room for it
            to_encode = None
            if encoder_cache is not None and request.mm_features:
                num_new, to_encode = encoder_cache.plan(request, num_hit_tokens, num_new)
                if not num_new:
                    break  # FCFS: its first image waits for a step with room for its encoder
            slots = num_new + self._lookahead(num_hit_tokens + num_new) if self.lookahead \
                else num_new
            blocks = kv.allocate_slots(request, slots, hits)
            if blocks is None:
                break
            kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            if hits and kv.written_in_step(hits):
                context_written_in_step = True
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if to_encode is not None:
                step.add_images(request, to_encode, num_hit_tokens, num_new, encoder_cache)
            running.append(request)
            step.add(request, num_new, kv.group_block_ids(request.request_id), True)
            budget -= num_new

        # An empty step is not launched: its freed requests wait for the next step (the runner
        # gives back their rows when it sees them).
        freed: list[str] = []
        if step.requests:
            freed, self._freed_ids = self._freed_ids, []
            if encoder_cache is not None:
                step.free_encoder_identifiers = encoder_cache.take_freed()
        return step.output(freed, num_preempted, context_written_in_step)

    def _lookahead(self, end: int) -> int:
        """Slots reserved past a step's tokens (which end at `end`) for a draft model's
        proposal steps."""
        return max(min(self.lookahead, self.max_model_len - end), 0)

    def _fit_drafts(self, request: Request, drafts: list[int], room: int) -> list[int]:
        """The drafts a decode can verify now: within the step's token budget, and leaving
        room for the token the target adds after them within max_tokens and max_model_len;
        under a grammar, the longest prefix of them it accepts (its matcher has accepted
        every output token: nothing is in flight). None while the request has a sample in
        flight (its drafts would follow a token not known yet)."""
        if (not self._drafting or request.num_output_placeholders
                or request.num_computed_tokens + 1 != request.num_tokens):
            return []
        limit = min(room, request.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
        drafts = drafts[:max(limit, 0)]
        if request.grammar is not None and drafts:
            drafts = drafts[:request.grammar.validate(drafts)]
        return drafts

    def _preempt(self, request: Request) -> None:
        """Recompute policy: drop the request's KV and put it back at the head of the queue; its
        output so far is kept and becomes part of the prompt it recomputes."""
        self.kv.free(request)
        if request.mm_features:
            self.encoder_cache.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._freed_ids.append(request.request_id)

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: np.ndarray,
                           drafts: Drafts | None = None) -> list[tuple[Request, int | None]]:
        """Give each request that sampled in this step its token (a partial prompt chunk's
        sample is discarded) and finish those that stop. Returns (request, new token or None)
        in batch order; finished requests are already freed. Requests finished while the step
        ran (aborted, or stopped by an earlier step with async scheduling) are skipped.

        With speculative decoding `sampled_token_ids` of a step that verified drafts is
        [B, Kmax+1], -1 past each request's kept tokens, and a request gets one entry per
        token kept (`_update_verified`); `drafts` are the proposer's for the next step."""
        if sampled_token_ids.ndim == 2:
            results = self._update_verified(output, sampled_token_ids)
        else:
            results = self._update_sampled(output, sampled_token_ids)
        if drafts is not None:
            # Kept as they are until the next schedule(): drafts still on the device arrive
            # while the engine records this step's outputs (and the front processes them).
            self._keep_pending_drafts()
            self._pending_drafts = (output, drafts)
        return results

    def _keep_pending_drafts(self) -> None:
        if self._pending_drafts is not None:
            pending, self._pending_drafts = self._pending_drafts, None
            self._keep_drafts(*pending)

    def _update_sampled(self, output: SchedulerOutput,
                        sampled_token_ids: np.ndarray) -> list[tuple[Request, int | None]]:
        results: list[tuple[Request, int | None]] = []
        block_size = self.kv.block_size
        cache_computed_blocks = self.kv.cache_computed_blocks
        max_model_len = self.max_model_len
        for request, sampled, token in zip(output.requests, output.will_sample.tolist(),
                                           sampled_token_ids.tolist(), strict=True):
            if request.status.is_finished:
                continue
            if not sampled:
                results.append((request, None))
                continue
            # A request preempted after this step was scheduled still gets its token: the
            # step saw its whole context.
            request.num_output_placeholders -= 1
            request.append_output_token(token)
            if request.grammar is not None and not request.grammar.accept(
                    token, request.num_output_tokens - 1):
                logger.error("request %s: its grammar refused sampled token %d; it ends here",
                             request.request_id, token)
            if request.num_tokens % block_size == 0:  # the token may complete a block
                cache_computed_blocks(request)
            status = request.check_stop(max_model_len)
            if status is not None:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self._finish(request, status)
            results.append((request, token))
        return results


    def _update_verified(self, output: SchedulerOutput,
                         sampled: np.ndarray) -> list[tuple[Request, int | None]]:
        """A verify step: each request keeps its accepted drafts and the target's token after
        them, and its rejected drafts are rolled back from num_computed_tokens (their K/V
        slots are rewritten by its next step; only verified blocks are published)."""
        results: list[tuple[Request, int | None]] = []
        counts = (sampled >= 0).sum(axis=1)
        num_drafts = (output.num_draft_tokens if output.num_draft_tokens is not None
                      else np.zeros(len(counts), dtype=np.int32))
        kept = np.where(output.will_sample, counts - 1, 0)
        if self.spec_stats is not None:
            self.spec_stats.observe(num_drafts[output.will_sample], kept[output.will_sample])
        rows = sampled.tolist()
        for i, (request, sampled_here) in enumerate(zip(output.requests,
                                                        output.will_sample.tolist(),
                                                        strict=True)):
            if request.status.is_finished:
                continue
            if not sampled_here:
                results.append((request, None))
                continue
            request.num_output_placeholders -= 1
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens -= int(num_drafts[i]) - int(kept[i])
            for token in rows[i][:int(counts[i])]:
                request.append_output_token(token)
                if request.grammar is not None and not request.grammar.accept(
                        token, request.num_output_tokens - 1):
                    logger.error("request %s: its grammar refused sampled token %d; it ends "
                                 "here", request.request_id, token)
                results.append((request, token))
                status = request.check_stop(self.max_model_len)
                if status is not None:  # the tokens after it are dropped
                    if request.status == RequestStatus.RUNNING:
                        self.running.remove(request)
                    else:
                        self.waiting.remove(request)
                    self._finish(request, status)
                    break
            else:
                self.kv.cache_verified_blocks(request)
        return results

    def _keep_drafts(self, output: SchedulerOutput, drafts: Drafts) -> None:
        """Each live request's drafts for its next step (none for the ones that got none, or
        finished since): drafts still on the device (`Drafts.pending`) are waited for here."""
        for i in np.flatnonzero(drafts.counts).tolist():
            request = output.requests[i]
            if not request.status.is_finished and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = drafts.row(i)
        if self.spec_stats is not None:  # (the wait included)
            self.spec_stats.propose_seconds += drafts.seconds


class _StepPlan:
    """The requests of the step being scheduled, with what the runner needs of each; each one
    added counts its new tokens as computed and takes a placeholder when the step samples for
    it."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.num_new: list[int] = []
        self.computed: list[int] = []
        self.samples: list[bool] = []
        self.block_ids: list[tuple[list[int], ...]] = []
        self.is_new: list[bool] = []
        self.drafts: dict[int, list[int]] = {}  # index in `requests` -> drafts scheduled
        # Images: request id -> indices of its images encoded this step; whether the step's
        # tokens include image placeholders; the encoder cache's evictions since the last step.
        self.encoder_inputs: dict[str, list[int]] = {}
        self.embeds_images = False
        self.free_encoder_identifiers: list[str] = []

    def add_images(self, request: Request, to_encode: list[int], start: int, num_new: int,
                   encoder_cache: EncoderCacheManager) -> None:
        """A request whose chunk start..start+num_new-1 may reach its images."""
        encoder_cache.commit(request, to_encode, start, num_new)
        if to_encode:
            self.encoder_inputs[request.request_id] = to_encode
        end = start + num_new
        if not self.embeds_images:
            self.embeds_images = any(f.placeholder.offset < end and f.placeholder.end > start
                                     for f in request.mm_features)

    def add(self, request: Request, num_new: int, block_ids: tuple[list[int], ...],
            is_new: bool) -> None:
        computed = request.num_computed_tokens
        total = request.num_tokens + request.num_output_placeholders
        sample = computed + num_new >= total
        request.num_computed_tokens = computed + num_new
        request.num_output_placeholders += sample
        self.requests.append(request)
        self.num_new.append(num_new)
        self.computed.append(computed)
        self.samples.append(sample)
        self.block_ids.append(block_ids)
        self.is_new.append(is_new)

    def output(self, freed: list[str], num_preempted: int,
               context_written_in_step: bool) -> SchedulerOutput:
        """The step in batch order: prefills (more than one new token) first, then decodes."""
        num_new = np.array(self.num_new, dtype=np.int32)
        is_decode = num_new == 1
        num_prefills = len(num_new) - int(is_decode.sum())
        requests, block_ids, is_new = self.requests, self.block_ids, self.is_new
        computed = np.array(self.computed, dtype=np.int32)
        will_sample = np.array(self.samples, dtype=bool)
        num_drafts = draft_ids = None
        if self.drafts:
            num_drafts = np.zeros(len(num_new), dtype=np.int32)
            num_drafts[list(self.drafts)] = [len(d) for d in self.drafts.values()]
            draft_ids = [self.drafts.get(i, []) for i in range(len(num_new))]
        if is_decode[:num_prefills].any():  # a decode before a prefill: reorder
            order = np.argsort(is_decode, kind="stable")
            if num_drafts is not None:
                num_drafts = num_drafts[order]
                draft_ids = [draft_ids[i] for i in order.tolist()]
            num_new, computed, will_sample = num_new[order], computed[order], will_sample[order]
            index = order.tolist()
            requests = [requests[i] for i in index]
            block_ids = [block_ids[i] for i in index]
            is_new = [is_new[i] for i in index]
        return SchedulerOutput(
            requests=requests, num_scheduled_tokens=num_new, num_computed_tokens=computed,
            new_block_ids=block_ids, is_new=is_new, num_prefills=num_prefills,
            will_sample=will_sample, freed_request_ids=freed, num_preempted=num_preempted,
            context_written_in_step=context_written_in_step, num_draft_tokens=num_drafts,
            draft_token_ids=draft_ids, scheduled_encoder_inputs=self.encoder_inputs,
            embeds_images=self.embeds_images,
            free_encoder_identifiers=self.free_encoder_identifiers)
