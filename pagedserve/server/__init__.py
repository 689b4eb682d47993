"""The OpenAI-compatible HTTP server: `build_app(AsyncLLM(engine))`, or `pagedserve serve`."""
