"""What the model runner hands back: a launched step (`PendingStep`) and, once collected, its
samples and whatever else the step kept (`ModelRunnerOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedserve.engine.sampler import LogprobsTensors, SamplerOutput, SamplingMetadata
from pagedserve.scheduler import SchedulerOutput
from pagedserve.spec_decode.proposer import Drafts
from pagedserve.spec_decode.verify import VerifyLayout
from pagedserve.structured_output.manager import BitmaskFill


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: np.ndarray  # [B] in batch order
    # Sampled-token logprobs and top alternatives, [B, K+1], when a request asked for them.
    logprobs: LogprobsTensors | None = None
    # request id -> logprobs of the prompt tokens this step predicted (rows in prompt order).
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    # request id -> full next-token log-distribution [V] of a teacher-forced request.
    forced_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    # request id -> (first position p, float32 [rows, V] on the CPU): the full log-distributions
    # this step computed at prompt positions p, p+1, ... of a request scored by prefill.
    score_logprobs: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # Speculative decoding: the proposer's drafts for each request's next step.
    draft_token_ids: Drafts | None = None
    # A pooling model's step: float32 [B, hidden] embeddings in batch order (pooling/step.py).
    pooled: np.ndarray | None = None


@dataclass
class PendingStep:
    """A launched step whose samples may still be on their way to the host."""

    batch: SchedulerOutput
    rows: np.ndarray
    # Each row's owner at launch (InputBatch.generation): a row freed and handed to a new request
    # before this step's samples are recorded must not take them.
    generations: np.ndarray
    # Until its sampling is queued: (logits, sampling metadata). A guided step's sampling is
    # queued by the runner's next launch.
    sampling: tuple[torch.Tensor, SamplingMetadata | None] | None = None
    # Its grammars' bitmask being filled (None: no grammar row), which its sampling applies
    # and the next step may repeat (guided.py).
    fill: BitmaskFill | None = None
    # On the device; a greedy step's ids are its graph size's persistent buffer, rewritten by
    # the next decode step's head (engine/head_graphs.py): read them only in work queued before.
    out: SamplerOutput | None = None
    host_copy: tuple[np.ndarray, torch.cuda.Event | None] | None = None  # (ids, copied event)
    logprobs: LogprobsTensors | None = None  # on the host once host_copy's event has fired
    forced: dict[str, torch.Tensor] = field(default_factory=dict)
    forced_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    score_logprobs: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    sampled: np.ndarray | None = None  # set once the samples are on the host
    # A step that verifies drafts: its layout (its samples are then [B, Kmax+1], -1 padded).
    verify: VerifyLayout | None = None
    drafts: Drafts | None = None  # the proposer's, once the samples are recorded
    captured: Any = None  # what the proposer read of the step's forward (a head's)
    pooled: Any = None  # a pooling model's step: its embeddings (pooling/step.py's PooledRows)
    # A verify step over state layers: which slots hold each draft's state, for the sampler's
    # accepted counts to pick from (attention/state_verify.py).
    state_verify: Any = None
