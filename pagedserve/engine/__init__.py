"""The engine: LLM (offline), LLMEngine (add_request/step/abort), sampling and outputs."""

from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "Logprob", "RequestOutput", "SamplingParams"]
