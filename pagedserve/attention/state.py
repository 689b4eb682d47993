"""Layers that keep a per-request state instead of K/V pages: Mamba-1 and Mamba-2 mixers, gated
delta nets, short convolutions, linear attention.

Each running request owns one state slot; a slot id indexes every state layer's tensors (the
layer's `StateSpec`: named tensors per slot, e.g. a conv window and a recurrent state). The
engine hands slots out on admission and takes them back when a request finishes or is
preempted (a preempted request recomputes its state from its tokens). Per step, one
`StateMetadata` serves every state layer: each request's slot, whether it continues a saved
state, and where its new tokens are in the packed batch (prefills first, then decodes).

A model's mixer keeps its projections and norms and calls a `StateLayer` (a subclass per layer
kind) for the parts that read and write the slot; the runner binds the layer's backend impl
(chosen by the layer's `backend_name`, see `attention/backends/`) and sets the step's metadata
and state tensors in the forward context. State layers are indexed 0..N-1 among themselves
(`layer_idx`), apart from the attention layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pagedserve.attention import state_verify
from pagedserve.attention.backend import AttentionBackend, AttentionLayerConfig
from pagedserve.attention.forward_context import get_forward_context
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.state_verify import StateVerify, run_state_op
from pagedserve.kv_cache.specs import StateSpec


@dataclass
class StateMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    query_start_loc: torch.Tensor  # [B+1] int32
    state_indices: torch.Tensor  # [B] int64, each request's state slot
    has_initial_state: torch.Tensor  # [B] bool: tokens computed before this step
    max_query_len: int
    max_prefill_len: int
    # Torch paths only: flat [num_prefills, max_prefill_len] grid index of each prefill token,
    # and each prefill's number of new tokens.
    prefill_token_index: torch.Tensor | None = None
    prefill_lens: torch.Tensor | None = None
    # A step that verifies drafts: how its state layers run (attention/state_verify.py).
    verify: StateVerify | None = None


class StateMetadataBuilder:
    """The step's `StateMetadata`, once for all state layers. `state_slots` [B] int64 comes with
    the common metadata (`CommonAttentionMetadata.state_slots`). Under speculative decoding
    `set_verify_slots` says where the verify scratch slots start."""

    def __init__(self, device: torch.device, use_triton: bool, max_num_reqs: int = 0) -> None:
        self.device = device
        self.use_triton = use_triton
        # The step's state slots, host (pinned on CUDA, rewritten only after the last step's
        # input copies, as the other step inputs: the runner waits for those first) and device.
        pin = device.type == "cuda"
        self._slots_host = torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=pin)
        self._slots_dev = self._slots_host if not pin else torch.zeros_like(
            self._slots_host, device=device)
        self.num_slots = 0  # requests' own slots; scratch follows (state_verify.py)
        self.num_speculative_tokens = 0

    def set_verify_slots(self, num_slots: int, num_speculative_tokens: int) -> None:
        self.num_slots = num_slots
        self.num_speculative_tokens = num_speculative_tokens

    def build_step(self, common: CommonAttentionMetadata, slots: np.ndarray,
                   num_drafts: np.ndarray | None) -> StateMetadata:
        """The step's metadata, each request's state slot (`slots` [B]) first placed on the
        device as `common.state_slots`."""
        n = len(slots)
        host = self._slots_host.numpy()[:n]
        host[:] = slots
        common.state_slots = self._slots_dev[:n]
        if self._slots_dev is not self._slots_host:
            common.state_slots.copy_(self._slots_host[:n], non_blocking=True)
        return self.build(common, num_drafts, host)

    def build(self, common: CommonAttentionMetadata, num_drafts: np.ndarray | None = None,
              slots_cpu: np.ndarray | None = None) -> StateMetadata:
        """`num_drafts` [B]: each request's drafts in a step that verifies some, with the
        state slots on the host (`slots_cpu` [B])."""
        if common.state_slots is None:
            raise ValueError("a step with state layers needs each request's state slot")
        metadata = self._metadata(common.query_start_loc_cpu, common.num_prefills,
                                  common.query_start_loc, common.state_slots,
                                  common.context_lens > 0, common.max_query_len)
        if num_drafts is not None and num_drafts.any():
            if not self.num_speculative_tokens:
                raise RuntimeError("a verify step before set_verify_slots")
            metadata.verify = state_verify.build(
                common.query_start_loc_cpu, slots_cpu, common.context_lens_cpu,
                common.num_prefills, num_drafts, self.num_slots, self.num_speculative_tokens,
                self.device, self._from_host)
        return metadata

    def _from_host(self, qsl: np.ndarray, num_prefills: int, slots: np.ndarray,
                   has_initial_state: np.ndarray) -> StateMetadata:
        """A plain step's metadata from host arrays (a part of a verify step)."""
        def dev(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(self.device, dtype)

        lens = np.diff(qsl)
        return self._metadata(qsl, num_prefills, dev(qsl, torch.int32), dev(slots, torch.int64),
                              dev(has_initial_state, torch.bool),
                              int(lens.max()) if len(lens) else 0)

    def _metadata(self, qsl_cpu: np.ndarray, p: int, query_start_loc: torch.Tensor,
                  state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  max_query_len: int) -> StateMetadata:
        prefill_lens = np.diff(qsl_cpu[:p + 1])
        max_prefill_len = int(prefill_lens.max()) if p else 0
        num_prefill_tokens = int(qsl_cpu[p])
        metadata = StateMetadata(
            num_prefills=p, num_prefill_tokens=num_prefill_tokens,
            num_decodes=len(qsl_cpu) - 1 - p, query_start_loc=query_start_loc,
            state_indices=state_indices, has_initial_state=has_initial_state,
            max_query_len=max_query_len, max_prefill_len=max_prefill_len)
        if p and not self.use_triton:
            token_req = np.repeat(np.arange(p), prefill_lens)
            offset = np.arange(num_prefill_tokens) - qsl_cpu[token_req]
            index = torch.from_numpy(token_req * max_prefill_len + offset)
            metadata.prefill_token_index = index.to(self.device, non_blocking=True)
            metadata.prefill_lens = torch.from_numpy(prefill_lens.astype(np.int64)).to(
                self.device, non_blocking=True)
        return metadata


class StateLayer(nn.Module):
    """Base of the model-facing state layers. A subclass declares its `backend_name` and its
    per-slot tensors (`state_spec`) and exposes the operations its mixer calls, each running
    `self.impl`'s op on `self.states()`."""

    backend_name: ClassVar[str]

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # among the model's state layers
        self.impl: Any = None
        self.layer_spec: StateSpec | None = None

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        """The tensors one slot holds for this layer, for a model running in `dtype`."""
        raise NotImplementedError

    def bind(self, impl: Any, layer_spec: StateSpec) -> None:
        self.impl = impl
        self.layer_spec = layer_spec

    def states(self) -> tuple[dict[str, torch.Tensor], StateMetadata]:
        """This layer's tensors over all slots (name -> [num_slots, *shape]) and the step's
        metadata."""
        if self.impl is None:
            raise RuntimeError(f"{type(self).__name__} {self.layer_idx} has no backend bound")
        ctx = get_forward_context()
        return ctx.state_caches[self.layer_idx], ctx.state_metadata

    def run(self, op: Callable[..., torch.Tensor], tokens: Sequence[torch.Tensor],
            *touched: str) -> torch.Tensor:
        """op(states, metadata, *tokens) -> [T, ...] for this step, `tokens` the per-token
        inputs ([T, ...]) and `touched` the names of the state tensors it reads and writes: in
        a step that verifies drafts, it runs per draft position (attention/state_verify.py)."""
        states, metadata = self.states()
        return run_state_op(lambda md, *xs: op(states, md, *xs), tokens,
                            [states[name] for name in touched], metadata)


class StateBackend(AttentionBackend):
    """A backend for one kind of state layer: registered and listed like the attention
    backends, chosen by the layer's `backend_name`, never for an attention layer. Its impl is
    built with `use_triton` (Triton kernels on CUDA, vectorised torch elsewhere)."""

    builder_cls = StateMetadataBuilder
    metadata_cls = StateMetadata

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        raise ValueError("state layers keep slots, not K/V pages: their shapes are StateSpec's")

    @classmethod
    def get_kv_cache_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} does not apply to {cls.name}'s "
                             "state (kept in the model dtype, recurrent states in float32): "
                             "use auto")
        return model_dtype

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        from pagedserve.attention.ops import state_kernels_enabled

        if torch.cuda.is_available() and state_kernels_enabled(torch.device("cuda")):
            return True, "Triton kernels on CUDA; vectorised torch elsewhere"
        return True, "vectorised torch (Triton kernels need CUDA)"

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        return [f"{cls.name} runs {cls.description} layers only, not attention layers"]
