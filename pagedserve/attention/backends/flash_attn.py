"""FLASH_ATTN backend: FlashAttention kernels over the paged cache, one call per layer for a
whole mixed batch (prefills and decodes together, varlen queries).

The implementation is chosen when the backend is first asked (and logged), in this order:

- `fa3`: FlashAttention-3 (`flash_attn_interface`, Hopper): `flash_attn_with_kvcache` with
  varlen queries (`cu_seqlens_q`), `cache_seqlens` = seq_lens and `page_table` = block table.
- `fa2`: FlashAttention-2 (the `flash_attn` 2.x package, sm80+): `flash_attn_varlen_func` with
  `block_table` and `cu_seqlens_k` = cumsum(seq_lens). Its paged kernel needs block sizes that
  are multiples of 256; with any other block size it runs on gathered pages like `torch` below
  (same gather, FA2's kernel, soft-cap kept).
- `fa4`: FlashAttention-4 (`flash-attn-4`, module `flash_attn.cute`, Hopper/Blackwell): varlen
  forward with `page_table` and `seqused_k`. `num_splits` stays 1 (split KV fails on SM90). With
  a page of 128 it loads pages by TMA and NaN in the unused rows of a last page would poison the
  output; the model runner allocates the cache zeroed and those rows only ever hold old K/V, so
  they stay finite.
- `torch`: PyTorch's own FlashAttention-2 varlen kernel (`aten._flash_attention_forward`, in
  every CUDA build of torch). It has no block table, so each layer first gathers the step's
  context pages into contiguous varlen K/V buffers (`ops.paged_gather`, one Triton kernel) and
  then attends. This moves the whole context twice (read pages + write buffer, then the kernel
  reads the buffer), so it is markedly slower than the paged kernels for long decodes (measured
  on an H200, 64 x 2,048 decode: 223 us kernel + ~295 us gather). It has no logits soft-cap.
  With a sliding window only the pages the window can still see are gathered: the causal mask
  is aligned to the end of K, so dropping a page-aligned prefix of K changes nothing.

`PAGEDSERVE_FLASH_ATTN_IMPL=fa2|fa3|fa4|torch` forces one; a forced implementation that cannot
run makes the backend unavailable with the reason (never a silent fallback).

Every implementation: causal attention aligned to the end of each request's KV (chunked prefill
is right), GQA/MQA without repeating K/V, sliding window as `window_size=(w - 1, 0)`, head sizes
64/128/256, float16 and bfloat16 (float32 is refused), KV cache `[2, num_blocks, block_size,
num_kv_heads, head_size]` (K/V outermost), new K/V written through the slot mapping by the
Triton `reshape_and_cache` kernel (one launch for K and V).

CUDA graphs: the builder's device tensors live in buffers allocated once (pointers stay put).
A step padded for a captured graph (slot_mapping longer than num_actual_tokens, padding slots
-1) is written without a host sync: the write skips slot -1. Before capture the runner calls
`prepare_for_cudagraphs(max_model_len)` (it sets `capture_max_seq_len`) so that launch bounds
(max KV length, the gather grid) stay fixed across replays. The engine captures decode graphs
only with the paged kernels (`FlashAttentionBackend.can_capture_cuda_graphs`): the gather paths
plan their groups on the host per step, and a replayed step could need a different grouping.
For FA4 a graph also removes its Python interface (~80 us of a 64 x 2,048 decode call measured
on an H200).

The gather buffers (torch, and fa2 with small blocks) hold `capacity` tokens of K and of V:
the smaller of `max_num_reqs * max_blocks_per_seq * block_size` (every seat full) and
`max(max_blocks_per_seq * block_size, PAGEDSERVE_FLASH_ATTN_GATHER_TOKENS)` (default 131,072
tokens; one request always fits). They are allocated with the builder, so the runner's memory
profile counts them. A step whose context exceeds the capacity is attended in several groups
of requests (one gather + one kernel call each), so any batch works without growing buffers.

Longer than 500 lines: one backend over four FlashAttention implementations whose probing,
gather planning and calls share one builder and one metadata; split apart, each piece would
need the others' internals.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedserve import envs
from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    BuilderConfig,
)
from pagedserve.attention.metadata import CommonAttentionMetadata

logger = logging.getLogger(__name__)

IMPL_ENV_VAR = "PAGEDSERVE_FLASH_ATTN_IMPL"
GATHER_TOKENS_ENV_VAR = "PAGEDSERVE_FLASH_ATTN_GATHER_TOKENS"
DEFAULT_GATHER_TOKENS = 1 << 17
AUTO_ORDER = ("fa3", "fa2", "fa4", "torch")
SUPPORTED_HEAD_SIZES = (64, 128, 256)


FA2_PAGED_BLOCK_MULTIPLE = 256  # flash_attn 2.x's paged kernel needs these block sizes


@dataclass(frozen=True)
class ImplSpec:
    description: str
    supports_soft_cap: bool


IMPLEMENTATIONS = {
    "fa3": ImplSpec("FlashAttention-3 flash_attn_interface.flash_attn_with_kvcache, paged", True),
    "fa2": ImplSpec("FlashAttention-2 flash_attn.flash_attn_varlen_func, paged for block sizes "
                    "that are multiples of 256, else over gathered pages", True),
    "fa4": ImplSpec("FlashAttention-4 flash_attn.cute.flash_attn_varlen_func with page_table",
                    True),
    "torch": ImplSpec("PyTorch's FlashAttention-2 aten._flash_attention_forward over pages "
                      "gathered by a Triton kernel (moves the context twice)", False),
}


# ---- which implementation runs -----------------------------------------------------------

def _device_problem() -> str | None:
    """Why no FlashAttention kernel can run on this machine's device, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (FLASH_ATTN needs an NVIDIA GPU, sm80 or newer)"
    if torch.version.hip:
        return "ROCm build of torch (use the ROCM backend)"
    return None


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def _probe_fa3() -> tuple[bool, str]:
    major, minor = _capability()
    if major != 9:
        return False, f"FlashAttention-3 needs Hopper (sm90), this GPU is sm{major}{minor}"
    try:
        module = importlib.import_module("flash_attn_interface")
    except Exception as exc:  # not installed, or built for another torch/CUDA
        return False, f"flash_attn_interface (FA3) not importable: {exc}"
    if not hasattr(module, "flash_attn_with_kvcache"):
        return False, "flash_attn_interface has no flash_attn_with_kvcache"
    return True, IMPLEMENTATIONS["fa3"].description


