"""A step's LoRA routing: which device slot each token uses (-1: the base model), in the
shapes each product wants, all worked out on the host from what the scheduler decided.

- `token_slots` (device, fixed address, [max_tokens]): one slot per token. The per-row
  (BGMV) kernels read it; it is the only LoRA input a captured decode graph reads, so rows
  past the step's tokens (a graph's padding) are kept at -1.
- segments (device, fixed addresses): runs of consecutive tokens with one adapter, in token
  order (`seg_bounds` [2n]: start and end of each; `seg_slots` [n]; base runs dropped). The
  segment (SGMV) kernels take one program row per segment block; their grid needs `num_segments` and
  `max_segment_len`, host ints known before launch, so no step ever syncs on the device.
- `groups` (the torch path): each adapter's tokens, as a slice when they are contiguous,
  else as an index tensor (tokens sorted by slot once on the host).
"""

from __future__ import annotations

import numpy as np
import torch

BASE_SLOT = -1


class LoRABatch:
    """The step's routing, rewritten in place by `set` before every step."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self._allocate(max_tokens)
        self.num_tokens = 0
        self.num_segments = 0
        self.max_segment_len = 0
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.active = False  # a token with an adapter: else the wrappers skip the products
        self.decode = True  # one token per request: the per-row (BGMV) products
        # A decode graph is being captured (or replayed): the products run whatever the step,
        # per row over every padded row, reading only `token_slots`.
        self.graph_mode = False
        # Triton's kernels off CUDA too (tests run them in the interpreter through the layers).
        self.use_kernels = self.device.type == "cuda"

    def _allocate(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.token_slots = torch.full((max_tokens,), BASE_SLOT, dtype=torch.int32,
                                      device=self.device)
        self.seg_bounds = torch.zeros(2 * max_tokens, dtype=torch.int32, device=self.device)
        self.seg_slots = torch.zeros(max_tokens, dtype=torch.int32, device=self.device)
        self._written = 0  # token_slots entries that may hold a slot (the rest are -1)
        # On CUDA the host arrays go through one of two pinned buffers, copied without waiting
        # for the device (a pageable copy would wait for the step in flight); a buffer is
        # reused two steps later, after the event recorded behind its copy.
        pin = self.device.type == "cuda"
        self._staging = [torch.empty(4 * max_tokens, dtype=torch.int32, pin_memory=True)
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
        self.num_tokens = t
        self.active = bool((per_request != BASE_SLOT).any())
        self.decode = not num_tokens.size or int(num_tokens.max()) <= 1
        width = max(t, self._written)  # clear what the previous step wrote past this one
        host = np.full(width, BASE_SLOT, dtype=np.int32)
        host[:t] = slots
        self._written = t
        self._copy([(self.token_slots, host), *self._segments(slots)])
        self.groups = _slot_groups(slots, self.device) if self.device.type != "cuda" else []

    def _segments(self, slots: np.ndarray) -> list[tuple[torch.Tensor, np.ndarray]]:
        """The step's adapter runs (their count and longest kept on the host), as (device
        buffer, host array) pairs to copy."""
        starts, lengths, seg = runs(slots)
        keep = seg != BASE_SLOT
        starts, lengths, seg = starts[keep], lengths[keep], seg[keep]
        self.num_segments = int(seg.size)
        self.max_segment_len = int(lengths.max()) if seg.size else 0
        bounds = np.empty(2 * seg.size, dtype=np.int32)  # [start_i, end_i] pairs
        bounds[0::2], bounds[1::2] = starts, starts + lengths
        return [(self.seg_bounds, bounds), (self.seg_slots, seg.astype(np.int32))]

    def _copy(self, pieces: list[tuple[torch.Tensor, np.ndarray]]) -> None:
        """Each host array into the start of its device buffer (no wait for the device)."""
        if not self._staging:
            for dst, array in pieces:
                dst[:array.size].copy_(torch.from_numpy(array))
            return
        self._parity ^= 1
        staging, copied = self._staging[self._parity], self._copied[self._parity]
        copied.synchronize()  # this buffer's copy of two steps ago has run
        offset = 0
        for dst, array in pieces:
            src = staging[offset:offset + array.size]
            src.numpy()[:] = array
            dst[:array.size].copy_(src, non_blocking=True)
            offset += array.size
        copied.record()


def runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of equal consecutive values: (starts, lengths, values)."""
    if not values.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, values[:0]
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    lengths = np.diff(np.r_[starts, values.size])
    return starts, lengths, values[starts]


def _slot_groups(slots: np.ndarray, device: torch.device
                 ) -> list[tuple[int, slice | torch.Tensor]]:
    """(slot, its tokens) for every adapter slot of the step, the tokens sorted once."""
    order = np.argsort(slots, kind="stable")
    starts, lengths, values = runs(slots[order])
    groups = []
    for start, n, slot in zip(starts.tolist(), lengths.tolist(), values.tolist(), strict=True):
        if slot == BASE_SLOT:
            continue
        rows = order[start:start + n]
        if int(rows[-1]) - int(rows[0]) + 1 == n:  # contiguous (one request, or neighbours)
            groups.append((slot, slice(int(rows[0]), int(rows[0]) + n)))
        else:
            groups.append((slot, torch.from_numpy(rows).to(device)))
    return groups
