"""Sizing and allocating the KV cache: the layers' specs, how many blocks the memory budget
holds, and the cache tensors themselves.

On the CPU the budget is `kv_cache_memory`; on CUDA it is what `gpu_memory_utilization` leaves
after the peak of a profiling forward over the largest step (weights and activations). Every
layer of one KV cache group keeps its own page for a block id; groups of several attention kinds
share cache tensors (kv_cache/groups.py), so one block costs the pages of one group, or with one
group the sum of the layers' pages. State layers keep a slot per running request
(`split_budget` says how the budget is shared).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedserve.attention import AttentionBackend, AttentionLayerConfig
from pagedserve.attention.encoder import ENCODER_ONLY
from pagedserve.config import CacheConfig
from pagedserve.kv_cache import FullAttentionSpec, KVCacheLayout, KVCacheSpec, SlidingWindowSpec
from pagedserve.kv_cache.specs import (
    StateSpec,
    bytes_per_slot,
    gpu_kv_cache_budget,
    split_budget,
)


def attention_specs(backend: type[AttentionBackend], layers: list[AttentionLayerConfig],
                    block_size: int, cache_dtype: torch.dtype) -> list[KVCacheSpec]:
    """Each attention layer's cache spec, with its page bytes in the backend's layout."""
    specs: list[KVCacheSpec] = []
    for layer in layers:
        page_bytes = backend.get_page_size_bytes(block_size, layer.num_kv_heads,
                                                 layer.head_size, cache_dtype,
                                                 **_value_size(layer.head_size_v))
        if layer.sliding_window is not None:
            specs.append(SlidingWindowSpec(block_size, layer.num_kv_heads, layer.head_size,
                                           cache_dtype, page_bytes,
                                           head_size_v=layer.head_size_v,
                                           sliding_window=layer.sliding_window))
        else:
            specs.append(FullAttentionSpec(block_size, layer.num_kv_heads, layer.head_size,
                                           cache_dtype, page_bytes,
                                           head_size_v=layer.head_size_v))
    return specs


def is_encoder_only(layers: list[AttentionLayerConfig], pooler: Any) -> bool:
    """Whether every attention layer is encoder-only (the model keeps no KV cache). A model
    mixing the two kinds, or an encoder asked to generate, is refused by name."""
    encoders = [i for i, layer in enumerate(layers) if layer.attn_type == ENCODER_ONLY]
    if not encoders:
        return False
    if len(encoders) != len(layers):
        raise ValueError(f"attention layers {encoders} are encoder-only and the others decoder "
                         "layers: a model mixing the two is not supported")
    if pooler is None:
        raise ValueError("an encoder-only model (bidirectional attention, no KV cache) cannot "
                         "generate text: serve it with --runner pooling")
    return True


def _value_size(head_size_v: int | None) -> dict[str, int]:
    """head_size_v for the layout hooks only where it differs from head_size: a backend that
    never runs such layers may override them with the equal-size signature alone."""
    return {} if head_size_v is None else {"head_size_v": head_size_v}


def determine_cache_size(cache: CacheConfig, block_bytes: int,
                         state: list[StateSpec], max_num_seqs: int, device: torch.device,
                         profile_peak_memory: Callable[[], int],
                         slot_copies: int = 1) -> tuple[int, int]:
    """(attention blocks, state slots) the budget holds (`split_budget`; `block_bytes`: one
    block id's cost, 0 without attention layers); `profile_peak_memory`
    runs the profiling forward on CUDA and returns its peak bytes, the cache it used excluded.
    `num_gpu_blocks_override` sets the blocks (with state layers: max_num_seqs slots beside
    them), or for a model without attention layers the slots. `slot_copies`: slots allocated per
    request's slot (1 + K under speculative decoding, attention/state_verify.py)."""
    if not block_bytes and not state:  # encoder-only: nothing is cached
        return 0, 0
    override = cache.num_gpu_blocks_override
    if override is not None:
        if not block_bytes:
            return 0, min(override, max_num_seqs)
        return override, max_num_seqs if state else 0
    if device.type != "cuda":
        return split_budget(block_bytes, state, int(cache.kv_cache_memory), max_num_seqs,
                            slot_copies)
    peak = profile_peak_memory()
    free, total = torch.cuda.mem_get_info(device)
    budget = gpu_kv_cache_budget(total, peak, cache.gpu_memory_utilization)
    # gpu_memory_utilization is this engine's share of the device; other processes (or other
    # engines of this one) may hold part of the rest, as vLLM checks.
    if budget > free:
        raise ValueError(
            f"only {free / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB is free, "
            f"less than the {budget / 2**30:.1f} GiB KV cache that gpu_memory_utilization="
            f"{cache.gpu_memory_utilization:.2f} leaves after this engine's "
            f"{peak / 2**30:.1f} GiB peak; lower gpu_memory_utilization or free the device")
    return split_budget(block_bytes, state, budget, max_num_seqs, slot_copies)


def allocate_kv_caches(backend: type[AttentionBackend], specs: list[KVCacheSpec],
                       num_blocks: int, cache_dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache tensor per attention layer, in the backend's layout."""
    return [torch.zeros(backend.get_kv_cache_shape(num_blocks, spec.block_size,
                                                   spec.num_kv_heads, spec.head_size,
                                                   **_value_size(spec.head_size_v)),
                        dtype=cache_dtype, device=device)
            for spec in specs]


def allocate_layer_caches(backend: type[AttentionBackend], layout: KVCacheLayout,
                          num_blocks: int, cache_dtype: torch.dtype,
                          device: torch.device) -> list[torch.Tensor]:
    """Each attention layer's cache tensor by layer_idx: its own one with one cache group,
    else the tensor it shares with the layers at its position in the other groups."""
    tensors = allocate_kv_caches(backend, list(layout.tensor_specs), num_blocks, cache_dtype,
                                 device)
    return [tensors[i] for i in layout.tensor_of_layer]


def allocate_state_slots(specs: list[StateSpec], num_slots: int,
                         device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Each state layer's tensors by name, `num_slots` slots each."""
    return [{t.name: torch.zeros((num_slots, *t.shape), dtype=t.dtype, device=device)
             for t in spec.tensors} for spec in specs]


@torch.inference_mode()
def profile_peak_memory(runner: Any) -> int:
    """Peak bytes in use during a forward over the largest batch the scheduler can form, with a
    KV cache just big enough for it (weights included, the cache excluded). `runner`: the
    ModelRunner (its cache is allocated for the forward and dropped after)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(runner.max_num_tokens, runner.max_model_len)
    needed = -(-num_tokens // runner.block_size) if runner.kv_layout is not None else 0
    runner.allocate_kv_cache(needed, 1 if runner.state_layers else 0)
    before_forward = torch.cuda.memory_allocated(device)
    hidden = runner._dummy_forward(1, num_tokens, 0)
    forward_peak = torch.cuda.max_memory_allocated(device) - before_forward
    # The head's rows: one per request, 1 + K per request in a step that verifies drafts.
    spec = runner.config.speculative
    head_rows = runner.max_num_reqs * (1 + (spec.num_speculative_tokens if spec else 0))
    runner.model.compute_logits(hidden[-head_rows:])
    # A vision-language model's encoder over one step's images, and its store of rows.
    store = runner.multimodal.profile() if runner.multimodal is not None else 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - runner.memory_baseline + store
    runner.kv_caches, runner.state_caches = [], []
    torch.cuda.empty_cache()
    # The cache we just used counts against the peak but will be allocated anew.
    used = needed * runner.bytes_per_block
    slots = bytes_per_slot(runner.state_specs) * runner.state_slot_copies
    reserve = piecewise_reserve(runner, forward_peak, num_tokens)
    return peak - used - (slots if runner.state_layers else 0) + reserve


def piecewise_reserve(runner: Any, forward_peak: int, num_tokens: int) -> int:
    """Bytes the piecewise graphs' pool will hold for good (engine/piecewise_graphs.py): the
    activations of a forward over their largest size (max_num_batched_tokens), from
    `forward_peak`, the profile's forward over `num_tokens` (fewer where max_model_len is
    shorter), scaled by the token counts (activations grow with them; attention's own
    temporaries are included, so a little more than the pool). It comes on top of the peak
    that eager work (attention, the head, sampling) still reaches beside the pool; 0 when
    the runner will not capture them."""
    from pagedserve.engine.piecewise_graphs import decline_reason

    if not runner.config.piecewise_cuda_graphs or decline_reason(runner) is not None:
        return 0
    return max(forward_peak, 0) * -(-runner.max_num_tokens // max(num_tokens, 1))


def memory_baseline(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes this process holds on `device` that are not this engine's (another engine's in
    the same process, a caller's tensors): what is allocated now, less the model's weights.
    The memory profile's peak counts from here, so two engines in one process (tests,
    notebooks) size their caches as each would alone."""
    if device.type != "cuda":
        return 0
    # "cuda" is the current device, whose tensors say "cuda:N": compare indices, not devices.
    index = torch.cuda.current_device() if device.index is None else device.index
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())
               if t.device.type == "cuda" and t.device.index == index}
    own = sum(t.numel() * t.element_size() for t in tensors.values())
    return max(torch.cuda.memory_allocated(device) - own, 0)


def indexed_layers(model: torch.nn.Module, kind: type) -> list[Any]:
    """The model's layers of one kind by `layer_idx`, which must be 0..N-1 (the index of the
    layer's cache)."""
    layers = sorted((m for m in model.modules() if isinstance(m, kind)),
                    key=lambda m: m.layer_idx)
    if [m.layer_idx for m in layers] != list(range(len(layers))):
        raise ValueError(f"{kind.__name__} layer indices must be 0..N-1")
    return layers
