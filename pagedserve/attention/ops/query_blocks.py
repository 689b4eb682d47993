"""Which request and query tokens each program of the paged-attention kernels takes: planned on
the host once per step (numpy, no Triton needed) into persistent buffers."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.attention.metadata import CommonAttentionMetadata


def query_block_map(query_start_loc: np.ndarray, seq_lens: np.ndarray,
                    block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side, once per step: (request, first query token within the request) of every query
    block, heaviest (most keys) first so the long causal blocks do not finish last."""
    q_lens = np.diff(query_start_loc).astype(np.int64)
    blocks = (q_lens + block_q - 1) // block_q
    total = int(blocks.sum())
    req = np.repeat(np.arange(len(q_lens)), blocks)
    first_block = np.cumsum(blocks) - blocks
    start = (np.arange(total) - first_block[req]) * block_q
    context = seq_lens.astype(np.int64)[req] - q_lens[req]
    keys = np.minimum(context + start + block_q, seq_lens[req])
    order = np.argsort(-keys, kind="stable")
    return req[order].astype(np.int32), start[order].astype(np.int32)


class QueryBlockMap:
    """The step's query-block map in a pinned host buffer and a device buffer allocated once (a
    query block holds at least one token, so there are at most max_num_tokens of them); the
    kernels read `req` and `start`, whose pointers never change (CUDA-graph safe)."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        n = max(max_num_tokens, 1)
        on_gpu = device.type != "cpu"
        self._host = torch.zeros((2, n), dtype=torch.int32, pin_memory=on_gpu)
        self._dev = (torch.zeros((2, n), dtype=torch.int32, device=device) if on_gpu
                     else self._host)
        self.req, self.start = self._dev[0], self._dev[1]
        self._host_np = self._host.numpy()

    def fill(self, common: CommonAttentionMetadata, block_q: int, first_req: int = 0,
             end_req: int | None = None) -> int:
        """Plan the blocks of `block_q` query tokens of requests [first_req, end_req) (default:
        the whole step); request ids in the map stay the step's. Returns how many there are."""
        b = common.num_reqs if end_req is None else end_req
        return self.fill_arrays(common.query_start_loc_cpu[first_req:b + 1],
                                common.seq_lens_cpu[first_req:b], block_q, first_req)

    def fill_arrays(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_q: int,
                    first_req: int = 0) -> int:
        """`fill` from host arrays of requests first_req, first_req + 1, ...: a caller that
        plans a subset of the tokens (only some requests' queries, or the new keys alone)
        passes its own query_start_loc / seq_lens."""
        req, start = query_block_map(query_start_loc, seq_lens, block_q)
        if first_req:
            req += np.int32(first_req)
        n = len(req)
        self._host_np[0, :n] = req
        self._host_np[1, :n] = start
        if self._dev is not self._host:
            # One contiguous copy: all of the first row (4 bytes a token of capacity, 32 KiB at
            # 8,192 tokens, whatever n is), then the second row's n; one copy's host cost
            # (~15 us on the H200's host) is more than the bytes' (a strided [2, n] slice would
            # be staged through pageable memory).
            end = self._host.shape[1] + n
            self._dev.view(-1)[:end].copy_(self._host.view(-1)[:end], non_blocking=True)
        return n
