"""A step's LoRA routing: which device slot each token uses (-1: the base model), in the
shapes each product wants, all worked out on the host from what the scheduler decided.

- `token_slots` (off CUDA only, [max_tokens]): one slot per token, -1 past the step's tokens
  (the CPU's masked product reads it; the kernels read the blocks).
- blocks by slot (device, fixed addresses): `sorted_rows`, the step's adapter tokens sorted
  by slot (base tokens left out), cut into blocks of at most BLOCK_ROWS tokens of one slot,
  `blocks` [n, 3] = (slot, first, end) indices into `sorted_rows`. A CUDA kernel program takes
  one block. Their grid is `num_blocks`, a host int known before launch, or under a CUDA
  graph `grid_blocks(rows)`, every block a step of that many rows can have (each slot's run
  ends in at most one part-filled block); the entries past a step's blocks are empty
  (first == end). So no step ever syncs on the device, and the grid never spans the slots.
- `groups` (the torch path): each adapter's tokens, as a slice when they are contiguous,
  else as an index tensor.
"""

from __future__ import annotations

import numpy as np
import torch

BASE_SLOT = -1
BLOCK_ROWS = 16  # tokens of one slot a kernel program takes (tl.dot's least)


class LoRABatch:
    """The step's routing, rewritten in place by `set` before every step."""

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.num_slots = num_slots
        self._allocate(max_tokens)
        self.num_tokens = 0
        self.num_blocks = 0  # this step's blocks of one slot's tokens
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.active = False  # a token with an adapter: else the wrappers skip the products
        # A decode graph is being captured (or replayed): the products run whatever the step,
        # their grid over every row the graph has, reading the runs from their fixed buffers.
        self.graph_mode = False
        # Triton's kernels off CUDA too (tests run them in the interpreter through the layers).
        self.use_kernels = self.device.type == "cuda"

    def _allocate(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        # The torch paths' routing; None on CUDA, where the kernels read the blocks.
        self.token_slots = None if self.device.type == "cuda" else torch.full(
            (max_tokens,), BASE_SLOT, dtype=torch.int32)
        self.sorted_rows = torch.zeros(max_tokens, dtype=torch.int32, device=self.device)
        self.max_blocks = -(-max_tokens // BLOCK_ROWS) + self.num_slots
        self.blocks = torch.zeros(self.max_blocks, 3, dtype=torch.int32, device=self.device)
        self._written = 0  # token_slots entries that may hold a slot (the rest are -1)
        self._blocks_written = 0  # block entries that may be non-empty
        # On CUDA the host arrays go through one of two pinned buffers, copied without waiting
        # for the device (a pageable copy would wait for the step in flight); a buffer is
        # reused two steps later, after the event recorded behind its copy.
        pin = self.device.type == "cuda"
        self._staging = [torch.empty(max_tokens + 3 * self.max_blocks, dtype=torch.int32,
                                     pin_memory=True)
                         for _ in range(2 if pin else 0)]
        self._copied = [torch.cuda.Event() for _ in range(2 if pin else 0)]
        self._parity = 0

    def set(self, per_request: np.ndarray, num_tokens: np.ndarray) -> None:
        """Request i uses slot `per_request[i]` (-1: the base) for `num_tokens[i]` tokens."""
        per_request = np.asarray(per_request, dtype=np.int32)
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        slots = np.repeat(per_request, num_tokens)
        t = int(slots.size)
        if t > self.max_tokens:  # the buffers stay where a captured graph reads them
            raise ValueError(f"a step of {t} tokens, more than LoRA's routing buffers hold "
                             f"({self.max_tokens}, the runner's max_num_batched_tokens)")
        if per_request.size and int(per_request.max()) >= self.num_slots:
            raise ValueError(f"slot {int(per_request.max())} of {self.num_slots} LoRA slots")
        self.num_tokens = t
        self.active = bool((per_request != BASE_SLOT).any())
        order = np.argsort(slots, kind="stable")
        adapter_rows = order[slots[order] != BASE_SLOT].astype(np.int32)
        counts = np.bincount(slots[slots != BASE_SLOT], minlength=self.num_slots)
        pieces = [(self.sorted_rows, adapter_rows), (self.blocks, self._blocks(counts))]
        if self.device.type != "cuda":  # the torch paths' routing
            width = max(t, self._written)  # clear what the previous step wrote past this one
            host = np.full(width, BASE_SLOT, dtype=np.int32)
            host[:t] = slots
            self._written = t
            pieces.append((self.token_slots, host))
            self.groups = _slot_groups(adapter_rows, counts, self.device)
        self._copy(pieces)

    def grid_blocks(self, rows: int) -> int:
        """Blocks a step of `rows` tokens can have (no more than its tokens, nor than one
        part-filled block per slot beyond the full ones): a graph's grid of that many rows."""
        return min(self.max_blocks, rows, -(-rows // BLOCK_ROWS) + self.num_slots)

    def _blocks(self, counts: np.ndarray) -> np.ndarray:
        """The block table of a step whose slot s has counts[s] tokens (their runs one after
        another in `sorted_rows`), its entries past this step's blocks empty; the count kept
        on the host."""
        ends = np.cumsum(counts)
        per_slot = -(-counts // BLOCK_ROWS)
        n = int(per_slot.sum())
        slot = np.repeat(np.arange(self.num_slots), per_slot)
        within = np.arange(n) - np.repeat(np.cumsum(per_slot) - per_slot, per_slot)
        blocks = np.zeros((max(n, self._blocks_written), 3), dtype=np.int32)  # past n: empty
        blocks[:n, 0] = slot
        blocks[:n, 1] = ends[slot] - counts[slot] + BLOCK_ROWS * within
        blocks[:n, 2] = ends[slot]
        self.num_blocks = self._blocks_written = n
        return blocks

    def _copy(self, pieces: list[tuple[torch.Tensor, np.ndarray]]) -> None:
        """Each host array into the start of its device buffer (no wait for the device)."""
        if not self._staging:
            for dst, array in pieces:
                dst.view(-1)[:array.size].copy_(torch.from_numpy(array.reshape(-1)))
            return
        self._parity ^= 1
        staging, copied = self._staging[self._parity], self._copied[self._parity]
        copied.synchronize()  # this buffer's copy of two steps ago has run
        offset = 0
        for dst, array in pieces:
            src = staging[offset:offset + array.size]
            src.numpy()[:] = array.reshape(-1)
            dst.view(-1)[:array.size].copy_(src, non_blocking=True)
            offset += array.size
        copied.record()


def _slot_groups(adapter_rows: np.ndarray, counts: np.ndarray, device: torch.device
                 ) -> list[tuple[int, slice | torch.Tensor]]:
    """(slot, its tokens) for every slot with tokens this step, from the tokens sorted by
    slot (`adapter_rows`) and each slot's count."""
    groups = []
    start = 0
    for slot, n in enumerate(counts.tolist()):
        if not n:
            continue
        rows = adapter_rows[start:start + n]
        start += n
        if int(rows[-1]) - int(rows[0]) + 1 == n:  # contiguous (one request, or neighbours)
            groups.append((slot, slice(int(rows[0]), int(rows[0]) + n)))
        else:
            groups.append((slot, torch.from_numpy(rows.astype(np.int64)).to(device)))
    return groups
