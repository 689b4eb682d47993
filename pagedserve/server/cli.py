"""`pagedserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from pagedserve.cli import add_engine_args, engine_kwargs

logger = logging.getLogger("pagedserve.server")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the API routes (default: "
                        "$PAGEDSERVE_API_KEY; /health, /version and /metrics stay open)")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 while this many requests wait to be scheduled "
                        "(default 4096)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   help="uvicorn's own log level (default warning)")
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run_serve)
    return p


def build_engine_config(args: argparse.Namespace):
    from pagedserve.config import EngineConfig

    kwargs = engine_kwargs(args)
    if args.max_waiting_requests is not None:
        kwargs["max_waiting_requests"] = args.max_waiting_requests
    config_path = kwargs.pop("config", None)
    if config_path is not None:
        return EngineConfig.from_yaml(config_path, **kwargs)
    return EngineConfig.from_kwargs(**kwargs)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.api import build_app

    try:
        config = build_engine_config(args)
        engine = LLMEngine(config, log_stats=True)
    except ValueError as exc:
        raise SystemExit(f"pagedserve serve: error: {exc}") from None
    api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY") or None
    app = build_app(AsyncLLM(engine), api_key=api_key)
    logger.info("serving %s on http://%s:%d (API key %s)", engine.model_name, args.host,
                args.port, "required" if api_key else "off")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
