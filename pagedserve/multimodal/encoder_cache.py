"""The scheduler's side of images: which images' encoders a step runs, and the budget of the
rows they leave in the runner's store.

An image's encoder runs in the step whose chunk first reaches its placeholder span, unless its
rows are in the store already (an earlier step, another request with the same image, or the
same request before it was preempted). The store holds `encoder_cache_size` rows. A request
holds a reference on each of its images until its chunks have gone past every span of that
image; unreferenced rows stay while there is room (a repeated image finds them) and are
evicted oldest first when a new image needs the room. The runner learns the evictions from
SchedulerOutput.free_encoder_identifiers and the images to encode from
SchedulerOutput.scheduled_encoder_inputs.

A chunk stops before a span whose encoder cannot run this step (no room in the store, or the
step's encoder budget `max_num_encoder_input_tokens` spent). For models whose image spans
attend both ways (`bidirectional_image_spans`) a chunk never ends inside a span either: the
whole span is in one step, or the chunk stops before it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def encoder_budgets(scheduler_config: Any, max_image_tokens: int) -> tuple[int, int]:
    """(encoder_cache_size, max_num_encoder_input_tokens): the settings, else
    max(max_num_batched_tokens, the largest image's rows) for both, as vLLM sizes them."""
    default = max(scheduler_config.max_num_batched_tokens, max_image_tokens)
    size = scheduler_config.encoder_cache_size or default
    compute = scheduler_config.max_num_encoder_input_tokens or size
    return size, compute


def encoder_cache_for(loaded: Any, scheduler_config: Any, settings: Any = None
                      ) -> EncoderCacheManager | None:
    """The scheduler's encoder cache for a loaded model that takes images (None otherwise);
    `settings`: the engine's image settings (processing.ProcessorSettings), which may make an
    image larger (Gemma 3's pan-and-scan crops)."""
    model = loaded.model
    if not getattr(model, "supports_multimodal", False):
        return None
    size, compute = encoder_budgets(scheduler_config,
                                    model.max_tokens_per_image(loaded.hf_config, settings))
    bidirectional = bool(model.bidirectional_image_spans)
    return EncoderCacheManager(size, compute, bidirectional,
                               scheduler_config.max_num_batched_tokens if bidirectional
                               else None)


def check_encoder_budget(features: list[Any], cache_size: int, compute_budget: int | None = None,
                         span_limit: int | None = None) -> None:
    """Each image must fit the store and one step's encoder budget (and, for a model whose
    spans may not be split, one step's tokens): else it could never be scheduled."""
    for i, feature in enumerate(features):
        rows = feature.placeholder.num_embeds
        for limit, name in ((cache_size, "encoder_cache_size"),
                            (compute_budget, "max_num_encoder_input_tokens")):
            if limit is not None and rows > limit:
                raise ValueError(f"image {i} takes {rows} embedding rows, more than the "
                                 f"engine's {name} of {limit}: raise {name}")
        if span_limit is not None and feature.placeholder.length > span_limit:
            raise ValueError(f"image {i} spans {feature.placeholder.length} tokens, which this "
                             f"model computes in one step, more than max_num_batched_tokens "
                             f"{span_limit}: raise max_num_batched_tokens")


class EncoderCacheManager:
    """Rows of the runner's store by image identifier, with the live requests that need each."""

    def __init__(self, cache_size: int, compute_budget: int,
                 bidirectional_spans: bool = False, span_limit: int | None = None) -> None:
        self.cache_size = cache_size
        self.compute_budget = compute_budget
        self.bidirectional_spans = bidirectional_spans
        self.span_limit = span_limit
        self.num_free_rows = cache_size
        self.rows: dict[str, int] = {}  # identifier -> rows it holds in the store
        self.refs: dict[str, set[str]] = {}  # identifier -> ids of requests that need it
        self.unreferenced: OrderedDict[str, None] = OrderedDict()  # evictable, oldest first
        self.holders: dict[str, Any] = {}  # request id -> request, while it holds references
        self.freed: list[str] = []  # evicted since the runner last heard
        self._step_budget = compute_budget

    # ---- per step ----------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step: its encoder budget, and the references of requests whose chunks went
        past every span of an image in an earlier step (kept until now: the step that read
        the rows may be the one just scheduled)."""
        self._step_budget = self.compute_budget
        for request in list(self.holders.values()):
            self._release_done(request)

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def plan(self, request: Any, start: int, num_new: int) -> tuple[int, list[int]]:
        """The tokens of `request` from `start` this step may compute (num_new or fewer),
        and the indices of its images whose encoders must run for them. Nothing is
        reserved until `commit`."""
        end = start + num_new
        budget = self._step_budget
        to_encode: list[int] = []
        planned: set[str] = set()
        planned_rows = 0
        kept: set[str] = set()  # cached images the chunk reads: not room for new ones
        for index, feature in enumerate(request.mm_features):
            p = feature.placeholder
            if p.offset >= end:
                break
            if p.end <= start:
                continue
            stop = max(p.offset - start, 0)  # the chunk cut before this span
            if self.bidirectional_spans and end < p.end:
                return stop, to_encode  # a span is never split across steps
            ident = feature.identifier
            if ident in planned or ident in kept:
                continue
            if ident in self.rows:
                rows = 0
                kept.add(ident)
            else:
                rows = p.num_embeds
                if rows > budget:
                    return stop, to_encode
            if planned_rows + rows > self._room(kept):
                return stop, to_encode
            if rows:
                budget -= rows
                planned_rows += rows
                planned.add(ident)
                to_encode.append(index)
        return num_new, to_encode

    def _room(self, kept: set[str]) -> int:
        """Rows free, or held by images no request references (evictable), except `kept`."""
        return self.num_free_rows + sum(self.rows[i] for i in self.unreferenced
                                        if i not in kept)

    def commit(self, request: Any, to_encode: list[int], start: int, num_new: int) -> None:
        """The request runs tokens start..start+num_new-1 this step: hold a reference on
        every image its chunk touches, then reserve rows for the images it encodes."""
        end = start + num_new
        for feature in request.mm_features:
            p = feature.placeholder
            if p.offset >= end:
                break
            if p.end > start and feature.identifier in self.rows:
                self._hold(feature.identifier, request)
        for index in to_encode:
            feature = request.mm_features[index]
            rows = feature.placeholder.num_embeds
            self._make_room(rows)
            self.rows[feature.identifier] = rows
            self.num_free_rows -= rows
            self._step_budget -= rows
            self._hold(feature.identifier, request)

    # ---- requests ----------------------------------------------------------------------

    def release(self, request: Any) -> None:
        """The request finished or was preempted: its references go (the rows stay while
        there is room, for its recomputation or another request)."""
        if self.holders.pop(request.request_id, None) is None:
            return
        for feature in request.mm_features:
            self._drop(feature.identifier, request.request_id)

    def _release_done(self, request: Any) -> None:
        computed = request.num_computed_tokens
        needed = {f.identifier for f in request.mm_features if f.placeholder.end > computed}
        for feature in request.mm_features:
            if feature.identifier not in needed:
                self._drop(feature.identifier, request.request_id)
        if not needed:
            del self.holders[request.request_id]

    def _hold(self, ident: str, request: Any) -> None:
        self.refs.setdefault(ident, set()).add(request.request_id)
        self.unreferenced.pop(ident, None)
        self.holders[request.request_id] = request

    def _drop(self, ident: str, request_id: str) -> None:
        holders = self.refs.get(ident)
        if holders is None or request_id not in holders:
            return
        holders.discard(request_id)
        if not holders:
            del self.refs[ident]
            self.unreferenced[ident] = None

    def _make_room(self, rows: int) -> None:
        while self.num_free_rows < rows:
            ident, _ = self.unreferenced.popitem(last=False)
            self.num_free_rows += self.rows.pop(ident)
            self.freed.append(ident)

    @property
    def num_cached(self) -> int:
        return len(self.rows)
