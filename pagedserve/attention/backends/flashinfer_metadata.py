"""What FLASHINFER's builder hands every layer for one step: its planned wrappers and slots (a
module of its own, so the decode and the verify graph paths both build it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FlashInferMetadata:
    """What every layer of one configuration needs for one step (or one CUDA-graph size)."""

    num_prefill_tokens: int
    num_decode_tokens: int
    # Where each token's K/V goes; in a graph, padded to the captured size with -1 (not written).
    slot_mapping: torch.Tensor
    prefill: Any  # flashinfer.BatchPrefillWithPagedKVCacheWrapper, planned, or None
    decode: Any  # flashinfer.BatchDecodeWithPagedKVCacheWrapper, planned, or None
    # The wrappers are the attention-sink variants, whose run() takes the sinks.
    has_sinks: bool = False
