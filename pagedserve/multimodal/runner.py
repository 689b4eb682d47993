"""The model runner's side of images: the encoder outputs kept by image identifier, the
step's encoders run in one call, and the step's input embeddings with the images' rows written
over their placeholder tokens.

The model runner creates a `MultiModalRunner` only for a model with `supports_multimodal`,
and asks it for `inputs_embeds` only in a step whose tokens include image placeholders
(`SchedulerOutput.embeds_images`); every other step, decode CUDA graphs included, runs as a
text step. Which images to encode and which rows to drop is the scheduler's decision
(encoder_cache.py); this store follows it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from pagedserve.device import to_device_async
from pagedserve.multimodal.encoder_attention import bind_encoder_attention
from pagedserve.multimodal.encoder_cache import encoder_budgets
from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange
from pagedserve.multimodal.mrope import MRopeStepPositions
from pagedserve.multimodal.processing import ProcessorSettings
from pagedserve.multimodal.spans import BidirectionalSpans, step_spans

logger = logging.getLogger(__name__)


class MultiModalRunner:
    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype,
                 budgets: tuple[int, int] = (0, 0), max_num_tokens: int = 0) -> None:
        self.model = model
        # The scheduler's encoder_cache_size and per-step encoder rows (encoder_cache.py).
        self.cache_size, self.compute_budget = budgets
        self.device = device
        self.dtype = dtype
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        # M-RoPE models: the step's [3, T] positions (mrope.py); None for the others.
        self.mrope = (MRopeStepPositions(max_num_tokens, device) if self.uses_mrope
                      else None)
        # Image tokens attend to each other both ways (Gemma 3): steps with images carry
        # their spans into the attention metadata (spans.py).
        self.bidirectional = bool(getattr(model, "bidirectional_image_spans", False))
        # identifier -> the encoder's rows [num_embeds, hidden] on the device
        self.store: dict[str, torch.Tensor] = {}
        # Counters the tests and metrics read: images encoded, encoder calls (steps), and the
        # encoder's time (on CUDA from events, summed once they have completed).
        self.num_encoded = 0
        self.num_encoder_calls = 0
        self._encoder_seconds = 0.0
        # CUDA: the calls' (start, end) events not read yet, oldest first (a few at most: each
        # call reads those that have completed).
        self._timing: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    @classmethod
    def for_runner(cls, runner: Any) -> MultiModalRunner | None:
        """For the model runner of a model that takes images (None otherwise): binds the
        vision tower's attention to an encoder-capable backend."""
        model = runner.model
        if not getattr(model, "supports_multimodal", False):
            return None
        # Under tensor parallelism every rank runs the whole tower (its weights are not split).
        backend = bind_encoder_attention(model, runner.backend, runner.device, runner.dtype,
                                         runner.max_num_tokens)
        if backend is not None:
            logger.info("vision encoder attention: backend %s", backend.get_name())
        settings = ProcessorSettings.of(runner.config.model)
        budgets = encoder_budgets(runner.config.scheduler,
                                  model.max_tokens_per_image(model.checkpoint_config(), settings))
        return cls(model, runner.device, runner.dtype, budgets, runner.max_num_tokens)

    def step_spans(self, batch: Any) -> BidirectionalSpans | None:
        """The step's bidirectional image spans (None: the model has none, or the step's
        tokens reach no image)."""
        if not (self.bidirectional and batch.embeds_images):
            return None
        return step_spans(batch)

    def step_embeds(self, batch: Any, input_ids: torch.Tensor,
                    query_start_loc: np.ndarray) -> torch.Tensor | None:
        """What the model runner calls each step: the scheduled encoders, then the step's
        inputs_embeds when its tokens include image placeholders (None: a text step)."""
        if batch.free_encoder_identifiers or batch.scheduled_encoder_inputs:
            self.run_encoders(batch)
        if not batch.embeds_images:
            return None
        return self.inputs_embeds(batch, input_ids, query_start_loc)

    @torch.inference_mode()
    def profile(self) -> int:
        """Before the KV cache is sized: run the encoder over as many of the largest images as
        one step may encode (its activations count in the peak), and return the bytes the
        store may hold, which the peak does not include."""
        data = self.model.dummy_image_data()
        # The stand-in's rows: the largest image under the config alone. Settings that make
        # an image several such squares (pan-and-scan crops) leave the peak one budget's
        # worth of squares.
        rows = self.model.max_tokens_per_image(self.model.checkpoint_config())
        if data is None or not rows:
            return 0
        count = max(self.compute_budget // rows, 1)
        features = [MultiModalFeature("image", f"profile-{i}", PlaceholderRange(0, rows), data)
                    for i in range(count)]
        out = self.model.embed_multimodal(features)
        row_bytes = out[0].shape[-1] * out[0].element_size()
        del out
        return self.cache_size * row_bytes

    # ---- the encoders ------------------------------------------------------------------

    def run_encoders(self, batch: Any) -> None:
        """Drop the rows the scheduler evicted, then encode the step's scheduled images in
        one `embed_multimodal` call."""
        for ident in batch.free_encoder_identifiers:
            self.store.pop(ident, None)
        if not batch.scheduled_encoder_inputs:
            return
        by_id = {r.request_id: r for r in batch.requests}
        features: list[MultiModalFeature] = []
        seen: set[str] = set()
        for request_id, indices in batch.scheduled_encoder_inputs.items():
            for index in indices:
                feature = by_id[request_id].mm_features[index]
                if feature.identifier not in seen and feature.identifier not in self.store:
                    seen.add(feature.identifier)
                    features.append(feature)
        if not features:
            return
        outputs = self._timed_encoder(features)
        for feature, rows in zip(features, outputs, strict=True):
            expected = feature.placeholder.num_embeds
            if rows.shape[0] != expected:
                raise RuntimeError(f"the encoder gave {rows.shape[0]} rows for an image of "
                                   f"{expected} placeholder tokens")
            self.store[feature.identifier] = rows
        self.num_encoded += len(features)
        self.num_encoder_calls += 1

    def _timed_encoder(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            outputs = self.model.embed_multimodal(features)
            self._encoder_seconds += time.perf_counter() - t0
            return outputs
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        outputs = self.model.embed_multimodal(features)
        end.record()
        self._timing.append((start, end))
        self._read_timing()
        return outputs

    @property
    def encoder_seconds(self) -> float:
        """The encoder's time over every call so far (on CUDA: the calls completed)."""
        self._read_timing()
        return self._encoder_seconds

    def _read_timing(self) -> None:
        """Add the completed calls' times (`Event.query` does not wait)."""
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.popleft()
            self._encoder_seconds += start.elapsed_time(end) / 1000

    # ---- the step's embeddings ---------------------------------------------------------

    def inputs_embeds(self, batch: Any, input_ids: torch.Tensor,
                      query_start_loc: np.ndarray) -> torch.Tensor:
        """The decoder's embeddings of the step's tokens, with each image's rows over the
        placeholders this step computes (a chunk may cover part of a span)."""
        embeds = self.model.embed_input_ids(input_ids)
        dst, src = self._placements(batch, query_start_loc)
        if dst:
            rows = torch.cat(src) if len(src) > 1 else src[0]
            # Pinned: a copy from pageable memory would wait for the step in flight.
            index = to_device_async(torch.from_numpy(np.concatenate(dst)), self.device)
            embeds.index_copy_(0, index, rows.to(embeds.dtype))
        return embeds

    def _placements(self, batch: Any, query_start_loc: np.ndarray
                    ) -> tuple[list[np.ndarray], list[torch.Tensor]]:
        """Per image span the step reaches: the step rows it fills and the encoder rows that
        fill them (views of the store)."""
        dst: list[np.ndarray] = []
        src: list[torch.Tensor] = []
        computed = batch.num_computed_tokens
        scheduled = batch.num_scheduled_tokens
        for i, request in enumerate(batch.requests):
            if not request.mm_features:
                continue
            start = int(computed[i])
            end = start + int(scheduled[i])
            row0 = int(query_start_loc[i]) - start  # step row of the request's token 0
            for feature in request.mm_features:
                p = feature.placeholder
                if p.offset >= end:
                    break
                if p.end <= start:
                    continue
                lo, hi = max(p.offset, start), min(p.end, end)
                rows = self.store.get(feature.identifier)
                if rows is None:
                    raise RuntimeError(f"request {request.request_id}: image "
                                       f"{feature.identifier[:12]} has no encoder rows")
                positions = np.arange(lo, hi)
                if p.is_embed is None:
                    dst.append(positions + row0)
                    src.append(rows[lo - p.offset:hi - p.offset])
                    continue
                mask = p.is_embed[lo - p.offset:hi - p.offset]
                # An embedding token's row: how many embedding tokens precede it in the span.
                before = int(p.is_embed[:lo - p.offset].sum())
                dst.append(positions[mask] + row0)
                src.append(rows[before:before + int(mask.sum())])
        return dst, src

    # ---- positions ---------------------------------------------------------------------

    def step_positions(self, batch: Any, common: Any, host_positions: np.ndarray
                       ) -> torch.Tensor:
        """The positions the model turns by this step: M-RoPE models' [3, T] from each
        request's `mrope_positions` (prompt) and `mrope_delta` (later tokens), written into
        the buffer decode CUDA graphs read; the step's [T] for the others."""
        if self.mrope is None:
            return common.positions
        t = common.num_actual_tokens
        return self.mrope.build(batch.requests, batch.num_computed_tokens,
                                batch.num_scheduled_tokens, common.query_start_loc_cpu,
                                host_positions[:t])

    def graph_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """What a captured (or padded) forward over len(positions) tokens reads: the M-RoPE
        buffer's first columns (filled by `step_positions` before each replay)."""
        if self.mrope is None:
            return positions
        return self.mrope.device[:, :positions.shape[0]]
