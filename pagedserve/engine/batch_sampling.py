"""What sampling keeps per request across steps (seeded generators), and a step's
SamplingMetadata, built from its requests and reused while a step has the same requests in the
same order and none of their sampling reads their tokens (most decode steps)."""

from __future__ import annotations

import torch

from pagedserve.engine.sampler import SamplingMetadata, distinct_params
from pagedserve.scheduler import Request


class BatchSampling:
    def __init__(self, eos_token_id: int | None, vocab_size: int, device: torch.device) -> None:
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' own
        self._last: SamplingMetadata | None = None  # the last step's, when reusable

    def add_request(self, request: Request) -> None:
        seed = request.sampling_params.seed
        if seed is not None:
            self.generators[request.request_id] = torch.Generator(self.device).manual_seed(seed)

    def finish_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def metadata(self, requests: list[Request], same_as_last_step: bool) -> SamplingMetadata:
        """`same_as_last_step`: the step has the last step's requests in the same order
        (InputBatch.update says)."""
        if same_as_last_step and self._last is not None:
            # None of their sampling depends on their tokens so far: the last step's tensors
            # hold this step's too.
            return self._last
        generators = {i: self.generators[r.request_id] for i, r in enumerate(requests)
                      if r.request_id in self.generators} if self.generators else {}
        params = [r.sampling_params for r in requests]
        distinct = distinct_params(params)
        needs_tokens = any(p.needs_host_history for p in distinct[0])
        prompts = [r.prompt_token_ids for r in requests] if needs_tokens else [[]] * len(params)
        outputs = [r.output_token_ids for r in requests] if needs_tokens else [[]] * len(params)
        meta = SamplingMetadata.build(params, prompts, outputs, generators, self.eos_token_id,
                                      self.vocab_size, self.device, distinct)
        # min_tokens bans end tokens by output length: such a batch is built every step.
        reusable = not needs_tokens and not any(p.min_tokens for p in distinct[0])
        self._last = meta if reusable else None
        return meta