def _probe_fa2() -> tuple[bool, str]:
    major, minor = _capability()
    if major < 8:
        return False, f"FlashAttention-2 needs sm80 or newer, this GPU is sm{major}{minor}"
    try:
        module = importlib.import_module("flash_attn")
    except Exception as exc:
        return False, f"flash_attn (FA2) not importable: {exc}"
    version = str(getattr(module, "__version__", ""))
    if not version.startswith("2.") or not hasattr(module, "flash_attn_varlen_func"):
        return False, f"flash_attn {version or '(no version)'} is not FlashAttention-2"
    return True, f"{IMPLEMENTATIONS['fa2'].description} (flash_attn {version})"


def _probe_fa4() -> tuple[bool, str]:
    major, minor = _capability()
    if major not in (9, 10, 11):
        return False, f"FlashAttention-4 needs Hopper or Blackwell, this GPU is sm{major}{minor}"
    # find_spec, not import: importing flash_attn.cute takes ~10 s, paid only when it is used.
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
        found = found and importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return False, "flash_attn.cute (flash-attn-4) or cutlass (nvidia-cutlass-dsl) not installed"
    return True, IMPLEMENTATIONS["fa4"].description


def _probe_torch() -> tuple[bool, str]:
    major, minor = _capability()
    if major < 8:
        return False, f"torch's FlashAttention needs sm80 or newer, this GPU is sm{major}{minor}"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False, f"torch {torch.__version__} has no aten._flash_attention_forward"
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if not available():
        return False, f"torch {torch.__version__} was built without FlashAttention"
    return True, IMPLEMENTATIONS["torch"].description


PROBES: dict[str, Callable[[], tuple[bool, str]]] = {
    "fa3": _probe_fa3, "fa2": _probe_fa2, "fa4": _probe_fa4, "torch": _probe_torch,
}


@dataclass(frozen=True)
class ImplChoice:
    name: str | None  # None: nothing can run, `reason` says why
    reason: str


