"""M-RoPE positions (Qwen2-VL family): three rows (temporal, height, width) per token.

A text token's position is one more than the token before it, on all three rows. An image
of (t, h, w) merged tokens starting after position s - 1 places its token (i, j, k) at
(s + i, s + j, s + k), and the text after it continues from s + max(h, w) (transformers'
`get_rope_index`, for images). So a prompt with images ends below its length: tokens after
the prompt, which are text, sit at `index + mrope_delta` on all three rows, with
mrope_delta = (last prompt position + 1) - prompt length (<= 0).

`prompt_positions` computes a prompt's [3, P] at processing time, vectorised over its tokens;
`MRopeStepPositions` is the runner's: each step's [3, T] from the requests' prompt positions
and deltas, in a persistent buffer a decode CUDA graph reads (its replays see each step's);
an EAGLE head over an M-RoPE target keeps one of its own (spec_decode/eagle.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def prompt_positions(num_tokens: int, offsets: np.ndarray, grids: np.ndarray
                     ) -> tuple[np.ndarray, int]:
    """(int64 [3, num_tokens] positions, mrope_delta) of a prompt whose images' tokens start
    at `offsets` [n] (ascending), image i spanning grids[i] = (t, h, w) merged tokens."""
    if num_tokens == 0:
        return np.zeros((3, 0), dtype=np.int64), 0
    offsets = np.asarray(offsets, dtype=np.int64)
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    t, h, w = grids.T
    sizes = t * h * w
    # The image tokens' indices: each span's offset + 0..size-1, all spans at once.
    starts_in_concat = np.cumsum(sizes) - sizes
    image_index = (np.repeat(offsets - starts_in_concat, sizes)
                   + np.arange(int(sizes.sum()), dtype=np.int64))
    advance = np.ones(num_tokens, dtype=np.int64)  # what each token adds to the next's
    advance[image_index] = 0
    # An image adds max(h, w) to the tokens after it (counted at its end).
    after = np.zeros(num_tokens + 1, dtype=np.int64)
    np.add.at(after, offsets + sizes, np.maximum(h, w))
    before = np.cumsum(np.concatenate([[0], advance[:-1]])) + np.cumsum(after)[:num_tokens]
    positions = np.tile(before, (3, 1))
    # Image token (i, j, k) of its span: start + (i, j, k) on the three rows.
    local = image_index - np.repeat(offsets, sizes)
    per_frame = np.repeat(h * w, sizes)
    width = np.repeat(w, sizes)
    start = np.repeat(before[offsets], sizes)
    positions[0, image_index] = start + local // per_frame
    positions[1, image_index] = start + (local % per_frame) // width
    positions[2, image_index] = start + local % width
    return positions, int(positions.max()) + 1 - num_tokens


class MRopeStepPositions:
    """The runner's M-RoPE positions: a step's [3, T] built on the host (pinned on CUDA) and
    copied into a persistent device buffer (`device[:, :T]`), which the model reads and a
    decode CUDA graph captured reading. A request's prompt positions and delta are its own
    (`Request.mrope_positions`, `mrope_delta`; None and 0 for a text prompt)."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(3, max_num_tokens, dtype=torch.int64, pin_memory=pin)
        self.device = self.host if not pin else torch.zeros_like(self.host, device=device)
        self._last_requests: list[Any] | None = None
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # deltas, prompt lengths

    def build(self, requests: list[Any], num_computed: np.ndarray, num_scheduled: np.ndarray,
              query_start_loc: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """The step's [3, T] positions (a view of the device buffer): past its prompt a token
        is at its index + the request's delta on every row; in its prompt, the prompt's."""
        t, b = len(positions), len(requests)
        deltas, prompt_lens = self._per_request(requests)
        out = self.host.numpy()[:, :t]
        out[:] = positions + np.repeat(deltas, num_scheduled[:b])
        # Requests whose step reaches into their prompt (prefill chunks only): a slice each.
        for i in np.flatnonzero(num_computed[:b] < prompt_lens):
            c = int(num_computed[i])
            n = min(int(num_scheduled[i]), int(prompt_lens[i]) - c)
            q = int(query_start_loc[i])
            out[:, q:q + n] = requests[i].mrope_positions[:, c:c + n]
        return self._upload(t)

    def build_past_prompts(self, positions: np.ndarray, deltas: np.ndarray) -> torch.Tensor:
        """[3, T] of tokens all past their prompts (an EAGLE head's one-token draft steps):
        index + their request's delta on every row."""
        t = len(positions)
        self.host.numpy()[:, :t] = positions + deltas
        return self._upload(t)

    def _upload(self, t: int) -> torch.Tensor:
        if self.device is not self.host:
            for row in range(3):  # contiguous rows: async copies from pinned memory
                self.device[row, :t].copy_(self.host[row, :t], non_blocking=True)
        return self.device[:, :t]

    def _per_request(self, requests: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Each request's delta and prompt length (0 for a text prompt), rebuilt only when
        the step's requests differ from the last step's (most decode steps do not)."""
        if self._last is None or requests != self._last_requests:
            deltas = np.fromiter((r.mrope_delta for r in requests), np.int64, len(requests))
            lens = np.fromiter((0 if r.mrope_positions is None else r.mrope_positions.shape[1]
                                for r in requests), np.int64, len(requests))
            self._last_requests, self._last = list(requests), (deltas, lens)
        return self._last
