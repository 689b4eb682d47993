"""FLASHINFER's CUDA graphs of uniform verify steps (speculative decoding, engine/verify_graphs.py):
every request has q = 1+K new tokens, the scheduler classes them as prefills, and the step is
padded to a captured size by the common builder's `pad_decode` (a padding request: q tokens at
positions 0..q-1, slot -1, the one page 0 with last-page length q).

Such a step runs FlashInfer's paged prefill wrapper (causal) in its CUDA-graph mode, one wrapper
per padded size (FlashInfer fixes a graph wrapper's batch size): its indptrs, page ids and
last-page lengths live in fixed device buffers, which `plan()` rewrites before every replay,
and with the graph mode on its scheduler sizes the launch (tiles, KV splits) from the batch
size and total rows alone, which a uniform step of one size keeps. Where its `plan()` takes
`uniform_q_len` (FlashInfer 0.7.4 does), it is told q: its scheduler then sizes the query
tile for q x (query heads per KV head) rows, not for the ragged worst case of one request
holding nearly every row. With that worst case, the split-KV partials of the 8B shape's
verify graphs (batch 32, q = 4) asked for 150 MB of the 128 MiB workspace on an H100, so
they ran eagerly. The decode path (q = 1,
`FlashInferMetadataBuilder.build_for_cudagraph`) is untouched.

The attention-sink variant (gpt-oss) is not captured for verify steps: its wrapper's graph mode
is not checked here, so a sink layer's builder says so (`verify_graph_reason`) and the engine
runs its verify steps eagerly.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.attention.backends.flashinfer_metadata import FlashInferMetadata
from pagedserve.attention.metadata import CommonAttentionMetadata

SINK_REASON = ("FlashInfer's attention-sink variant is captured for decode steps only "
               "(gpt-oss's verify steps run eagerly)")


@dataclass
class UniformCSR:
    """FlashInfer's CSR of a padded uniform step: host arrays (views of the common builder's
    pinned buffers); the page ids stay on the device, `paged_kv_indices[:num_pages]`."""

    qo_indptr: np.ndarray  # [bp+1] int32, 0, q, 2q, ...
    kv_indptr: np.ndarray  # [bp+1] int32
    kv_last_page_len: np.ndarray  # [bp] int32, in 1..block_size
    num_pages: int


def uniform_csr(padded: CommonAttentionMetadata, num_reqs_padded: int) -> UniformCSR:
    """The CSR of `padded`, a uniform step of `num_reqs_padded` requests of q new tokens each
    (`pad_decode`'s output); a one-line error when it is not one."""
    bp, q = num_reqs_padded, padded.max_query_len
    if padded.num_reqs != bp or padded.num_actual_tokens != bp * q:
        raise ValueError(f"a verify graph step is {bp} requests of {q} tokens, got "
                         f"{padded.num_reqs} requests and {padded.num_actual_tokens} tokens")
    kv = padded.paged_kv_indptr_cpu[:bp + 1]
    return UniformCSR(padded.query_start_loc_cpu[:bp + 1], kv,
                      padded.paged_kv_last_page_len_cpu[:bp], int(kv[bp]))


@functools.cache
def plan_takes_uniform_q_len(wrapper_cls: type) -> bool:
    """Whether this FlashInfer's paged prefill `plan()` takes the `uniform_q_len` hint."""
    return "uniform_q_len" in inspect.signature(wrapper_cls.plan).parameters


class FlashInferVerifyBuilder:
    """Mixed into FlashInfer's builder (which supplies config, device, workspace, _flashinfer,
    _plan_kwargs, and calls _init_verify_graphs): graph metadata of uniform steps of q > 1
    tokens a request."""

    def verify_graph_reason(self) -> str | None:
        """Why this configuration's verify steps run eagerly; None: they are captured."""
        return SINK_REASON if self.config.has_sinks else None

    def build_verify_graph(self, common: CommonAttentionMetadata, num_reqs_padded: int,
                           padded: CommonAttentionMetadata | None) -> FlashInferMetadata:
        """Plan the padded size's graph wrapper over `padded` (the real step `common` padded to
        `num_reqs_padded` requests) and return the step's metadata: every token a prefill
        token, slots from the padded step (-1 on the padding), no decode part."""
        c = self.config
        n, q, bp = common.num_reqs, common.max_query_len, num_reqs_padded
        reason = self.verify_graph_reason()
        if reason is not None:
            raise ValueError(reason)
        if padded is None or not 0 < n <= bp or common.num_actual_tokens != n * q:
            raise ValueError(f"a verify graph step is 1..{bp} requests of {q} tokens each and "
                             f"its padded step, got {n} requests and "
                             f"{common.num_actual_tokens} tokens")
        csr = uniform_csr(padded, bp)
        wrapper = self._verify_graphs.get((bp, q)) or self._new_verify_graph(bp, q)
        uniform = ({"uniform_q_len": q} if plan_takes_uniform_q_len(type(wrapper)) else {})
        # plan() copies the host arrays and the page ids into the wrapper's fixed buffers.
        wrapper.plan(
            torch.from_numpy(csr.qo_indptr), torch.from_numpy(csr.kv_indptr),
            padded.paged_kv_indices[:csr.num_pages], torch.from_numpy(csr.kv_last_page_len),
            c.num_heads, c.num_kv_heads, c.head_size, c.block_size, causal=True,
            **uniform, **self._plan_kwargs())
        return FlashInferMetadata(
            num_prefill_tokens=bp * q, num_decode_tokens=0,
            slot_mapping=padded.slot_mapping[:bp * q], prefill=wrapper, decode=None)

    def _init_verify_graphs(self) -> None:
        # flashinfer.BatchPrefillWithPagedKVCacheWrapper in CUDA-graph mode, by (size, q)
        self._verify_graphs: dict[tuple[int, int], Any] = {}
        self._verify_graph_buffers: dict[str, torch.Tensor] | None = None

    def _verify_buffers(self) -> dict[str, torch.Tensor]:
        """The graph wrappers' fixed buffers, at their largest, shared by every size (one graph
        replays a step, and its plan() rewrites them just before)."""
        if self._verify_graph_buffers is None:
            c = self.config
            r = c.max_num_reqs
            sizes = {"qo_indptr": r + 1, "kv_indptr": r + 1, "last_page_len": r,
                     "kv_indices": r * c.max_blocks_per_seq}
            self._verify_graph_buffers = {
                name: torch.zeros(n, dtype=torch.int32, device=self.device)
                for name, n in sizes.items()}
        return self._verify_graph_buffers

    def _new_verify_graph(self, bp: int, q: int) -> Any:
        bufs = self._verify_buffers()
        wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs["qo_indptr"][:bp + 1],
            paged_kv_indptr_buf=bufs["kv_indptr"][:bp + 1],
            paged_kv_indices_buf=bufs["kv_indices"],
            paged_kv_last_page_len_buf=bufs["last_page_len"][:bp])
        self._verify_graphs[(bp, q)] = wrapper
        return wrapper
