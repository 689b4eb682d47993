"""vLLM-shaped results of pooling: `LLM.embed()` returns PoolingRequestOutputs whose
`outputs.embedding` is the vector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class EmbeddingOutput:
    data: np.ndarray  # float32 [dimensions]

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.data.shape[0]})"


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: Any = None  # engine.outputs.RequestMetrics


def pooling_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   embedding: np.ndarray, metrics: Any) -> PoolingRequestOutput:
    return PoolingRequestOutput(request_id, prompt, prompt_token_ids,
                                EmbeddingOutput(np.asarray(embedding, dtype=np.float32)),
                                metrics=metrics)
