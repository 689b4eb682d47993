"""The model's head (hidden states -> logits) after a replayed decode graph, in CUDA graphs of
its own, one per captured size and kind:

- greedy: the head and the argmax, for steps whose every row takes its argmax and asks
  nothing else of the logits; only the token ids leave the graph.
- logits: the head into one persistent float32 buffer [largest size, V], for the other decode
  steps (sampling, penalties, guided masks). The buffer's copy (~10-30 us of GPU time at 64-256
  rows of a 49k vocabulary) is the price of not launching the head's GEMM from the host: 60-80
  us of host time a step on the H200's host, where a small model's step is host-bound.

Each graph reads its size's forward output; the head's intermediates are the graph pool's
scratch, reused by every size. Rows are independent, so padding rows change nothing but the
GEMM's rounding (cuBLAS picks its kernel by the row count). The logits buffer and each size's
ids are rewritten by the next decode step's head: everything that reads them (the sampler,
a deferred guided sampling, the samples' copy to the host, the next step's input patch) is
queued before that, in stream order. The buffer and the pool's scratch (~10 bytes x rows x
vocabulary at the largest size: ~330 MB for 256 rows of a 128k vocabulary) come out of the
memory the KV cache leaves (gpu_memory_utilization's remainder), as the forwards' graphs do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Head = Callable[[torch.Tensor], torch.Tensor]


class HeadGraphs:
    """Head graphs over the forward graphs' `outputs` (size -> hidden states); with `capture`
    off, the same head runs eagerly on the padded hidden states (machines without CUDA)."""

    def __init__(self, compute_logits: Head, outputs: dict[int, torch.Tensor], pool: object,
                 capture: bool = True) -> None:
        self.compute_logits = compute_logits
        self.outputs = outputs
        self.pool = pool
        self.capture_graphs = capture
        # size -> (graph, its ids) and size -> graph (its logits: the shared buffer)
        self.greedy: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.logits: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits_buffer: torch.Tensor | None = None

    def capture(self, device: torch.device) -> None:
        """Both kinds for every size, largest first."""
        sizes = sorted(self.outputs, reverse=True)
        width = self.compute_logits(self.outputs[sizes[0]]).shape[-1]
        self._logits_buffer = torch.empty(sizes[0], width, dtype=torch.float32, device=device)
        for size in sizes:
            hidden = self.outputs[size]
            for _ in range(2):  # cuBLAS picks its algorithm outside the capture
                _argmax(self.compute_logits(hidden))
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                ids = _argmax(self.compute_logits(hidden))
            self.greedy[size] = (graph, ids)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._logits_buffer[:size].copy_(self.compute_logits(hidden))
            self.logits[size] = graph

    def greedy_tokens(self, size: int, hidden: torch.Tensor, num_reqs: int
                      ) -> torch.Tensor | None:
        """The argmax token of the first `num_reqs` rows of `hidden`, the step just replayed at
        `size`; None without that size's graph."""
        if not self.capture_graphs:
            return _argmax(self.compute_logits(hidden))[:num_reqs]
        entry = self.greedy.get(size)
        if entry is None:
            return None
        entry[0].replay()
        return entry[1][:num_reqs]

    def head_logits(self, size: int, hidden: torch.Tensor, num_reqs: int
                    ) -> torch.Tensor | None:
        """Float32 logits of the first `num_reqs` rows (a view of the persistent buffer, valid
        until the next decode step's head); None without that size's graph."""
        if not self.capture_graphs:
            return self.compute_logits(hidden)[:num_reqs]
        graph = self.logits.get(size)
        if graph is None or self._logits_buffer is None:
            return None
        graph.replay()
        return self._logits_buffer[:num_reqs]

    def check(self, size: int, hidden: torch.Tensor, num_reqs: int) -> None:
        """Both kinds against the eager head over the same hidden states: the logits within
        rounding, each greedy token its row's largest up to rounding (a graph reading stale
        memory is far off either)."""
        eager = self.compute_logits(hidden)[:num_reqs].float()
        logits = self.head_logits(size, hidden, num_reqs)
        ids = self.greedy_tokens(size, hidden, num_reqs)
        if logits is None or ids is None:
            raise RuntimeError(f"no head graph of size {size}")
        diff = float((logits - eager).abs().max() / eager.abs().max().clamp_min(1e-6))
        if not diff <= 1e-2:
            raise RuntimeError(f"the head graph's logits differ from the eager head's by "
                               f"{diff:.3g} (relative)")
        check_greedy_tokens(ids, eager)


def check_greedy_tokens(ids: torch.Tensor, logits: torch.Tensor) -> None:
    """Raise unless each of `ids` is its row's largest of `logits` (the eager head over the
    same hidden states), up to rounding."""
    chosen = logits.gather(1, ids.long().unsqueeze(1)).squeeze(1)
    best = logits.max(dim=-1).values
    gap = float(((best - chosen) / best.abs().clamp_min(1.0)).max())
    if not gap <= 1e-3:
        raise RuntimeError(f"the head graph's greedy tokens are {gap:.3g} below the eager "
                           "maximum (relative)")


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """What the sampler does with an all-greedy step's float32 logits."""
    return logits.argmax(dim=-1)
