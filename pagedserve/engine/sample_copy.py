"""A step's sampled ids (and logprobs) on their way to the host, without waiting for them."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.engine.sampler import LogprobsTensors, SamplerOutput


class SamplesToHost:
    """On CUDA the ids go into one of two pinned buffers, with an event after the copy. A
    step's buffer is read when it is collected, before the step after next is sampled, so two
    suffice. Logprobs go into pinned blocks of torch's caching host allocator."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        """`max_num_reqs`: the most ids one step sends (requests x tokens per request)."""
        pin = device.type == "cuda"
        self._parity = 0
        self._buffers = [torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=pin)
                         for _ in range(2 if pin else 0)]
        self._copied = [torch.cuda.Event() for _ in range(2 if pin else 0)]

    def start(self, out: SamplerOutput) -> tuple[tuple[np.ndarray, torch.cuda.Event | None],
                                                 LogprobsTensors | None]:
        """((host ids, the event after their copy or None), logprobs) of one step."""
        sampled = out.sampled_token_ids
        lp = None
        if out.logprobs is not None:
            lp = LogprobsTensors(out.logprobs, out.logprob_token_ids, out.sampled_token_ranks)
        if sampled.device.type != "cuda":
            return (sampled.numpy(), None), lp
        if lp is not None:
            lp = LogprobsTensors(*(torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                   .copy_(t, non_blocking=True) for t in lp))
        self._parity ^= 1
        # A verify step's ids are [B, Kmax+1]: the buffer holds max_num_reqs rows of that.
        host = self._buffers[self._parity][:sampled.numel()].view(sampled.shape)
        host.copy_(sampled, non_blocking=True)
        event = self._copied[self._parity]
        event.record()
        return (host.numpy(), event), lp
