"""The model runner's per-request rows and the step's input ids.

Each live request owns a row of a token table and of a block table, kept between steps, so a
step gathers with index arrays instead of rebuilding Python lists: a decode step's host work is
O(batch). With async scheduling a row may change hands while a step that used it still runs;
`generation` tells the owners apart, and the previous step's samples reach this step's input
ids on the device (`InputIds.queue_patch`), never through the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedserve.scheduler import Request, SchedulerOutput


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


class InputBatch:
    """Row bookkeeping: each live request owns a row of the token table and of the block table
    of each KV cache group (kv_cache/groups.py; one group for most models)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_seq: int,
                 num_groups: int = 1) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_tables = [BlockTable(max_num_reqs, max_blocks_per_seq)
                             for _ in range(num_groups)]
        self.block_table = self.block_tables[0]
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.max_model_len = max_model_len
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)  # bumped when a row changes hands
        # Each row's state slot (models with state layers; -1 otherwise), set on admission.
        self.state_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        self._last_requests: list[Request] = []  # the last step's, and their rows
        self._last_rows = np.empty(0, dtype=np.int64)
        self.same_as_last_step = False  # set by `update`

    def add(self, request: Request, block_ids: tuple[list[int], ...]) -> int:
        """A row for a request; `block_ids`: its blocks in each group."""
        row = self._free_rows.pop()
        self.row_of[request.request_id] = row
        self.generation[row] += 1
        self.token_ids[row, :request.num_tokens] = request.all_token_ids
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(row, ids)
        self.state_slot[row] = request.state_slot
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def update(self, batch: SchedulerOutput) -> np.ndarray:
        """Apply a step's row changes (freed requests, new rows, appended blocks); each batch
        request's row, in batch order."""
        for request_id in batch.freed_request_ids:
            self.remove(request_id)
        # The same requests in the same order as the last step (most decode steps): the same
        # rows, and only the requests given new blocks to look at. (The step's sampling
        # metadata is reused on the same condition.)
        self.same_as_last_step = (batch.requests == self._last_requests
                                  and not any(batch.is_new))
        if self.same_as_last_step:
            for i in [i for i, ids in enumerate(batch.new_block_ids) if any(ids)]:
                self._append_blocks(int(self._last_rows[i]), batch.new_block_ids[i])
            return self._last_rows
        rows = self._rows(batch)
        self._last_requests, self._last_rows = batch.requests, rows
        return rows

    def _rows(self, batch: SchedulerOutput) -> np.ndarray:
        rows = np.empty(batch.num_reqs, dtype=np.int64)
        # One cache group (the common case) without the loop over groups; most decode steps
        # append no block at all.
        single = self.block_table if len(self.block_tables) == 1 else None
        for i, (request, block_ids, is_new) in enumerate(
                zip(batch.requests, batch.new_block_ids, batch.is_new, strict=True)):
            if is_new:
                rows[i] = self.add(request, block_ids)
                continue
            rows[i] = row = self.row_of[request.request_id]
            if single is not None:
                if block_ids[0]:
                    single.append(row, block_ids[0])
            else:
                self._append_blocks(row, block_ids)
        return rows

    def _append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append(row, ids)

    def gather_token_ids(self, rows: np.ndarray, num_scheduled: np.ndarray,
                         positions: np.ndarray, out: np.ndarray) -> None:
        """The step's input ids into `out` [T]: each new token's id from its row at its
        position."""
        token_rows = np.repeat(rows, num_scheduled)
        np.take(self.token_ids.reshape(-1), token_rows * self.max_model_len + positions, out=out)

    def record_samples(self, batch: SchedulerOutput, rows: np.ndarray,
                       generations: np.ndarray, sampled: np.ndarray) -> None:
        """Write each sampling request's new token into its row of the token table. `rows` and
        `generations` are the step's at launch. With a step in flight a row can change hands:
        its request finished, was aborted (a new request's prompt is in the row now) or was
        preempted and readmitted (its row is another, or the same one re-filled). The sample
        goes to the request's current row."""
        seq_lens = batch.num_computed_tokens + batch.num_scheduled_tokens
        if sampled.ndim == 2:  # a verify step: the kept tokens after the last verified one
            seq_lens = seq_lens - batch.num_draft_tokens
        done = batch.will_sample & (seq_lens < self.max_model_len)
        moved = self.generation[rows] != generations
        if moved.any():
            rows = rows.copy()
            for i in np.flatnonzero(moved & done):
                rows[i] = self.row_of.get(batch.requests[i].request_id, -1)
            done &= rows >= 0
        if sampled.ndim == 1:
            self.token_ids[rows[done], seq_lens[done]] = sampled[done]
            return
        # Token j of a row at seq_len + j, for the tokens kept (not -1) within the table.
        positions = seq_lens[:, None] + np.arange(sampled.shape[1])[None, :]
        keep = done[:, None] & (sampled >= 0) & (positions < self.max_model_len)
        self.token_ids[np.broadcast_to(rows[:, None], keep.shape)[keep], positions[keep]] = \
            sampled[keep]

    def write_drafts(self, batch: SchedulerOutput, rows: np.ndarray) -> None:
        """A verify step's drafts into their rows of the token table, after each request's last
        verified token, where the step's input ids are gathered from (a rejected draft stays
        there until a kept token overwrites it: nothing reads past a row's verified tokens
        unless scheduled)."""
        num_drafts = batch.num_draft_tokens.astype(np.int64)
        total = int(num_drafts.sum())
        token_rows = np.repeat(rows, num_drafts)
        starts = np.cumsum(num_drafts) - num_drafts
        within = np.arange(total) - np.repeat(starts, num_drafts)
        positions = np.repeat(batch.num_computed_tokens.astype(np.int64) + 1, num_drafts) + within
        ids = np.fromiter((t for d in batch.draft_token_ids for t in d), np.int64, total)
        self.token_ids[token_rows, positions] = ids


