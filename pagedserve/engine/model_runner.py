"""ModelRunner: binds the attention backend to the model, owns the KV cache, turns a
SchedulerOutput into one forward pass and samples the next tokens.

Per-request state lives in persistent rows (token ids, block table) so that a step gathers
with index arrays instead of rebuilding Python lists: a decode step's host work is O(batch).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.attention import (
    AttentionLayerConfig,
    BuilderConfig,
    select_backend,
)
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.attention.layer import Attention
from pagedserve.attention.mamba import MambaLayer
from pagedserve.attention.registry import get_backend_cls
from pagedserve.config import EngineConfig
from pagedserve.engine.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    distinct_params,
)
from pagedserve.kv_cache import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedserve.kv_cache.specs import (
    bytes_per_block,
    gpu_kv_cache_budget,
    num_blocks_for_budget,
)
from pagedserve.scheduler import BlockTable, CommonMetadataBuilder, Request, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: np.ndarray  # [B] in batch order
    # Sampled-token logprobs and top alternatives, [B, K+1], when a request asked for them.
    logprobs: LogprobsTensors | None = None
    # request id -> logprobs of the prompt tokens this step predicted (rows in prompt order).
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    # request id -> full next-token log-distribution [V] of a teacher-forced request.
    forced_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    # request id -> (first position p, float32 [rows, V] on the CPU): the full log-distributions
    # this step computed at prompt positions p, p+1, ... of a request scored by prefill.
    score_logprobs: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass
class PendingStep:
    """A launched step whose samples may still be on their way to the host."""

    batch: SchedulerOutput
    rows: np.ndarray
    out: SamplerOutput
    host_copy: tuple[np.ndarray, torch.cuda.Event | None]  # (host view, copy done event)
    # Each row's owner at launch (InputRows.generation): a row freed and handed to a new request
    # before this step's samples are recorded must not take them.
    generations: np.ndarray
    logprobs: LogprobsTensors | None  # on the host once host_copy's event has fired
    forced: dict[str, torch.Tensor] = field(default_factory=dict)
    forced_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    score_logprobs: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    sampled: np.ndarray | None = None  # set once the samples are on the host


class InputRows:
    """Row bookkeeping: each live request owns a row of the token table and the block table."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_seq: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = BlockTable(max_num_reqs, max_blocks_per_seq)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.max_model_len = max_model_len
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)  # bumped when a row changes hands

    def add(self, request: Request, block_ids: list[int]) -> int:
        row = self._free_rows.pop()
        self.row_of[request.request_id] = row
        self.generation[row] += 1
        self.token_ids[row, :request.num_tokens] = request.all_token_ids
        self.block_table.add_row(row, block_ids)
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, vocab_size: int,
                 max_model_len: int, eos_token_id: int | None) -> None:
        self.config = config
        self.device = config.torch_device
        self.model = model
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.dtype = next(model.parameters()).dtype
        cache = config.cache
        self.block_size = cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)

        self.attn_layers = sorted((m for m in model.modules() if isinstance(m, Attention)),
                                  key=lambda m: m.layer_idx)
        if [m.layer_idx for m in self.attn_layers] != list(range(len(self.attn_layers))):
            raise ValueError("attention layer indices must be 0..N-1")
        layer_configs = [m.config(self.dtype, cache.kv_cache_dtype) for m in self.attn_layers]
        self.mamba_layers = sorted((m for m in model.modules() if isinstance(m, MambaLayer)),
                                   key=lambda m: m.layer_idx)
        self.backend = (self._mamba_backend() if self.mamba_layers else
                        select_backend(config.attention_backend, self.device, layer_configs,
                                       self.block_size))
        bind_preset = getattr(self.backend, "for_preset", None)
        if bind_preset is not None:  # a cache whose layout depends on kv_cache_dtype
            self.backend = bind_preset(cache.kv_cache_dtype)
        logger.info("attention backend: %s (%s)", self.backend.get_name(),
                    self.backend.is_available()[1])
        self.kv_cache_dtype = self.backend.get_kv_cache_dtype(cache.kv_cache_dtype, self.dtype)
        impl_cls = self.backend.get_impl_cls()
        for layer, layer_cfg in zip(self.attn_layers, layer_configs, strict=True):
            layer.bind(impl_cls(layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads,
                                layer.sliding_window, layer.logits_soft_cap,
                                cache.kv_cache_dtype), layer_cfg)
        self.builders = {cfg: self.backend.get_builder_cls()(self._builder_config(cfg))
                         for cfg in dict.fromkeys(layer_configs)}
        self.kv_specs = [self._spec(cfg) for cfg in layer_configs]
        if self.mamba_layers:
            self._bind_mamba_layers()

        self.rows = InputRows(self.max_num_reqs, max_model_len, self.max_blocks_per_seq)
        self.common_builder = CommonMetadataBuilder(self.max_num_reqs, self.max_num_tokens,
                                                    self.max_blocks_per_seq, self.block_size,
                                                    self.device)
        pin = self.device.type == "cuda"
        self._input_ids_host = torch.zeros(self.max_num_tokens, dtype=torch.int64, pin_memory=pin)
        self._input_ids = self._input_ids_host if not pin else torch.zeros_like(
            self._input_ids_host, device=self.device)
        self.sampler = Sampler()
        # The launched step not yet collected, and two pinned buffers for sampled ids (a
        # step's copy is read after the next step has been launched).
        self._in_flight: PendingStep | None = None
        self._host_parity = 0
        self._sampled_host = [torch.zeros(self.max_num_reqs, dtype=torch.int64,
                                          pin_memory=pin) for _ in range(2 if pin else 0)]
        self._copied = [torch.cuda.Event() for _ in range(2 if pin else 0)]
        # Recorded once a step's host->device input copies are queued: the next step rewrites
        # the same pinned buffers only after they have been read (with a step in flight they
        # may not have been yet).
        self._inputs_copied = torch.cuda.Event() if pin else None
        # Where a step's previous samples still on the device go, for n of them: [0, n) the
        # indices into this step's input ids, [n, 2n) the previous step's sample rows. Flat, so
        # one contiguous pinned copy carries both.
        self._patch_host = torch.zeros(2 * self.max_num_reqs, dtype=torch.int64,
                                       pin_memory=pin)
        self._patch = (self._patch_host if not pin else
                       torch.zeros_like(self._patch_host, device=self.device))
        self._row_in_prev = np.full(self.max_num_reqs, -1, dtype=np.int64)
        self.generators: dict[str, torch.Generator] = {}
        # Live requests that need more than the sampled token (teacher forcing, prompt
        # logprobs, scoring by prefill): a step looks for them only while there are any.
        self._wants_logits: set[str] = set()
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.decode_graphs = None  # engine.cuda_graphs.DecodeGraphs once captured
        self._ran_graph = False
        self._common = None  # the last step's CommonAttentionMetadata
        # Set to a list to record every step's (num_computed, num_scheduled, num_prefills,
        # ran as a graph) for benchmarks' floors.
        self.step_log: list[tuple[np.ndarray, np.ndarray, int, bool]] | None = None
        # Set to a list to record CUDA events around each step's device work, from its
        # forward (after the host has built the step's metadata) to its samples' copy: the
        # gaps between steps are the device waiting for the host.
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    def _builder_config(self, cfg: AttentionLayerConfig) -> BuilderConfig:
        return BuilderConfig(cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.dtype,
                             self.block_size, self.max_num_reqs, self.max_num_tokens,
                             self.max_blocks_per_seq, self.device, cfg.sliding_window,
                             cfg.logits_soft_cap, cfg.kv_cache_dtype)

    def _spec(self, cfg: AttentionLayerConfig) -> KVCacheSpec:
        page_bytes = self.backend.get_page_size_bytes(self.block_size, cfg.num_kv_heads,
                                                      cfg.head_size, self.kv_cache_dtype)
        if cfg.sliding_window is not None:
            return SlidingWindowSpec(self.block_size, cfg.num_kv_heads, cfg.head_size,
                                     self.kv_cache_dtype, page_bytes,
                                     sliding_window=cfg.sliding_window)
        return FullAttentionSpec(self.block_size, cfg.num_kv_heads, cfg.head_size,
                                 self.kv_cache_dtype, page_bytes)

    # ---- Mamba layers: a state slot per request instead of KV blocks ----------------------

    def _mamba_backend(self) -> type:
        if self.attn_layers:
            raise ValueError("models mixing attention and Mamba layers are not supported yet")
        if self.config.attention_backend not in (None, "MAMBA", "mamba"):
            logger.info("a Mamba model always uses the MAMBA backend; attention_backend=%s "
                        "does not apply", self.config.attention_backend)
        return get_backend_cls("MAMBA")

    def _bind_mamba_layers(self) -> None:
        """One state slot per request: the slot id is the request's only "block" (block_size =
        max_model_len), so it reaches the MAMBA builder in the block table's first column."""
        from pagedserve.attention.backends.mamba import use_triton_kernels

        if [m.layer_idx for m in self.mamba_layers] != list(range(len(self.mamba_layers))):
            raise ValueError("mamba layer indices must be 0..N-1")
        self.block_size = self.max_model_len
        self.max_blocks_per_seq = 1
        triton = use_triton_kernels(self.device)
        self.kv_specs = [m.spec(self.dtype) for m in self.mamba_layers]
        self.builders = {spec: self.backend.get_builder_cls()(spec, self.device, triton)
                         for spec in dict.fromkeys(self.kv_specs)}
        for layer, spec in zip(self.mamba_layers, self.kv_specs, strict=True):
            layer.bind(self.backend.get_impl_cls()(triton), spec)

    def _allocate_state_slots(self, num_slots: int) -> None:
        self.kv_caches = []
        for spec in self.kv_specs:
            conv_shape, ssm_shape = self.backend.get_state_shapes(num_slots, spec)
            self.kv_caches.append((
                torch.zeros(conv_shape, dtype=spec.dtype, device=self.device),
                torch.zeros(ssm_shape, dtype=spec.ssm_dtype, device=self.device)))
        self.num_blocks = num_slots

    # ---- KV cache sizing ----------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type != "cuda":
            num_blocks = num_blocks_for_budget(self.kv_specs, int(cache.kv_cache_memory))
        else:
            peak = self.profile_peak_memory()
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = gpu_kv_cache_budget(total, peak, cache.gpu_memory_utilization)
            num_blocks = num_blocks_for_budget(self.kv_specs, budget)
        # A state slot serves one running request: slots beyond max_num_seqs would sit idle.
        return min(num_blocks, self.max_num_reqs) if self.mamba_layers else num_blocks

    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Peak bytes in use during a forward over the largest batch the scheduler can form,
        with a KV cache just big enough for it (weights included)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.max_num_tokens, self.max_model_len)
        needed = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(needed)
        probe = Request("__profile__", [0] * num_tokens, None)
        rows = InputRows(1, self.max_model_len, self.max_blocks_per_seq)
        rows.add(probe, list(range(needed)))
        batch = SchedulerOutput([probe], np.array([num_tokens], dtype=np.int32),
                                np.zeros(1, dtype=np.int32), [list(range(needed))], [False], 1,
                                np.ones(1, dtype=bool))
        saved, self.rows = self.rows, rows
        try:
            hidden = self._forward(batch)
            self.model.compute_logits(hidden[-self.max_num_reqs:])
            torch.cuda.synchronize(self.device)
        finally:
            self.rows = saved
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        # The cache we just used counts against the peak but will be allocated anew.
        return peak - needed * bytes_per_block(self.kv_specs)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.mamba_layers:
            return self._allocate_state_slots(num_blocks)
        self.kv_caches = []
        for spec in self.kv_specs:
            shape = self.backend.get_kv_cache_shape(num_blocks, self.block_size,
                                                    spec.num_kv_heads, spec.head_size)
            self.kv_caches.append(torch.zeros(shape, dtype=self.kv_cache_dtype,
                                              device=self.device))
        self.num_blocks = num_blocks

    # ---- one step -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        seed = getattr(request.sampling_params, "seed", None)
        if seed is not None:
            self.generators[request.request_id] = torch.Generator(self.device).manual_seed(seed)
        if (request.forced_output_ids is not None or request.score_from is not None
                or getattr(request.sampling_params, "prompt_logprobs", None) is not None):
            self._wants_logits.add(request.request_id)

    def finish_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self._wants_logits.discard(request_id)

    def _update_rows(self, batch: SchedulerOutput) -> np.ndarray:
        for request_id in batch.freed_request_ids:
            self.rows.remove(request_id)
        rows = np.empty(batch.num_reqs, dtype=np.int64)
        for i, (request, block_ids, is_new) in enumerate(
                zip(batch.requests, batch.new_block_ids, batch.is_new, strict=True)):
            if is_new:
                rows[i] = self.rows.add(request, block_ids)
            else:
                rows[i] = self.rows.row_of[request.request_id]
                self.rows.block_table.append(int(rows[i]), block_ids)
        return rows

    def _forward(self, batch: SchedulerOutput, rows: np.ndarray | None = None,
                 prev: PendingStep | None = None) -> torch.Tensor:
        """Build the step's inputs and queue its forward. `prev`: the step still in flight,
        whose samples are some of this step's input ids (they are placed on the device)."""
        if rows is None:
            rows = np.arange(batch.num_reqs)
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()  # the last step's copies have read the buffers
        self._common = common = self.common_builder.build(
            rows, batch.num_computed_tokens, batch.num_scheduled_tokens, batch.num_prefills,
            self.rows.block_table, batch.context_written_in_step)
        t = common.num_actual_tokens
        positions_np = self.common_builder.np["positions"][:t]
        token_rows = np.repeat(rows, batch.num_scheduled_tokens)
        host_ids = self._input_ids_host[:t].numpy()
        np.take(self.rows.token_ids.reshape(-1), token_rows * self.max_model_len + positions_np,
                out=host_ids)
        input_ids = self._input_ids[:t]
        if input_ids is not self._input_ids_host[:t]:
            input_ids.copy_(self._input_ids_host[:t], non_blocking=True)
        num_patched = self._queue_patch(prev, batch, rows, common) if prev is not None else 0
        graph_size = self.decode_graphs.prepare(common) if self.decode_graphs else None
        attn_metadata = None
        if graph_size is None:
            attn_metadata = {cfg: b.build(common) for cfg, b in self.builders.items()}
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        if self.step_events is not None:
            self.step_events.append((torch.cuda.Event(enable_timing=True),
                                     torch.cuda.Event(enable_timing=True)))
            self.step_events[-1][0].record()
        if num_patched:
            dst, src = self._patch[:num_patched], self._patch[num_patched:2 * num_patched]
            self._input_ids.index_copy_(0, dst, prev.out.sampled_token_ids.index_select(0, src))
        if graph_size is not None:
            self._ran_graph = True
            return self.decode_graphs.replay(graph_size, common.num_reqs)
        with set_forward_context(attn_metadata, self.kv_caches):
            return self.model(input_ids, common.positions)

    def _queue_patch(self, prev: PendingStep, batch: SchedulerOutput, rows: np.ndarray,
                     common) -> int:
        """Copy to the device the pairs (input index, previous sample row) of the requests whose
        first new token this step is the one the previous step sampled; returns their count.
        A request new in this step may sit in a row a finished one used: it is never patched."""
        prev_batch = prev.batch
        self._row_in_prev[prev.rows] = np.arange(len(prev.rows))
        j = self._row_in_prev[rows]
        self._row_in_prev[prev.rows] = -1
        prev_seq = prev_batch.num_computed_tokens + prev_batch.num_scheduled_tokens
        jj = np.maximum(j, 0)
        take = ((j >= 0) & ~np.asarray(batch.is_new, dtype=bool) & prev_batch.will_sample[jj]
                & (prev_seq[jj] == batch.num_computed_tokens))
        n = int(take.sum())
        if n:
            host = self._patch_host.numpy()
            host[:n] = common.query_start_loc_cpu[:-1][take]
            host[n:2 * n] = j[take]
            if self._patch is not self._patch_host:
                self._patch[:2 * n].copy_(self._patch_host[:2 * n], non_blocking=True)
        return n

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """One step, synchronously: launch it and wait for its samples."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput) -> PendingStep:
        """Queue one step's forward and sampling on the device and return at once; `collect`
        waits for its samples. With async scheduling the engine launches step N+1 before it
        collects step N: N's samples, N+1's input ids, go from N's output into N+1's inputs
        on the device, so the host never waits for N here."""
        prev = self._in_flight
        if prev is not None and prev.sampled is not None:
            prev = None  # its samples are in the token table already
        rows = self._update_rows(batch)
        meta = self._sampling_metadata(batch)
        self._ran_graph = False
        hidden = self._forward(batch, rows, prev)
        if self.step_log is not None:
            self.step_log.append((batch.num_computed_tokens.copy(),
                                  batch.num_scheduled_tokens.copy(), batch.num_prefills,
                                  self._ran_graph))
        # Each request's last new token, from the step's cu_seqlens already on the device.
        last = self._common.query_start_loc[1:].long() - 1
        logits = self.model.compute_logits(hidden[last])
        out = self.sampler(logits, meta)
        host_copy, logprobs = self._copy_to_host(out)
        if self.step_events is not None:
            self.step_events[-1][1].record()
        pending = PendingStep(batch, rows, out, host_copy, self.rows.generation[rows],
                              logprobs)
        if self._wants_logits:
            index = [i for i, r in enumerate(batch.requests)
                     if r.request_id in self._wants_logits]
            pending.forced, pending.forced_tokens = self._forced_logprobs(batch, index, logits)
            pending.prompt_logprobs, pending.score_logprobs = self._prompt_position_logprobs(
                batch, index, hidden)
        self._in_flight = pending
        return pending

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """The samples (and logprobs) of a launched step, waiting for them if need be."""
        self._record_samples(pending)
        if self._in_flight is pending:
            self._in_flight = None
        return ModelRunnerOutput(pending.sampled, pending.logprobs, pending.prompt_logprobs,
                                 pending.forced, pending.score_logprobs)

    def _copy_to_host(self, out: SamplerOutput
                      ) -> tuple[tuple[np.ndarray, torch.cuda.Event | None],
                                 LogprobsTensors | None]:
        """Start the copies of a step's sampled ids (and logprobs) to the host, without waiting:
        on CUDA into pinned memory, with an event after them. The ids go into one of two
        buffers: a step's is read when it is collected, before the step after next is
        launched, so two suffice."""
        sampled = out.sampled_token_ids
        lp = None
        if out.logprobs is not None:
            lp = LogprobsTensors(out.logprobs, out.logprob_token_ids, out.sampled_token_ranks)
        if sampled.device.type != "cuda":
            return (sampled.numpy(), None), lp
        if lp is not None:  # pinned blocks from torch's caching host allocator
            lp = LogprobsTensors(*(torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                   .copy_(t, non_blocking=True) for t in lp))
        self._host_parity ^= 1
        host = self._sampled_host[self._host_parity][:sampled.shape[0]]
        host.copy_(sampled, non_blocking=True)
        event = self._copied[self._host_parity]
        event.record()
        return (host.numpy(), event), lp

    def _record_samples(self, pending: PendingStep) -> None:
        """Once per step: wait for its samples, put teacher-forced tokens in their place, and
        write each sampling request's new token into its row of the token table."""
        if pending.sampled is not None:
            return
        host, event = pending.host_copy
        if event is not None:
            event.synchronize()
        sampled = host.copy()
        batch, rows = pending.batch, pending.rows
        for i, token in pending.forced_tokens.values():
            sampled[i] = token
        seq_lens = batch.num_computed_tokens + batch.num_scheduled_tokens
        done = batch.will_sample & (seq_lens < self.max_model_len)
        # With a step in flight a row can change hands: its request finished, was aborted (a
        # new request's prompt is in the row now) or was preempted and readmitted (its row is
        # another, or the same one re-filled). The sample goes to the request's current row.
        moved = self.rows.generation[rows] != pending.generations
        if moved.any():
            rows = rows.copy()
            for i in np.flatnonzero(moved & done):
                rows[i] = self.rows.row_of.get(batch.requests[i].request_id, -1)
            done &= rows >= 0
        self.rows.token_ids[rows[done], seq_lens[done]] = sampled[done]
        pending.sampled = sampled

    @staticmethod
    def _forced_logprobs(batch: SchedulerOutput, index: list[int], logits: torch.Tensor
                         ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
        """Teacher forcing for the scoring requests among `index`: the full next-token
        distribution at each forced position, and (batch index, token) to emit. The engine
        runs such requests without async scheduling, so their outputs so far are all on the
        host."""
        index = [i for i in index
                 if batch.requests[i].forced_output_ids is not None and batch.will_sample[i]]
        if not index:
            return {}, {}
        logprobs = torch.log_softmax(logits[index].float(), dim=-1).cpu()
        result, tokens = {}, {}
        for j, i in enumerate(index):
            request = batch.requests[i]
            tokens[request.request_id] = (i, request.forced_output_ids[request.num_output_tokens])
            result[request.request_id] = logprobs[j]
        return result, tokens

    def _sampling_metadata(self, batch: SchedulerOutput) -> SamplingMetadata:
        requests = batch.requests
        generators = {i: self.generators[r.request_id] for i, r in enumerate(requests)
                      if r.request_id in self.generators} if self.generators else {}
        params = [r.sampling_params for r in requests]
        distinct = distinct_params(params)
        needs_tokens = any(p.repetition_penalty != 1.0 or p.presence_penalty
                           or p.frequency_penalty or p.min_tokens for p in distinct[0])
        prompts = [r.prompt_token_ids for r in requests] if needs_tokens else [[]] * len(params)
        outputs = [r.output_token_ids for r in requests] if needs_tokens else [[]] * len(params)
        return SamplingMetadata.build(params, prompts, outputs, generators, self.eos_token_id,
                                      self.vocab_size, self.device, distinct)

    def _prompt_position_logprobs(
        self, batch: SchedulerOutput, index: list[int], hidden: torch.Tensor
    ) -> tuple[dict[str, LogprobsTensors], dict[str, tuple[int, torch.Tensor]]]:
        """For the requests among `index` that asked, from the logits of their chunk's prompt
        positions (position p predicts prompt token p + 1):
        - prompt logprobs: the logprobs of those prompt tokens (top `prompt_logprobs` beside);
        - scoring by prefill (`score_from` set): (first position, the full log-distributions
          at positions score_from..num_prompt_tokens-2 in this chunk).
        The head runs over the whole chunk, as transformers' forward does over the sequence:
        the same matmul shape, so the same rounding."""
        prompt_lp: dict[str, LogprobsTensors] = {}
        scores: dict[str, tuple[int, torch.Tensor]] = {}
        starts = np.cumsum(batch.num_scheduled_tokens) - batch.num_scheduled_tokens
        for i in index:
            request = batch.requests[i]
            c, n = int(batch.num_computed_tokens[i]), int(batch.num_scheduled_tokens[i])
            end = min(c + n, request.num_prompt_tokens - 1)  # [c, end) predict prompt tokens
            k = getattr(request.sampling_params, "prompt_logprobs", None)
            lo = c if request.score_from is None else max(c, request.score_from)
            wants_scores = request.score_from is not None and lo < end
            if not (wants_scores or (k is not None and c < end)):
                continue
            logits = self.model.compute_logits(hidden[int(starts[i]):int(starts[i]) + n])
            if k is not None and c < end:
                targets = torch.tensor(request.prompt_token_ids[c + 1:end + 1],
                                       device=self.device)
                lp = compute_prompt_logprobs(logits[:end - c], targets, k)
                prompt_lp[request.request_id] = LogprobsTensors(*(t.cpu() for t in lp))
            if wants_scores:
                scores[request.request_id] = (
                    lo, torch.log_softmax(logits[lo - c:end - c].float(), -1).cpu())
        return prompt_lp, scores

    def warmup(self) -> None:
        """Compile/JIT whatever the backend needs before the first request."""
        t0 = time.perf_counter()
        for builder in self.builders.values():
            warm = getattr(builder, "warmup", None)
            if warm is not None:
                warm()
        logger.debug("backend warm-up took %.1f s", time.perf_counter() - t0)
        from pagedserve.engine.cuda_graphs import setup_decode_graphs

        self.decode_graphs = setup_decode_graphs(self)
