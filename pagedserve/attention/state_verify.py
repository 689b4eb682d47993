"""State layers in a step that verifies drafts (speculative decoding over Mamba, gated delta
net, short conv, linear attention layers).

A request with K drafts runs 1+K tokens (its last verified token, then the drafts), and the
rejection sampler keeps only a prefix of them: after the step, its slot must hold the state
after its last kept input token, not after the last draft. So each state layer runs a verify
request's tokens position by position, keeping the state after each one in a slot of its own,
and after sampling the right one is copied into the request's slot (`commit_accepted`).

Slots: a running request owns slot s in [0, S); the allocation holds S * (1 + K) slots, and
slots S + s * K + j (j < K) are s's scratch. Position j of a request with K_b drafts reads the
state position j - 1 left (its own slot for j = 0) and writes scratch j, but the last position
(j = K_b) writes the request's own slot: when every draft is accepted nothing is copied.
A position runs as a batch of one-token decodes over the requests that have it (each layer
kind's decode op, Triton or torch: a verified token computes exactly what it would have as a
plain decode), so a step loops over positions (1 + Kmax), never over tokens or requests.
Copying a state into the next position's slot before the op keeps the ops as they are (they
read and write one slot). Requests without drafts (prefill chunks, plain decodes) run the
ordinary path together, as a smaller step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.device import array_to_device

# attention/state.py's StateMetadata (which holds a StateVerify: not imported, no cycle).
StateMetadata = Any


@dataclass
class VerifyPosition:
    """Position j of the verify requests that have it: their tokens' indices in the step, the
    slot each copies its state from, and the metadata (one-token decodes writing `dst`)."""

    tokens: torch.Tensor  # [n] int64
    src: torch.Tensor  # [n] int64
    metadata: StateMetadata  # state_indices = the slots written


@dataclass
class StateVerify:
    rest: StateMetadata | None  # the requests without drafts, as a step of their own
    rest_tokens: torch.Tensor | None  # [Tr] int64, their tokens' indices in the step
    positions: list[VerifyPosition]
    # Where each token's output sits in cat(rest outputs, position 0 outputs, ...).
    inverse: torch.Tensor  # [T] int64
    # For commit_accepted: the verify requests' batch rows, own slots, drafts, scratch base.
    reqs: torch.Tensor  # [V] int64
    own_slots: torch.Tensor  # [V] int64
    num_drafts: torch.Tensor  # [V] int64
    scratch_base: torch.Tensor  # [V] int64: the request's scratch slot for position 0


def scratch_slots(num_slots: int, num_speculative_tokens: int) -> int:
    """Slots to allocate for `num_slots` requests' states and their verify scratch."""
    return num_slots * (1 + num_speculative_tokens)


def build(qsl: np.ndarray, slots: np.ndarray, context_lens: np.ndarray, num_prefills: int,
          num_drafts: np.ndarray, num_slots: int, k: int, device: torch.device,
          make_metadata: Callable[..., StateMetadata]) -> StateVerify:
    """The verify plan of a step (host arrays in batch order: cu_seqlens `qsl`, state `slots`,
    `context_lens`, `num_drafts`). `make_metadata(qsl, num_prefills, slots, has_initial)`
    builds a plain step's StateMetadata from host arrays."""
    num_drafts = num_drafts.astype(np.int64)
    lens = np.diff(qsl).astype(np.int64)
    is_verify = num_drafts > 0
    rest = np.flatnonzero(~is_verify)
    reqs = np.flatnonzero(is_verify)
    parts: list[np.ndarray] = []
    rest_md = rest_tokens = None
    if len(rest):
        token_req = np.repeat(np.arange(len(lens)), lens)
        rest_tok = np.flatnonzero(~is_verify[token_req])
        rest_qsl = np.zeros(len(rest) + 1, dtype=np.int64)
        np.cumsum(lens[rest], out=rest_qsl[1:])
        rest_md = make_metadata(rest_qsl, int((rest < num_prefills).sum()), slots[rest],
                                context_lens[rest] > 0)
        rest_tokens = array_to_device(rest_tok, device)
        parts.append(rest_tok)
    kb = num_drafts[reqs]
    if (lens[reqs] != 1 + kb).any():
        raise ValueError("a request verifying K drafts must run exactly 1 + K tokens")
    own = slots[reqs].astype(np.int64)
    base = num_slots + own * k
    # A verify request's 1+K_b tokens are the last of its query (K_b drafts after its last
    # verified token), so position j is token qsl[i+1] - 1 - K_b + j.
    first = qsl[1:][reqs].astype(np.int64) - 1 - kb
    positions = []
    for j in range(int(kb.max()) + 1 if len(reqs) else 0):
        have = kb >= j
        dst = np.where(kb[have] == j, own[have], base[have] + j)
        src = own[have] if j == 0 else base[have] + j - 1
        tokens = first[have] + j
        md = make_metadata(np.arange(len(dst) + 1, dtype=np.int64), 0, dst,
                           np.ones(len(dst), dtype=bool))
        positions.append(VerifyPosition(array_to_device(tokens, device),
                                        array_to_device(src, device), md))
        parts.append(tokens)
    order = np.concatenate(parts)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))

    def dev(x: np.ndarray) -> torch.Tensor:
        return array_to_device(x.astype(np.int64, copy=False), device)

    return StateVerify(rest_md, rest_tokens, positions, dev(inverse), dev(reqs), dev(own),
                       dev(kb), dev(base))


def run_state_op(op: Callable[..., torch.Tensor], tokens: Sequence[torch.Tensor],
                 touched: Sequence[torch.Tensor], md: StateMetadata) -> torch.Tensor:
    """op(metadata, *tokens) -> [T, ...] over the step's tokens; in a verify step, over the
    requests without drafts, then position by position (the `touched` state tensors copied
    into each position's slots first)."""
    verify = md.verify
    if verify is None:
        return op(md, *tokens)
    outs = []
    if verify.rest is not None:
        outs.append(op(verify.rest, *(x[verify.rest_tokens] for x in tokens)))
    for pos in verify.positions:
        dst = pos.metadata.state_indices
        for state in touched:
            state[dst] = state[pos.src]
        outs.append(op(pos.metadata, *(x[pos.tokens] for x in tokens)))
    return torch.cat(outs)[verify.inverse]


def commit_accepted(state_caches: list[dict[str, torch.Tensor]], verify: StateVerify,
                    sampled: torch.Tensor) -> None:
    """After rejection sampling (`sampled` [B, 1+Kmax], -1 past each request's kept tokens):
    copy each verify request's state after its last kept input into its own slot. With a
    accepted drafts, that input is at position a: scratch a, or the own slot when a = K_b.
    Device ops only: the host does not wait for the samples."""
    accepted = (sampled[verify.reqs] >= 0).sum(dim=1) - 1
    src = torch.where(accepted >= verify.num_drafts, verify.own_slots,
                      verify.scratch_base + accepted)
    for layer in state_caches:
        for state in layer.values():
            state[verify.own_slots] = state[src]
