"""The model runner's part for a pooling model: a step's final hidden states pooled, truncated
and normalised on the device in one pass over the batch (a reranker's: its head's logits at
each last token turned into a score), and on their way to the host, in place of the sampler.

A pooling request finishes in the step that computes its prompt: the step "samples" a
placeholder token (0) for it, which ends it at `max_tokens=1`, so the scheduler frees its
blocks and the core reports its embedding (`core_hooks.py`) with the step's other results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.config import EngineConfig
from pagedserve.engine.runner_outputs import PendingStep
from pagedserve.pooling.config import PoolerConfig, resolve_pooler
from pagedserve.pooling.methods import finish, logit_score, pool
from pagedserve.scheduler import SchedulerOutput


class PooledRows:
    """A step's embeddings, float32 [B, hidden] in batch order (a row truncated to a request's
    `dimensions` is zero past them), copied to the host behind the step's work.

    On CUDA they land in pinned memory and `wait` hands out a copy in ordinary memory: the
    outputs keep views of what it returns until the caller drops them, and views of the pinned
    block would keep it from the allocator's cache, so each step would pin new pages."""

    def __init__(self, rows: torch.Tensor) -> None:
        if rows.device.type == "cuda":
            self.host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self.host.copy_(rows, non_blocking=True)
            self.event: torch.cuda.Event | None = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = rows, None

    def wait(self) -> np.ndarray:
        if self.event is None:
            return self.host.numpy()
        self.event.synchronize()
        return self.host.numpy().copy()


class StepPooler:
    def __init__(self, config: PoolerConfig, compute_logits: Callable[..., torch.Tensor],
                 classify: Callable[..., torch.Tensor] | None = None) -> None:
        self.config = config
        self.compute_logits = compute_logits  # the model's head: a reranker's scores read it
        self.classify = classify  # a classifier's head over first tokens [B, H] -> logits

    @classmethod
    def for_engine(cls, config: EngineConfig, model: Any) -> StepPooler | None:
        """The engine's pooler; None when it generates."""
        pooler = resolve_pooler(config.model)
        if pooler is None:
            return None
        classify = getattr(model, "classify", None)
        if pooler.task == "classify" and classify is None:
            raise ValueError(f"{type(model).__name__} has no classification head")
        return cls(pooler, model.compute_logits, classify)

    def launch(self, batch: SchedulerOutput, rows: np.ndarray, generations: np.ndarray,
               hidden: torch.Tensor, common: CommonAttentionMetadata,
               device_timer: Any = None) -> PendingStep:
        """The launched step of a batch of pooling requests, each with its whole prompt:
        hidden [>= num_actual_tokens, H] under the step's metadata `common`; `device_timer`
        (the runner's, when it measures) ends the step's span after the pooler's work."""
        config = self.config
        if config.task == "classify":  # the classifier over each first token: the logits
            out = self.classify(hidden[common.query_start_loc[:-1].long()])
        elif config.task == "score":  # the head over each request's last token only
            last = hidden[common.query_start_loc[1:].long() - 1]
            out = logit_score(self.compute_logits(last), config.score_tokens, config.activation)
        else:
            pooled = pool(hidden[:common.num_actual_tokens], common.query_start_loc,
                          config.method)
            dims = [getattr(r.pooling, "dimensions", None) for r in batch.requests]
            out = finish(pooled, dims, config.normalize)
        pending = PendingStep(batch, rows, generations)
        pending.pooled = PooledRows(out)
        pending.sampled = np.zeros(batch.num_reqs, dtype=np.int64)
        if device_timer is not None:
            device_timer.stop()
        return pending


def host_rows(pooled: Any) -> np.ndarray | None:
    """A collected step's embeddings on the host (None for a generating step)."""
    return None if pooled is None else pooled.wait()
