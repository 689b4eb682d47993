"""Per-step attention metadata: the tensors of DESIGN.md, built with vectorised numpy into
persistent buffers (allocated once at their largest size; each step writes in place and hands
out views, so pointers stay put for CUDA-graph replay)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Built once per step and shared by every layer. Device tensors, plus host mirrors (`*_cpu`,
    numpy) for backends that plan on the host. Requests are in batch order: prefills first."""

    query_start_loc: torch.Tensor  # [B+1] int32, cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens after this step
    context_lens: torch.Tensor  # [B] int32, tokens in the cache before this step
    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with -1
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; -1 = padding
    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    paged_kv_indptr: torch.Tensor  # [B+1] int32 (CSR form of the block table)
    paged_kv_indices: torch.Tensor  # [total_pages] int32
    paged_kv_last_page_len: torch.Tensor  # [B] int32, in 1..block_size
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    context_lens_cpu: np.ndarray
    paged_kv_indptr_cpu: np.ndarray
    paged_kv_last_page_len_cpu: np.ndarray
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    block_size: int
    # SchedulerOutput.context_written_in_step: a backend that fuses its K/V write into
    # attention must write first in such a step.
    context_written_in_step: bool = False


class BlockTable:
    """Each live request's block ids in a persistent row, appended to as it grows, so a step
    gathers rows instead of rebuilding lists."""

    def __init__(self, max_num_reqs: int, max_blocks_per_seq: int) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = np.full((max_num_reqs, max_blocks_per_seq), -1, dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.table[row] = -1
        self.append(row, block_ids)

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_seq:
            raise ValueError(f"a request needs {end} blocks, more than the "
                             f"{self.max_blocks_per_seq} a row holds (max_model_len)")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class CommonMetadataBuilder:
    """Turns a step's (rows, cached lengths, new lengths) into CommonAttentionMetadata."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        pin = device.type == "cuda"
        int32, int64 = torch.int32, torch.int64
        shapes = {
            "query_start_loc": ((max_num_reqs + 1,), int32),
            "seq_lens": ((max_num_reqs,), int32),
            "context_lens": ((max_num_reqs,), int32),
            "block_table": ((max_num_reqs, max_blocks_per_seq), int32),
            "slot_mapping": ((max_num_tokens,), int64),
            "positions": ((max_num_tokens,), int64),
            "paged_kv_indptr": ((max_num_reqs + 1,), int32),
            "paged_kv_indices": ((max_num_reqs * max_blocks_per_seq,), int32),
            "paged_kv_last_page_len": ((max_num_reqs,), int32),
        }
        self.host = {name: _host_buffer(shape, dtype, pin) for name, (shape, dtype) in
                     shapes.items()}
        self.np = {name: t.numpy() for name, t in self.host.items()}
        if device.type == "cpu":
            self.dev = self.host
        else:
            self.dev = {name: torch.zeros(t.shape, dtype=t.dtype, device=device)
                        for name, t in self.host.items()}
        self._arange = np.arange(max(max_num_tokens, max_num_reqs * max_blocks_per_seq) + 1,
                                 dtype=np.int64)

    def build(self, rows: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray,
              num_prefills: int, block_table: BlockTable,
              context_written_in_step: bool = False) -> CommonAttentionMetadata:
        bs = self.block_size
        b = len(rows)
        t = int(num_scheduled.sum())
        h = self.np

        qsl = h["query_start_loc"][: b + 1]
        qsl[0] = 0
        np.cumsum(num_scheduled, out=qsl[1:])
        seq_lens = h["seq_lens"][:b]
        np.add(num_computed, num_scheduled, out=seq_lens)
        h["context_lens"][:b] = num_computed

        table = h["block_table"][:b]
        np.take(block_table.table, rows, axis=0, out=table)

        # Position of every new token: its request's cached length plus its offset in the step.
        token_req = np.repeat(self._arange[:b], num_scheduled)
        positions = h["positions"][:t]
        np.subtract(self._arange[:t], qsl[token_req], out=positions)
        positions += num_computed[token_req]
        slots = h["slot_mapping"][:t]
        np.multiply(table[token_req, positions // bs], bs, out=slots)
        slots += positions % bs

        # CSR page table over the pages each request's context occupies.
        num_pages = (seq_lens + bs - 1) // bs
        indptr = h["paged_kv_indptr"][: b + 1]
        indptr[0] = 0
        np.cumsum(num_pages, out=indptr[1:])
        total_pages = int(indptr[b])
        width = int(num_pages.max()) if b else 0
        mask = self._arange[:width] < num_pages[:, None]
        h["paged_kv_indices"][:total_pages] = table[:, :width][mask]
        last = h["paged_kv_last_page_len"][:b]
        np.subtract(seq_lens, (num_pages - 1) * bs, out=last)

        sizes = {"query_start_loc": b + 1, "seq_lens": b, "context_lens": b, "block_table": b,
                 "slot_mapping": t, "positions": t, "paged_kv_indptr": b + 1,
                 "paged_kv_indices": total_pages, "paged_kv_last_page_len": b}
        views = self._to_device(sizes)
        num_prefill_tokens = int(qsl[num_prefills])
        return CommonAttentionMetadata(
            **views,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=h["context_lens"][:b],
            paged_kv_indptr_cpu=indptr,
            paged_kv_last_page_len_cpu=last,
            num_reqs=b,
            num_actual_tokens=t,
            max_query_len=int(num_scheduled.max()) if b else 0,
            max_seq_len=int(seq_lens.max()) if b else 0,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decodes=b - num_prefills,
            num_decode_tokens=t - num_prefill_tokens,
            block_size=bs,
            context_written_in_step=context_written_in_step,
        )

    def _to_device(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        views = {}
        for name, n in sizes.items():
            dst = self.dev[name][:n]
            if self.dev is not self.host:
                dst.copy_(self.host[name][:n], non_blocking=True)
            views[name] = dst
        return views
