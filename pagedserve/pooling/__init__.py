"""Pooling models: embeddings instead of generated tokens (`--runner pooling`).

The model runner stays a coordinator: for a pooling model it hands each step's final hidden
states to `step.StepPooler` instead of the head and the sampler. Where a model's pooling comes
from (flags, sentence-transformers' files) is `config.py`; the pooling methods and Matryoshka
truncation `methods.py`; a request's settings and the checks of its prompt `params.py`; what
the engine core does with pooling sequences `core_hooks.py`; the front's part (tokenizing,
adding requests, outputs) `front.py` and `outputs.py`; rerankers (a causal cross-encoder's
pairs and scores) `scoring.py`; classifiers and encoder cross-encoders (logits,
probabilities, pair scores) `classify.py`; bare decoder checkpoints `base_models.py`.
"""

from pagedserve.pooling.config import PoolerConfig, resolve_pooler
from pagedserve.pooling.outputs import EmbeddingOutput, PoolingRequestOutput
from pagedserve.pooling.params import PoolingParams

__all__ = ["EmbeddingOutput", "PoolerConfig", "PoolingParams", "PoolingRequestOutput",
           "resolve_pooler"]
