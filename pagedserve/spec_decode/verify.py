"""The layout of a step that verifies drafts: which hidden states get logits, where each
request's rows start, its drafts as a padded grid. Built on the host from the scheduler's
draft counts and the step's cu_seqlens, once per verify step.

A request with K drafts runs 1+K query tokens (its last verified token, then the drafts); row
j of its logits (j = 0..K) predicts the token after its j-th draft, so the request's last 1+K
hidden states are the ones the head reads. A request without drafts gets one row, as in a
plain step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.device import arrays_to_device


@dataclass
class VerifyLayout:
    num_drafts: np.ndarray  # int64 [B]: K_b, drafts verified per request
    row_start: np.ndarray  # int64 [B]: the request's first logits row
    hidden_rows: np.ndarray  # int64 [N]: the step's token index of each logits row
    drafts: np.ndarray  # int64 [B, Kmax]: each request's drafts, 0 past K_b
    # The drafts' grid, their counts and row starts on the device (copied once per step:
    # every use reads these), and each row's request.
    drafts_dev: torch.Tensor
    num_drafts_dev: torch.Tensor
    row_start_dev: torch.Tensor
    req_of_row: torch.Tensor  # int64 [N]
    hidden_rows_dev: torch.Tensor  # int64 [N]: `hidden_rows` on the device
    # Per request: further positions, after this step's first, at which min_tokens still bans
    # end tokens (set by the runner only when a request has min_tokens left).
    min_tokens_left: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.hidden_rows)

    @property
    def width(self) -> int:
        """Most tokens one request can gain: Kmax + 1."""
        return self.drafts.shape[1] + 1


def build_layout(num_drafts: np.ndarray, draft_token_ids: list[list[int]],
                 query_start_loc: np.ndarray, device: torch.device) -> VerifyLayout:
    num_drafts = num_drafts.astype(np.int64)
    b = len(num_drafts)
    rows_per_req = num_drafts + 1
    row_start = np.zeros(b, dtype=np.int64)
    np.cumsum(rows_per_req[:-1], out=row_start[1:])
    n = int(rows_per_req.sum())
    # Row r of request i reads token qsl[i+1] - 1 - K_i + (r - row_start[i]).
    req = np.repeat(np.arange(b), rows_per_req)
    within = np.arange(n) - row_start[req]
    hidden_rows = query_start_loc[1:].astype(np.int64)[req] - 1 - num_drafts[req] + within
    kmax = int(num_drafts.max()) if b else 0
    drafts = np.zeros((b, kmax), dtype=np.int64)
    if kmax:
        mask = np.arange(kmax)[None, :] < num_drafts[:, None]
        drafts[mask] = np.fromiter((t for ids in draft_token_ids for t in ids), np.int64,
                                   int(num_drafts.sum()))
    # One copy for all five (a verify step's path: each copy costs the host a launch).
    on_device = arrays_to_device([drafts, num_drafts, row_start, req, hidden_rows], device)
    return VerifyLayout(num_drafts, row_start, hidden_rows, drafts, *on_device)