_logged_choices: set[ImplChoice] = set()


def choose_implementation() -> ImplChoice:
    """The implementation FLASH_ATTN runs here: the forced one ($PAGEDSERVE_FLASH_ATTN_IMPL) if
    it can run, else the first of fa3, fa2, fa4, torch that can. Logged once per choice."""
    problem = _device_problem()
    if problem is not None:
        return ImplChoice(None, problem)
    forced = envs.PAGEDSERVE_FLASH_ATTN_IMPL
    if forced:
        if forced not in PROBES:
            return ImplChoice(None, f"{IMPL_ENV_VAR}={forced!r} is not one of "
                                    f"{', '.join(PROBES)}")
        ok, why = PROBES[forced]()
        if not ok:
            return ImplChoice(None, f"{IMPL_ENV_VAR}={forced} cannot run: {why}")
        choice = ImplChoice(forced, f"{forced} (forced by {IMPL_ENV_VAR}): {why}")
    else:
        tried = []
        for name in AUTO_ORDER:
            ok, why = PROBES[name]()
            if ok:
                choice = ImplChoice(name, f"{name}: {why}")
                break
            tried.append(f"{name}: {why}")
        else:
            return ImplChoice(None, "no FlashAttention implementation can run: "
                                    + "; ".join(tried))
    if choice not in _logged_choices:
        _logged_choices.add(choice)
        logger.info("FLASH_ATTN implementation: %s", choice.reason)
    return choice


def _require_implementation() -> str:
    choice = choose_implementation()
    if choice.name is None:
        raise RuntimeError(f"FLASH_ATTN cannot run: {choice.reason}")
    return choice.name


def implementation_problems(impl: str, layer: AttentionLayerConfig,
                            block_size: int) -> list[str]:
    """What `impl` cannot do for this layer, beyond the backend-wide checks."""
    spec = IMPLEMENTATIONS[impl]
    reasons = []
    if layer.logits_soft_cap is not None and not spec.supports_soft_cap:
        reasons.append(f"logits soft-cap not supported by FLASH_ATTN's {impl} implementation "
                       "(aten._flash_attention_forward has no soft-cap); install flash-attn "
                       "or flash-attn-4, or choose another backend")
    return reasons


def gathers_pages(impl: str, block_size: int) -> bool:
    """Whether `impl` attends over contiguous copies of the pages instead of the cache."""
    return impl == "torch" or (impl == "fa2" and block_size % FA2_PAGED_BLOCK_MULTIPLE != 0)


# ---- per-step metadata -------------------------------------------------------------------

@dataclass
class GatherGroup:
    """Requests [req_start, req_end) attended with one gather and one kernel call."""

    req_start: int
    req_end: int
    token_start: int
    token_end: int
    max_query_len: int
    max_kv_len: int  # longest gathered K of the group
    max_pages: int  # gather grid bound
    cu_seqlens_q: torch.Tensor  # [n+1] int32, relative to token_start
    cu_seqlens_k: torch.Tensor  # [n+1] int32, rows of the gather buffers


