"""ModelRunner: binds the attention backend to the model, owns the KV cache, turns a
SchedulerOutput into one forward pass and samples the next tokens.

Its parts live beside it: the persistent request rows and input ids (`input_batch`), the
cache's sizing and allocation (`kv_cache_setup`), the stand-in forwards before the first
request (`runner_warmup`), what a step keeps beyond samples for scoring and prompt logprobs
(`scoring`), decode and verify steps replayed from CUDA graphs (`cuda_graphs`,
`verify_graphs`), the other steps' piecewise graphs (`piecewise_graphs`), and the packages it
calls for drafts (`spec_decode`, `attention/state_verify`), embeddings (`pooling`) and images
(`multimodal`). It is near 500 lines because it holds a step's whole order of calls, one or
two lines per package; a package's own work goes into that package, not here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pagedserve import envs
from pagedserve.attention import AttentionLayerConfig, BuilderConfig, select_backend
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.attention.layer import Attention
from pagedserve.attention.metadata import CommonAttentionMetadata, CommonMetadataBuilder
from pagedserve.attention.ops import state_kernels_enabled
from pagedserve.attention.registry import get_backend_cls
from pagedserve.attention.state import StateLayer, StateMetadataBuilder
from pagedserve.attention.state_verify import StateVerify, commit_accepted
from pagedserve.config import EngineConfig
from pagedserve.distributed import broadcast_, tp_rank, tp_world_size
from pagedserve.engine import guided, kv_cache_setup, runner_warmup, scoring
from pagedserve.engine.batch_sampling import BatchSampling
from pagedserve.engine.cuda_graphs import DecodeGraphs, GraphInputs
from pagedserve.engine.device_timer import DeviceTimer
from pagedserve.engine.input_batch import InputBatch, InputIds
from pagedserve.engine.piecewise_graphs import PiecewiseGraphs
from pagedserve.engine.runner_outputs import ModelRunnerOutput, PendingStep
from pagedserve.engine.sample_copy import SamplesToHost
from pagedserve.engine.sampler import Sampler, SamplerOutput
from pagedserve.kv_cache.groups import KVCacheLayout, plan_kv_cache_groups
from pagedserve.kv_cache.specs import StateSpec
from pagedserve.lora.manager import make_lora_manager
from pagedserve.multimodal.runner import MultiModalRunner
from pagedserve.pooling.config import resolve_pooler
from pagedserve.pooling.step import StepPooler, host_rows
from pagedserve.scheduler import Request, SchedulerOutput
from pagedserve.spec_decode.speculator import make_speculator
from pagedserve.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


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
        self.memory_baseline = kv_cache_setup.memory_baseline(model, self.device)
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        # Tensor parallelism: every rank runs the forward and the head (logits gathered on
        # every rank, so steps that keep logits run the same collectives everywhere); rank 0
        # alone samples and sends its tokens to the others.
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()

        self.attn_layers = kv_cache_setup.indexed_layers(model, Attention)
        self.state_layers = kv_cache_setup.indexed_layers(model, StateLayer)
        if not self.attn_layers and not self.state_layers:
            raise ValueError("the model has neither attention nor state layers")
        # Speculative decoding (spec_decode/): a verify step's layout and rejection sampling,
        # the next drafts; None when off. A draft model's layers join attn_layers (its cache).
        self.speculator = make_speculator(config, self)
        self.lora = make_lora_manager(config, model, self.max_num_tokens)  # the core drives it
        # Backend builders by Attention.metadata_key, and the cache group each one reads.
        self.builders: dict[Any, Any] = {}
        self.builder_group: dict[Any, int] = {}
        self.kv_specs = []
        self.kv_layout: KVCacheLayout | None = None
        self.state_specs: list[StateSpec] = []
        # Every attention layer encoder-only (BERT and kin): no KV cache, no blocks.
        self.encoder_only = False
        self.pooler_config = resolve_pooler(config.model)
        self.state_builder: StateMetadataBuilder | None = None
        if self.state_layers:
            self._bind_state_layers()
        if self.attn_layers:
            self._bind_attention_layers()
        if self.speculator is not None:
            self.speculator.check_layout(self.kv_layout)
        # Images in prompts (multimodal/): a vision-language model's encoders and the store of
        # their rows; None for a text model, whose steps never look at images.
        self.multimodal = MultiModalRunner.for_runner(self)

        self.num_kv_groups = len(self.kv_layout.groups) if self.kv_layout else 1
        self.input_batch = InputBatch(self.max_num_reqs, max_model_len, self.max_blocks_per_seq,
                                      self.num_kv_groups)
        self.input_ids = InputIds(self.max_num_tokens, self.max_num_reqs, self.device)
        # One builder per KV cache group: the first builds the step's common metadata, the
        # others only their group's block table, slot mapping and page table.
        csr = bool(self.attn_layers) and self.backend.reads_paged_kv_indices
        self.group_builders = [
            CommonMetadataBuilder(self.max_num_reqs, self.max_num_tokens,
                                  self.max_blocks_per_seq, self.block_size, self.device, csr)
            for _ in range(self.num_kv_groups)]
        self.common_builder = self.group_builders[0]
        pin = self.device.type == "cuda"
        self.sampler = Sampler()
        # Rows one request can sample; state slots allocated per request (state_verify.py).
        width = self.state_slot_copies = 1 + (self.speculator.num_speculative_tokens
                                              if self.speculator else 0)
        self.pooler = StepPooler.for_engine(config, model)  # a pooling model's, not the sampler
        # The launched step not yet collected, and where steps' samples go to the host.
        self._in_flight: PendingStep | None = None
        self._samples_to_host = SamplesToHost(self.max_num_reqs * width, self.device)
        # Recorded once a step's host->device input copies are queued: the next step rewrites
        # the same pinned buffers only after they have been read (a step may be in flight).
        self._inputs_copied = torch.cuda.Event() if pin else None
        self.wait_seconds = 0.0  # host time spent waiting for the device's events
        self.sampling = BatchSampling(eos_token_id, vocab_size, self.device)
        # Live requests that need more than the sampled token (teacher forcing, prompt
        # logprobs, scoring by prefill): a step looks for them only while there are any.
        self._wants_logits: set[str] = set()
        # Guided decoding: the engine's StructuredOutputManager, and the live requests with a
        # grammar (a step fills a bitmask only while there are any).
        self.structured_output: StructuredOutputManager | None = None
        self._guided: set[str] = set()
        self.kv_caches: list[Any] = []
        self.state_caches: list[dict[str, torch.Tensor]] = []
        self.num_blocks = 0
        self.num_state_slots = 0
        self.decode_graphs: DecodeGraphs | None = None  # once captured
        self.piecewise: PiecewiseGraphs | None = None  # prefill and mixed steps' (if on)
        self._ran_graph = False
        self._common: CommonAttentionMetadata | None = None  # the last step's
        self._state_verify: StateVerify | None = None
        # Set to a list to record every step's (num_computed, num_scheduled, num_prefills,
        # ran as a graph) for benchmarks' floors.
        self.step_log: list[tuple[np.ndarray, np.ndarray, int, bool]] | None = None
        # The device's busy time (engine/device_timer.py), when measured: on CUDA with
        # PAGEDSERVE_DEVICE_TIMING set, or a benchmark's own timer.
        self.device_timer = DeviceTimer() if pin and envs.PAGEDSERVE_DEVICE_TIMING else None

    # ---- binding layers to a backend ----------------------------------------------------

    def _bind_attention_layers(self) -> None:
        cache = self.config.cache
        layers = [m.config(self.dtype, cache.kv_cache_dtype) for m in self.attn_layers]
        backend = select_backend(self.config.attention_backend, self.device, layers,
                                 self.block_size)
        self.backend = backend.for_kv_cache_dtype(cache.kv_cache_dtype)
        logger.info("attention backend: %s (%s)", self.backend.get_name(),
                    self.backend.is_available()[1])
        self.kv_cache_dtype = self.backend.get_kv_cache_dtype(cache.kv_cache_dtype, self.dtype)
        self.encoder_only = kv_cache_setup.is_encoder_only(layers, self.pooler_config)
        if self.encoder_only:  # no cache: one pass per request, the K/V dropped after it
            group_of_layer, grouped = [0] * len(layers), False
        else:
            self.kv_specs = kv_cache_setup.attention_specs(self.backend, layers,
                                                           self.block_size, self.kv_cache_dtype)
            self.kv_layout = plan_kv_cache_groups(self.kv_specs)
            grouped = len(self.kv_layout.groups) > 1
            group_of_layer = self.kv_layout.group_of_layer
        impl_cls = self.backend.get_impl_cls()
        builder_cls = self.backend.get_builder_cls()
        for module, layer, group in zip(self.attn_layers, layers, group_of_layer, strict=True):
            # One group (the common case): metadata by layer configuration, as without groups.
            key = (group, layer) if grouped else layer
            module.bind(impl_cls(layer), layer, key)
            if key not in self.builders:
                self.builders[key] = builder_cls(self._builder_config(layer))
                self.builder_group[key] = group

    def _builder_config(self, layer: AttentionLayerConfig) -> BuilderConfig:
        return BuilderConfig.for_layer(layer, self.block_size, self.max_num_reqs,
                                       self.max_num_tokens, self.max_blocks_per_seq,
                                       self.device)

    def _bind_state_layers(self) -> None:
        """Each state layer gets its kind's backend (its `backend_name`); one metadata builder
        serves them all. --attention-backend names the attention layers' backend only."""
        use_triton = state_kernels_enabled(self.device)
        self.state_specs = [m.state_spec(self.dtype) for m in self.state_layers]
        impls: dict[str, Any] = {}
        for layer, spec in zip(self.state_layers, self.state_specs, strict=True):
            if spec.backend not in impls:
                backend = get_backend_cls(spec.backend)
                if not self.attn_layers:  # a kv_cache_dtype can only mean the state then
                    backend.get_kv_cache_dtype(self.config.cache.kv_cache_dtype, self.dtype)
                    self.backend = backend
                impls[spec.backend] = backend.get_impl_cls()(use_triton)
                logger.info("state layers %s: backend %s (%s)", spec.backend,
                            backend.get_name(), backend.is_available()[1])
            layer.bind(impls[spec.backend], spec)
        self.state_builder = StateMetadataBuilder(self.device, use_triton, self.max_num_reqs)
        if not self.attn_layers:
            self.kv_cache_dtype = self.dtype
            if self.config.attention_backend not in (None, self.backend.get_name()):
                logger.info("a model without attention layers runs its state backends only; "
                            "attention_backend=%s does not apply",
                            self.config.attention_backend)

    # ---- KV cache -----------------------------------------------------------------------

    def determine_cache_size(self) -> tuple[int, int]:
        """(attention blocks, state slots) the memory budget holds."""
        return kv_cache_setup.determine_cache_size(self.config.cache, self.bytes_per_block,
                                                   self.state_specs, self.max_num_reqs,
                                                   self.device, self.profile_peak_memory,
                                                   self.state_slot_copies)

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs over the cache tensors (0 without attention layers)."""
        return self.kv_layout.bytes_per_block if self.kv_layout is not None else 0

    def profile_peak_memory(self) -> int:
        return kv_cache_setup.profile_peak_memory(self)

    def _dummy_forward(self, num_reqs: int, num_new: int, context: int) -> torch.Tensor:
        """A forward over stand-in requests (`runner_warmup.dummy_forward`)."""
        return runner_warmup.dummy_forward(self, num_reqs, num_new, context)

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """The attention layers' pages and the state layers' slots."""
        if self.attn_layers and not self.encoder_only:
            self.kv_caches = kv_cache_setup.allocate_layer_caches(
                self.backend, self.kv_layout, num_blocks, self.kv_cache_dtype, self.device)
        self.state_caches = kv_cache_setup.allocate_state_slots(
            self.state_specs, num_state_slots * self.state_slot_copies, self.device)
        if self.state_builder is not None:  # verify scratch after the slots (state_verify.py)
            self.state_builder.set_verify_slots(num_state_slots, self.state_slot_copies - 1)
        self.num_blocks = num_blocks
        self.num_state_slots = num_state_slots

    # ---- requests -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.sampling.add_request(request)
        if request.needs_logits:
            self._wants_logits.add(request.request_id)
        if request.grammar is not None:
            self._guided.add(request.request_id)

    def finish_request(self, request_id: str) -> None:
        self.sampling.finish_request(request_id)
        self._wants_logits.discard(request_id)
        self._guided.discard(request_id)

    # ---- one step -----------------------------------------------------------------------

    def _forward(self, batch: SchedulerOutput, rows: np.ndarray,
                 prev: PendingStep | None = None) -> torch.Tensor:
        """Build the step's inputs and queue its forward. `prev`: the step still in flight,
        whose samples are some of this step's input ids (they are placed on the device)."""
        if self._inputs_copied is not None:
            t0 = time.perf_counter()
            self._inputs_copied.synchronize()  # the last step's copies have read the buffers
            self.wait_seconds += time.perf_counter() - t0
        self._common = common = self.common_builder.build(
            rows, batch.num_computed_tokens, batch.num_scheduled_tokens, batch.num_prefills,
            self.input_batch.block_table.table, batch.context_written_in_step,
            self.multimodal.step_spans(batch) if self.multimodal is not None else None)
        commons = [common]
        for builder, table in zip(self.group_builders[1:], self.input_batch.block_tables[1:],
                                  strict=True):
            commons.append(builder.build_group(common, rows, table.table))
        t = common.num_actual_tokens
        self.input_batch.gather_token_ids(rows, batch.num_scheduled_tokens,
                                          self.common_builder.np["positions"][:t],
                                          self.input_ids.host_view(t))
        num_patched = 0
        if prev is not None:
            num_patched = self.input_ids.queue_patch(prev.batch, prev.rows, batch, rows,
                                                     common.query_start_loc_cpu)
        # A decode step whose every id is a sample still on the device needs no host ids.
        input_ids = (self.input_ids.upload(0, t) if num_patched < t
                     else self.input_ids.device[:t])
        # The positions the model turns by (M-RoPE's [3, T] rows; the metadata keeps its own).
        positions = (common.positions if self.multimodal is None else
                     self.multimodal.step_positions(batch, common,
                                                    self.common_builder.np["positions"]))
        graph_size = (self.decode_graphs.prepare(commons)
                      if self.decode_graphs and not batch.embeds_images else None)
        attn_metadata = state_metadata = None
        if graph_size is None:
            group = self.builder_group
            attn_metadata = {key: b.build_step(commons[group[key]])
                             for key, b in self.builders.items()}
        if self.state_builder is not None:
            state_metadata = self.state_builder.build_step(
                common, self.input_batch.state_slot[rows], batch.num_draft_tokens)
            self._state_verify = state_metadata.verify
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        if self.device_timer is not None:
            self.device_timer.start()
        if num_patched:
            self.input_ids.apply_patch(num_patched, prev.out.sampled_token_ids)
        if graph_size is not None:
            self._ran_graph = True
            return self.decode_graphs.replay(graph_size, common.num_reqs)
        if self.piecewise is not None and (hidden := self.piecewise.run(attn_metadata, t)
                                           ) is not None:
            return hidden
        embeds = (self.multimodal.step_embeds(batch, input_ids, common.query_start_loc_cpu)
                  if self.multimodal is not None else None)
        with set_forward_context(attn_metadata, self.kv_caches, self.state_caches,
                                 state_metadata):
            hidden = (self.model(input_ids, positions) if embeds is None
                      else self.model(input_ids, positions, inputs_embeds=embeds))
            if self.speculator is not None:
                self.speculator.forward_step(input_ids, common.positions, hidden)
            return hidden

    def run_model(self, attn_metadata: dict[Any, Any], num_tokens: int,
                  attention_hook: Any = None) -> torch.Tensor:
        """The model over the first `num_tokens` of the persistent input ids and positions,
        under `attn_metadata` (what a CUDA graph captures and the padding path runs; the
        piecewise graphs' `attention_hook`), then a draft model's or head's part of the step
        (spec_decode/step_graphs.py)."""
        ids, positions = self.input_ids.device[:num_tokens], self.common_builder.dev["positions"]
        positions = positions[:num_tokens]  # (as the eager step, the proposer's are 1-D)
        with set_forward_context(attn_metadata, self.kv_caches, attention_hook=attention_hook):
            hidden = self.model(ids, positions if self.multimodal is None
                                else self.multimodal.graph_positions(positions))
            if self.speculator is not None and self.speculator.uses_kv_cache:
                self.speculator.forward_in_graph(ids, positions, hidden)
            return hidden

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """One step, synchronously: launch it and wait for its samples."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput) -> PendingStep:
        """Queue one step's forward and sampling on the device and return at once; `collect`
        waits for its samples. With async scheduling step N+1 is launched before N is
        collected: N's samples go into N+1's input ids on the device, so the host never waits
        for N here (unless N+1 has grammars: their masks need N's samples, engine/guided.py)."""
        prev = self._in_flight
        if prev is not None:
            # A guided step's (its mask was filling): first, so the device samples while the
            # host builds this step's inputs.
            self.queue_sampling(prev)
            if prev.sampled is not None:
                prev = None  # its samples are in the token table already
        rows = self.input_batch.update(batch)
        if batch.num_draft_tokens is not None:
            self.input_batch.write_drafts(batch, rows)
        if self.pooler is not None:  # every request pools: no head, no sampler, no graphs
            hidden = self._forward(batch, rows)
            self._in_flight = self.pooler.launch(batch, rows, self.input_batch.generation[rows],
                                                 hidden, self._common, self.device_timer)
            return self._in_flight
        meta = (self.sampling.metadata(batch.requests, self.input_batch.same_as_last_step)
                if self.tp_rank == 0 else None)
        self._ran_graph = False
        hidden = self._forward(batch, rows, prev)
        greedy = logits = None
        if self._ran_graph and meta is not None and not self._wants_logits:  # the head's graphs
            if meta.argmax_only and not self._guided:  # sampled there: no logits leave them
                greedy = self.decode_graphs.greedy_tokens(batch.num_reqs)
            else:
                logits = self.decode_graphs.head_logits(batch.num_reqs)
        verify = (self.speculator.layout(batch, self._common.query_start_loc_cpu)
                  if self.speculator else None)
        if verify is not None:  # the last 1+K hidden states of a request with K drafts
            logits = self.model.compute_logits(hidden[verify.hidden_rows_dev])
        elif greedy is None and logits is None:  # each request's last new token's hidden state
            last = (slice(batch.num_reqs) if self._common.max_query_len == 1  # decodes only
                    else self._common.query_start_loc[1:].long() - 1)  # from the cu_seqlens
            logits = self.model.compute_logits(hidden[last])
        fill = None
        if self._guided:  # host work while the device runs the forward and the projection
            if prev is not None:  # uncollected: its samples are waited for here
                self._record_samples(prev)
            fill = guided.start_mask(self.structured_output, batch, prev, verify)
        if self.step_log is not None:
            self.step_log.append((batch.num_computed_tokens.copy(),
                                  batch.num_scheduled_tokens.copy(), batch.num_prefills,
                                  self._ran_graph))
        pending = PendingStep(batch, rows, self.input_batch.generation[rows],
                              sampling=None if greedy is not None else (logits, meta),
                              fill=fill, verify=verify,
                              captured=self.speculator.take_captured() if self.speculator
                              else None, state_verify=self._state_verify)
        if self._wants_logits:
            index = [i for i, r in enumerate(batch.requests)
                     if r.request_id in self._wants_logits]
            pending.forced, pending.forced_tokens = scoring.forced_logprobs(
                batch, index, logits if verify is None else logits[verify.row_start_dev])
            pending.prompt_logprobs, pending.score_logprobs = scoring.prompt_position_logprobs(
                batch, index, hidden, self.model.compute_logits, self.device)
        # A step with a mask to fill is sampled by the next launch (or collect): the host's
        # work in between overlaps the fill. Ranks sample in step, for their broadcast.
        if greedy is not None:
            self._send_samples(pending, SamplerOutput(greedy))
        elif fill is None or self.tp_size > 1:
            self.queue_sampling(pending)
        self._in_flight = pending
        return pending

    def queue_sampling(self, pending: PendingStep) -> None:
        """Queue a launched step's sampling, under its grammars' mask if it has one, and the
        samples' copy to the host, unless done already (a guided step's waits for its mask)."""
        if pending.sampling is None:
            return
        logits, meta = pending.sampling
        pending.sampling = None
        if meta is not None:
            if (fill := pending.fill) is not None:
                meta.token_bitmask = self.structured_output.finish_fill(fill)
                meta.bitmask_rows = fill.rows
            try:
                out = (self.sampler(logits, meta) if pending.verify is None
                       else self.speculator.sample(logits, meta, pending.verify))
            finally:
                meta.token_bitmask = meta.bitmask_rows = None  # it may serve a next step
        else:  # a rank > 0: rank 0's samples arrive below ([B, Kmax+1] for a verify step)
            width = () if pending.verify is None else (pending.verify.width,)
            out = SamplerOutput(torch.empty((pending.batch.num_reqs, *width), dtype=torch.int64,
                                            device=self.device))
        self._send_samples(pending, out)

    def _send_samples(self, pending: PendingStep, out: SamplerOutput) -> None:
        """Rank 0's samples to every rank, and on their way to the host."""
        if self.tp_size > 1:
            broadcast_(out.sampled_token_ids, src=0)
        pending.out = out
        if pending.state_verify is not None:  # before the next step's forward reads the slots
            commit_accepted(self.state_caches, pending.state_verify, out.sampled_token_ids)
        pending.host_copy, pending.logprobs = self._samples_to_host.start(out)
        if self.device_timer is not None:
            self.device_timer.stop()

    @torch.inference_mode()
    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """The samples (and logprobs) of a launched step, waiting for them if need be."""
        self.queue_sampling(pending)
        self._record_samples(pending)
        if self.speculator is not None:
            self.speculator.propose_after(self, pending, self._wants_logits)
        if self._in_flight is pending:
            self._in_flight = None
        pooled = None
        if pending.pooled is not None:  # a pooling step's rows: waits for the device
            t0 = time.perf_counter()
            pooled = host_rows(pending.pooled)
            self.wait_seconds += time.perf_counter() - t0
        return ModelRunnerOutput(pending.sampled, pending.logprobs, pending.prompt_logprobs,
                                 pending.forced, pending.score_logprobs,
                                 draft_token_ids=pending.drafts, pooled=pooled)

    def _record_samples(self, pending: PendingStep) -> None:
        """Once per step: wait for its samples, put teacher-forced tokens in their place, and
        write each sampling request's new token into its row of the token table."""
        if pending.sampled is not None:
            return
        assert pending.host_copy is not None, "its sampling was never queued"
        host, event = pending.host_copy
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()
            self.wait_seconds += time.perf_counter() - t0
        sampled = host.copy()
        for i, token in pending.forced_tokens.values():
            sampled.reshape(len(sampled), -1)[i, 0] = token  # a verify step's: [B, Kmax+1]
        batch, rows = pending.batch, pending.rows
        self.input_batch.record_samples(batch, rows, pending.generations, sampled)
        pending.sampled = sampled

    def warmup(self) -> None:
        """Compile/JIT whatever the backend needs before the first request, then capture the
        decode graphs."""
        t0 = time.perf_counter()
        for builder in self.builders.values():
            builder.warmup()
        logger.debug("backend warm-up took %.1f s", time.perf_counter() - t0)
        runner_warmup.run_warmup_steps(self)
        runner_warmup.capture_graphs(self)

    def graph_inputs(self) -> GraphInputs:
        return runner_warmup.graph_inputs(self)
