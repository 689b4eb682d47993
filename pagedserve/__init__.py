"""pagedserve: a paged-attention LLM serving engine."""

__version__ = "0.1.0"

__all__ = ["LLM", "GuidedDecodingParams", "LLMEngine", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `pagedserve backends` and the config tools do not import the whole engine.
    if name in ("LLM", "LLMEngine", "SamplingParams"):
        import pagedserve.engine as engine

        return getattr(engine, name)
    if name == "GuidedDecodingParams":
        from pagedserve.sampling_params import GuidedDecodingParams

        return GuidedDecodingParams
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
