"""Packed prefill tokens <-> a zero-padded [B, L, ...] grid, for the torch linear-attention ops."""

from __future__ import annotations

import torch


def grid_index(query_start_loc: torch.Tensor, num_tokens: int, padded_len: int) -> torch.Tensor:
    """Flat index into a [B, padded_len] grid of each packed token (request b's i-th token goes
    to b * padded_len + i)."""
    qsl = query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(len(lens), device=qsl.device), lens,
                                  output_size=num_tokens)
    return req * padded_len + torch.arange(num_tokens, device=qsl.device) - qsl[req]


def to_grid(packed: torch.Tensor, index: torch.Tensor, num_reqs: int,
            padded_len: int) -> torch.Tensor:
    """[T, ...] -> [B, padded_len, ...], zeros where a request has no token."""
    grid = packed.new_zeros(num_reqs * padded_len, *packed.shape[1:])
    grid[index] = packed
    return grid.view(num_reqs, padded_len, *packed.shape[1:])


def from_grid(grid: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B, L, ...] -> the packed [T, ...] tokens."""
    return grid.reshape(-1, *grid.shape[2:])[index]


def initial_state(state: torch.Tensor, state_indices: torch.Tensor,
                  has_initial_state: torch.Tensor) -> torch.Tensor:
    """Each request's saved state as float32, or zeros for one that starts now (its slot may
    hold a previous owner's state, even NaNs: `where`, not a multiply, drops it)."""
    saved = state[state_indices].float()
    mask = has_initial_state.view(-1, *([1] * (saved.dim() - 1)))
    return torch.where(mask, saved, torch.zeros_like(saved))


def max_len(query_start_loc: torch.Tensor) -> int:
    """The longest request (a host sync: callers that know it pass it instead)."""
    return int((query_start_loc[1:] - query_start_loc[:-1]).max())