class InputIds:
    """The step's input ids in a persistent buffer (pinned on the host and on the device for
    CUDA), and the device-side patch that puts the previous step's samples into them."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin)
        self.device = self.host if not pin else torch.zeros_like(self.host, device=device)
        # Where a step's previous samples still on the device go, for n of them: [0, n) the
        # indices into this step's input ids, [n, 2n) the previous step's sample rows. Flat, so
        # one contiguous pinned copy carries both.
        self._patch_host = torch.zeros(2 * max_num_reqs, dtype=torch.int64, pin_memory=pin)
        self._patch = (self._patch_host if not pin else
                       torch.zeros_like(self._patch_host, device=device))
        self._row_in_prev = np.full(max_num_reqs, -1, dtype=np.int64)
        self._arange = np.arange(max_num_reqs, dtype=np.int64)
        # The queued patch: the first n ids take it (destinations 0..n-1), and in order.
        self._into_first = self._in_order = False

    def host_view(self, n: int) -> np.ndarray:
        return self.host[:n].numpy()

    def upload(self, start: int, end: int) -> torch.Tensor:
        """Queue the copy of host entries [start, end) to the device; the device view [0, end)."""
        if self.device is not self.host and end > start:
            self.device[start:end].copy_(self.host[start:end], non_blocking=True)
        return self.device[:end]

    def pad(self, start: int, end: int) -> None:
        """Zero entries [start, end) (a CUDA graph's padding tokens) on both sides."""
        if end > start:  # (a step of a captured size has none: no fill queued)
            self.host[start:end] = 0
            self.upload(start, end)

    def queue_patch(self, prev_batch: SchedulerOutput, prev_rows: np.ndarray,
                    batch: SchedulerOutput, rows: np.ndarray,
                    query_start_loc: np.ndarray) -> int:
        """Copy to the device the pairs (input index, previous sample row) of the requests whose
        first new token this step is the one the previous step sampled; returns their count.
        A request new in this step may sit in a row a finished one used: it is never patched."""
        self._row_in_prev[prev_rows] = np.arange(len(prev_rows))
        j = self._row_in_prev[rows]
        self._row_in_prev[prev_rows] = -1
        prev_seq = prev_batch.num_computed_tokens + prev_batch.num_scheduled_tokens
        jj = np.maximum(j, 0)
        take = ((j >= 0) & ~np.asarray(batch.is_new, dtype=bool) & prev_batch.will_sample[jj]
                & (prev_seq[jj] == batch.num_computed_tokens))
        n = int(take.sum())
        self._into_first = self._in_order = False
        if n:
            host = self._patch_host.numpy()
            host[:n] = query_start_loc[:-1][take]
            host[n:2 * n] = j[take]
            # Most decode steps take the samples in order into the first ids (the same batch as
            # the last step's): one device copy then, and no indices to send.
            self._into_first = np.array_equal(host[:n], self._arange[:n])
            self._in_order = self._into_first and np.array_equal(host[n:2 * n], self._arange[:n])
            if not self._in_order and self._patch is not self._patch_host:
                self._patch[:2 * n].copy_(self._patch_host[:2 * n], non_blocking=True)
        return n

    def apply_patch(self, n: int, prev_sampled: torch.Tensor) -> None:
        """On the device, after the step's input copies: put the `n` queued samples in place
        (one launch where the first n ids take them, in order or not)."""
        dst, src = self._patch[:n], self._patch[n:2 * n]
        if self._in_order:
            self.device[:n].copy_(prev_sampled[:n])
        elif self._into_first:
            torch.index_select(prev_sampled, 0, src, out=self.device[:n])
        else:
            self.device.index_copy_(0, dst, prev_sampled.index_select(0, src))