@dataclass
class FlashAttentionMetadata:
    implementation: str
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B+1] int32 (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int32 (seqused_k / cache_seqlens)
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, where each token's K/V lands (-1: padding)
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32, cumsum(seq_lens) (fa2 paged)
    # Gathered pages (torch, fa2 with small blocks); None when the kernel reads the cache.
    page_start: torch.Tensor | None = None  # [B] int32, first gathered page
    groups: list[GatherGroup] = field(default_factory=list)
    k_gather: torch.Tensor | None = None  # [capacity, Hkv, D]
    v_gather: torch.Tensor | None = None


def gather_capacity(config: BuilderConfig) -> int:
    """Tokens of K (and of V) the gather buffers hold; see the module docstring."""
    per_seq = config.max_blocks_per_seq * config.block_size
    setting = envs.PAGEDSERVE_FLASH_ATTN_GATHER_TOKENS
    return min(config.max_num_reqs * per_seq, max(per_seq, setting))


class _Staged:
    """An int32 array staged in (pinned) host memory and mirrored in a persistent device
    buffer: numpy writes in place, then one non-blocking copy of the used prefix."""

    def __init__(self, size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = self.host if device.type == "cpu" else torch.zeros_like(self.host,
                                                                             device=device)

    def upload(self, n: int) -> torch.Tensor:
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, config: BuilderConfig) -> None:
        super().__init__(config)
        self.implementation = _require_implementation()
        # Set before CUDA-graph capture (prepare_for_cudagraphs): the fixed launch bound.
        self.capture_max_seq_len: int | None = None
        device = config.device
        self.gathers = gathers_pages(self.implementation, config.block_size)
        if self.implementation == "fa2" and not self.gathers:
            self._cu_seqlens_k = _Staged(config.max_num_reqs + 1, device)
        if self.gathers:
            # A group of n requests takes n + 1 entries; at most max_num_reqs groups.
            self._cu_q = _Staged(2 * config.max_num_reqs + 1, device)
            self._cu_k = _Staged(2 * config.max_num_reqs + 1, device)
            self._page_start = _Staged(config.max_num_reqs, device)
            self.capacity = gather_capacity(config)
            shape = (self.capacity, config.num_kv_heads, config.head_size)
            self.k_gather = torch.empty(shape, dtype=config.dtype, device=device)
            self.v_gather = torch.empty(shape, dtype=config.dtype, device=device)

    def prepare_for_cudagraphs(self, max_seq_len: int) -> None:
        self.capture_max_seq_len = max_seq_len

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        max_seq_len = max(common.max_seq_len, self.capture_max_seq_len or 0)
        md = FlashAttentionMetadata(
            self.implementation, common.num_actual_tokens, common.max_query_len, max_seq_len,
            common.query_start_loc, common.seq_lens, common.block_table, common.slot_mapping)
        b = common.num_reqs
        if self.gathers:
            self._plan_gather(common, md)
        elif self.implementation == "fa2":
            cu = self._cu_seqlens_k.np
            cu[0] = 0
            np.cumsum(common.seq_lens_cpu[:b], out=cu[1:b + 1])
            md.cu_seqlens_k = self._cu_seqlens_k.upload(b + 1)
        return md

    def _plan_gather(self, common: CommonAttentionMetadata, md: FlashAttentionMetadata) -> None:
        b, bs = common.num_reqs, self.config.block_size
        seq_lens = common.seq_lens_cpu[:b].astype(np.int64)
        qsl = common.query_start_loc_cpu[:b + 1].astype(np.int64)
        page_start = self._page_start.np[:b]
        window = self.config.sliding_window
        if window is None:
            page_start[:] = 0
        else:
            # The first new token sees keys from context_len - (window - 1) on.
            first_key = np.maximum(common.context_lens_cpu[:b].astype(np.int64) - (window - 1), 0)
            page_start[:] = first_key // bs
        kv_lens = seq_lens - page_start.astype(np.int64) * bs
        cum_k = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(kv_lens, out=cum_k[1:])

        # Requests split into groups whose gathered K fits the buffers (usually one group).
        if b and int(kv_lens.max()) > self.capacity:
            raise RuntimeError(f"a request needs {int(kv_lens.max())} gathered tokens, more "
                               f"than the {self.capacity} the gather buffers hold")
        bounds = [0]
        while bounds[-1] < b:
            start = bounds[-1]
            end = int(np.searchsorted(cum_k, cum_k[start] + self.capacity, side="right")) - 1
            bounds.append(end)
        if self.capture_max_seq_len is not None and len(bounds) > 2:
            raise RuntimeError(f"a captured step needs {int(cum_k[-1])} gathered tokens, more "
                               f"than the {self.capacity} the buffers hold; raise "
                               f"{GATHER_TOKENS_ENV_VAR}")
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        offsets = []
        offset = 0
        for start, end in spans:  # per group, not per token
            self._cu_q.np[offset:offset + end - start + 1] = qsl[start:end + 1] - qsl[start]
            self._cu_k.np[offset:offset + end - start + 1] = cum_k[start:end + 1] - cum_k[start]
            offsets.append(offset)
            offset += end - start + 1
        cu_q, cu_k = self._cu_q.upload(offset), self._cu_k.upload(offset)
        md.page_start = self._page_start.upload(b)
        md.k_gather, md.v_gather = self.k_gather, self.v_gather

        q_lens = qsl[1:] - qsl[:-1]
        for (start, end), off in zip(spans, offsets, strict=True):
            max_kv = int(kv_lens[start:end].max())
            if self.capture_max_seq_len is not None:
                max_kv = max(max_kv, self.capture_max_seq_len)
            md.groups.append(GatherGroup(
                start, end, int(qsl[start]), int(qsl[end]), int(q_lens[start:end].max()),
                max_kv, -(-max_kv // bs), cu_q[off:off + end - start + 1],
                cu_k[off:off + end - start + 1]))


# ---- the layer's attention ---------------------------------------------------------------

class FlashAttentionImpl(AttentionImpl):
    supports_encoder_only = True
    def __init__(self, layer: AttentionLayerConfig) -> None:
        super().__init__(layer)
        self.implementation = _require_implementation()
        if layer.logits_soft_cap is not None and not IMPLEMENTATIONS[
                self.implementation].supports_soft_cap:
            raise ValueError(f"logits soft-cap not supported by FLASH_ATTN's "
                             f"{self.implementation} implementation")
        # FlashAttention's window: keys in [i - left, i + right] around the aligned position.
        self.window_left = -1 if layer.sliding_window is None else layer.sliding_window - 1
        self._attend = {"fa3": self._attend_fa3, "fa2": self._attend_fa2,
                        "fa4": self._attend_fa4,
                        "torch": self._attend_gathered}[self.implementation]
        self._kernel = _load_kernel(self.implementation)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FlashAttentionMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        if md.implementation != self.implementation:
            raise RuntimeError(f"metadata built for {md.implementation}, layer runs "
                               f"{self.implementation}")
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv(k_cache, v_cache, key, value, md)
        if output is None:
            output = torch.empty_like(query)
        if md.num_actual_tokens == 0:
            return output
        self._attend(query, k_cache, v_cache, md, output)
        return output

    def forward_encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_metadata: Any, output: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder-only layers: the implementation's varlen call, causal=False."""
        from pagedserve.attention.backends.encoder_gpu import flash_attn_encoder

        return flash_attn_encoder(self.implementation, query, key, value, attn_metadata,
                                  self.scale, output, self.sliding_window)

    def _window(self) -> tuple[int, int]:
        return (self.window_left, 0) if self.sliding_window is not None else (-1, -1)

    def _attend_fa3(self, query, k_cache, v_cache, md, output) -> None:
        out = self._kernel(query, k_cache, v_cache, cache_seqlens=md.seq_lens,
                           page_table=md.block_table, cu_seqlens_q=md.query_start_loc,
                           max_seqlen_q=md.max_query_len, softmax_scale=self.scale,
                           causal=True, window_size=self._window(),
                           softcap=self.logits_soft_cap or 0.0)
        output.copy_(out)

    def _attend_fa2(self, query, k_cache, v_cache, md, output) -> None:
        if md.k_gather is not None:
            self._attend_gathered(query, k_cache, v_cache, md, output)
            return
        out = self._kernel(query, k_cache, v_cache, md.query_start_loc, md.cu_seqlens_k,
                           md.max_query_len, md.max_seq_len, softmax_scale=self.scale,
                           causal=True, window_size=self._window(),
                           softcap=self.logits_soft_cap or 0.0, block_table=md.block_table)
        output.copy_(out)

    def _attend_fa4(self, query, k_cache, v_cache, md, output) -> None:
        extra = {}
        if self.sliding_window is not None:
            extra["window_size"] = (self.window_left, 0)
        if self.logits_soft_cap is not None:
            extra["softcap"] = self.logits_soft_cap
        out = self._kernel(query, k_cache, v_cache, cu_seqlens_q=md.query_start_loc,
                           seqused_k=md.seq_lens, max_seqlen_q=md.max_query_len,
                           page_table=md.block_table, softmax_scale=self.scale, causal=True,
                           num_splits=1, **extra)
        output.copy_(out[0] if isinstance(out, tuple) else out)

    def _attend_gathered(self, query, k_cache, v_cache, md, output) -> None:
        """Per group of requests: copy their visible pages into the contiguous buffers, then
        one varlen kernel call over them (torch's FA2, or flash_attn's FA2)."""
        from pagedserve.attention.ops.paged_gather import paged_gather

        for g in md.groups:
            reqs = slice(g.req_start, g.req_end)
            paged_gather(k_cache, v_cache, md.k_gather, md.v_gather, md.block_table[reqs],
                         md.seq_lens[reqs], g.cu_seqlens_k, g.max_pages, md.page_start[reqs])
            q = query[g.token_start:g.token_end]
            if self.implementation == "torch":
                window = {}
                if self.sliding_window is not None:
                    window = {"window_size_left": self.window_left, "window_size_right": 0}
                out = self._kernel(q, md.k_gather, md.v_gather, g.cu_seqlens_q, g.cu_seqlens_k,
                                   g.max_query_len, g.max_kv_len, 0.0, True, False,
                                   scale=self.scale, **window)[0]
            else:
                out = self._kernel(q, md.k_gather, md.v_gather, g.cu_seqlens_q, g.cu_seqlens_k,
                                   g.max_query_len, g.max_kv_len, softmax_scale=self.scale,
                                   causal=True, window_size=self._window(),
                                   softcap=self.logits_soft_cap or 0.0)
            output[g.token_start:g.token_end].copy_(out)


def _load_kernel(implementation: str) -> Callable:
    if implementation == "fa3":
        return importlib.import_module("flash_attn_interface").flash_attn_with_kvcache
    if implementation == "fa2":
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    if implementation == "fa4":
        return importlib.import_module("flash_attn.cute").flash_attn_varlen_func
    return torch.ops.aten._flash_attention_forward


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, md: FlashAttentionMetadata) -> None:
    """Scatter the step's new K/V [T, Hkv, D] into [num_blocks, block_size, Hkv, D] caches."""
    from pagedserve.attention.ops.reshape_and_cache import reshape_and_cache  # triton

    reshape_and_cache(key, value, k_cache, v_cache, md.slot_mapping)


class FlashAttentionBackend(AttentionBackend):
    name = "FLASH_ATTN"
    supported_head_sizes = SUPPORTED_HEAD_SIZES
    supported_dtypes = (torch.float16, torch.bfloat16)
    supports_sliding_window = True
    supports_soft_cap = True  # fa2/fa3/fa4; the torch implementation refuses it
    # Values of another head size (192/128): fa2 and torch's kernel take one head size for K
    # and V, and fa3's paged path takes 192/128 only in some builds, which nothing here probes
    # and no GPU has checked: refused by name until one does (TRITON runs such layers).
    supports_diff_kv = False
    supports_encoder_only = True  # each implementation's varlen call, causal=False
    supports_encoder_window = True  # window_size=(w - 1, w - 1)
    description = "FlashAttention (FA3, FA2, FA4 or torch's FA2 over gathered pages)"

    impl_cls = FlashAttentionImpl
    builder_cls = FlashAttentionMetadataBuilder
    metadata_cls = FlashAttentionMetadata

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        choice = choose_implementation()
        return choice.name is not None, choice.reason

    @classmethod
    def is_fallback(cls) -> bool:
        """The torch path (FlashAttention's kernels missing) gathers every page into
        contiguous K/V each step and cannot be captured in CUDA graphs: 25% of the copy rate
        at decode on the H200 against TRITON's 98% (docs/gpu-results.md)."""
        return choose_implementation().name == "torch"

    @classmethod
    def can_capture_cuda_graphs(cls, block_size: int) -> bool:
        """The paged kernels (fa3, fa4, fa2 at its block sizes) launch one call on persistent
        buffers and capture; the gather paths plan their groups on the host per step, so a
        graph could not follow a step whose context needs another group."""
        impl = choose_implementation().name
        return impl is not None and not gathers_pages(impl, block_size)

    @classmethod
    def features(cls) -> list[str]:
        return super().features() + ["cuda-graphs(paged kernels)"]

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        reasons = super().validate_configuration(layer, block_size, device)
        if device.type != "cuda":
            reasons.append(f"FLASH_ATTN runs on CUDA devices, not {device.type}")
        choice = choose_implementation()
        if choice.name is None:
            reasons.append(choice.reason)
        else:
            reasons += implementation_problems(choice.name, layer, block_size)
        return reasons
