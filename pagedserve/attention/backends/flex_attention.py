"""FLEX_ATTENTION backend: PyTorch's `torch.nn.attention.flex_attention` over the paged cache.

The step is attended as one flex call per layer with batch 1: the queries are the step's
packed new tokens [T]; the keys are every request's whole context (cached + new), gathered
from its pages into one packed key sequence [K] (K = sum of seq_lens). The builder does the
per-step work once for all layers of a configuration: the physical slot of each packed key,
the request and absolute position of each query and key, and a `BlockMask` from a mask_mod
over those (same request, causal on absolute positions, the sliding window where the layer has
one). Everything is vectorised torch; no per-token Python loop.

Soft-cap is a score_mod (cap * tanh(s / cap)); attention sinks are exact from the LSE flex
returns: the sink column adds exp(sink) to the softmax denominator, so the output is rescaled
by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), in float32. GQA is flex's own
`enable_gqa`. Values of another head size need nothing more (flex takes V's last dimension as
it comes), so DiffKV layers run on the base class's side-by-side cache layout.

On the CPU flex runs eagerly (an unfused implementation that materialises the [H, T, K]
scores): slow, exact, and what the tests run. On CUDA the builder's `warmup` compiles
flex_attention once (`torch.compile`); that path is untested here (no GPU in CI).

Adding a custom score_mod or mask_mod: subclass `FlexAttentionMetadataBuilder` and extend
`mask_mod` (combine with `torch.nn.attention.flex_attention.and_masks`), or subclass
`FlexAttentionImpl` and extend `score_mod`. Both receive packed indices (q_idx over the step's
tokens, kv_idx over the packed keys); translate them with the metadata's tensors
(`q_req`/`q_pos` and `kv_req`/`kv_pos`: request and absolute position), e.g. a prefix-LM
mask_mod is `base(b, h, q, kv) | (md.kv_req[kv] == md.q_req[q]) & (md.kv_pos[kv] < prefix)`.
Then register the subclass as a backend of its own name (registry.register_backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
)
from pagedserve.attention.backends.cpu import write_kv
from pagedserve.attention.metadata import CommonAttentionMetadata

# flex_attention's own sparse tile: the block mask skips whole tiles of other requests.
_MASK_BLOCK = 128


def _flex_module() -> Any:
    """The flex_attention module, imported on first use (absent from old torch builds)."""
    from torch.nn.attention import flex_attention

    return flex_attention


@dataclass
class FlexAttentionMetadata:
    common: CommonAttentionMetadata
    num_tokens: int  # the step's real tokens (query rows attended)
    kv_slot: torch.Tensor  # [K] int64 physical cache slot of each packed key
    q_req: torch.Tensor  # [T] int64 request of each query
    q_pos: torch.Tensor  # [T] int64 absolute position of each query
    kv_req: torch.Tensor  # [K] int64 request of each packed key
    kv_pos: torch.Tensor  # [K] int64 absolute position of each packed key
    block_mask: Any  # flex's BlockMask over [T, K]


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        n, b = common.num_actual_tokens, common.num_reqs
        device = common.query_start_loc.device
        seq_lens = common.seq_lens[:b].long()
        qsl = common.query_start_loc[:b + 1].long()
        reqs = torch.arange(b, device=device)
        num_keys = int(common.seq_lens_cpu[:b].sum())
        kv_req = torch.repeat_interleave(reqs, seq_lens, output_size=num_keys)
        kv_start = torch.cumsum(seq_lens, 0) - seq_lens
        kv_pos = torch.arange(num_keys, device=device) - kv_start[kv_req]
        bs = common.block_size
        blocks = common.block_table[kv_req, kv_pos // bs].long()
        kv_slot = blocks * bs + kv_pos % bs
        q_req = torch.repeat_interleave(reqs, qsl[1:] - qsl[:-1], output_size=n)
        q_pos = common.positions[:n].long()
        md = FlexAttentionMetadata(common, n, kv_slot, q_req, q_pos, kv_req, kv_pos, None)
        md.block_mask = _flex_module().create_block_mask(
            self.mask_mod(md), None, None, n, num_keys, device=device, BLOCK_SIZE=_MASK_BLOCK)
        return md

    def mask_mod(self, md: FlexAttentionMetadata) -> Callable[..., torch.Tensor]:
        """True where query q_idx may see packed key kv_idx: the same request, causal on
        absolute positions, and inside the sliding window (which counts the query itself)."""
        window = self.config.sliding_window

        def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                   kv_idx: torch.Tensor) -> torch.Tensor:
            q_pos, kv_pos = md.q_pos[q_idx], md.kv_pos[kv_idx]
            return (md.q_req[q_idx] == md.kv_req[kv_idx]) & (kv_pos <= q_pos)

        def windowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
            inside = md.kv_pos[kv_idx] > md.q_pos[q_idx] - window
            return causal(b, h, q_idx, kv_idx) & inside

        return causal if window is None else windowed

    def warmup(self) -> None:
        """Compile flex_attention on CUDA (eager elsewhere). Untested: no GPU in CI."""
        if self.config.device.type == "cuda":
            FlexAttentionImpl.compile_flex()


class FlexAttentionImpl(AttentionImpl):
    supports_sinks = True
    supports_diff_kv = True
    # flex_attention itself, replaced by its compiled form by `compile_flex` (CUDA warm-up).
    _flex: Callable[..., Any] | None = None

    @classmethod
    def compile_flex(cls) -> None:
        if FlexAttentionImpl._flex is None:
            FlexAttentionImpl._flex = torch.compile(_flex_module().flex_attention)

    def score_mod(self) -> Callable[..., torch.Tensor] | None:
        """The layer's logit transform (after scaling, before masking): soft-cap or none."""
        cap = self.logits_soft_cap
        if cap is None:
            return None

        def soft_cap(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
            return cap * torch.tanh(score / cap)

        return soft_cap

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FlexAttentionMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        n = md.num_tokens
        k_cache, v_cache = FlexAttentionBackend.kv_cache_views(kv_cache, self.layer.head_size_v)
        write_kv(k_cache, v_cache, key[:n], value[:n], md.common.slot_mapping[:n])
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.value_head_size)
        if n == 0:
            return output
        # [K, Hkv, D] gathered by slot -> [1, Hkv, K, D]; queries [n, H, D] -> [1, H, n, D].
        k = k_cache.flatten(0, 1)[md.kv_slot].transpose(0, 1)[None].to(query.dtype)
        v = v_cache.flatten(0, 1)[md.kv_slot].transpose(0, 1)[None].to(query.dtype)
        q = query[:n].transpose(0, 1)[None]
        out, lse = self._attend(q, k, v, md.block_mask)
        sinks = self.bound_sinks()
        if sinks is not None:
            # The sink column only enlarges the denominator: out * sum / (sum + exp(sink)).
            rescale = torch.sigmoid(lse.float() - sinks.detach().float()[None, :, None])
            out = (out.float() * rescale[..., None]).to(query.dtype)
        output[:n] = out[0].transpose(0, 1)
        return output

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                block_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
        flex = _flex_module()
        compiled = FlexAttentionImpl._flex
        use_compiled = compiled is not None and q.is_cuda
        fn = compiled if use_compiled else flex.flex_attention
        # Fewer than 128 queries (decode steps) would route to torch's flex-decoding kernel,
        # which found no valid launch configuration for the packed layout (GQA, one batch row,
        # every request's keys; torch 2.11 on the H200): the main kernel handles any length.
        options = ({"FORCE_USE_FLEX_ATTENTION": True}
                   if use_compiled and q.shape[2] < _MASK_BLOCK else None)
        out, aux = fn(q, k, v, score_mod=self.score_mod(), block_mask=block_mask,
                      scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads,
                      kernel_options=options, return_aux=flex.AuxRequest(lse=True))
        return out, aux.lse


class FlexAttentionBackend(AttentionBackend):
    name = "FLEX_ATTENTION"
    supports_sliding_window = True
    supports_soft_cap = True
    supports_sinks = True
    supports_diff_kv = True
    description = "torch flex_attention (block mask over gathered pages); eager on CPU"

    impl_cls = FlexAttentionImpl
    builder_cls = FlexAttentionMetadataBuilder
    metadata_cls = FlexAttentionMetadata

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        try:
            flex = _flex_module()
        except ImportError as exc:
            return False, f"torch.nn.attention.flex_attention not importable: {exc}"
        if not hasattr(flex, "AuxRequest"):
            return False, f"torch {torch.__version__} too old: flex_attention lacks AuxRequest"
        return True, "torch flex_attention (eager on CPU, compiled on CUDA)"
