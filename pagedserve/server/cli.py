"""`pagedserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from pagedserve import envs
from pagedserve.arg_utils import (
    HelpFormatter,
    add_engine_args,
    add_server_args,
    engine_config,
    server_config,
)

logger = logging.getLogger("pagedserve.server")


def add_serve_parser(subparsers: Any, parents: list[Any] | None = None
                     ) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", parents=parents or [], formatter_class=HelpFormatter,
                              help="OpenAI-compatible HTTP server")
    add_server_args(p)
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.api import build_app

    try:
        server = server_config(args)
        engine = LLMEngine(engine_config(args), log_stats=True)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagedserve serve: error: {exc}") from None
    if server.api_key is None:
        server.api_key = envs.PAGEDSERVE_API_KEY
    app = build_app(AsyncLLM(engine, server.max_waiting_requests), server)
    logger.info("serving %s on http://%s:%d (API key %s)",
                server.served_model_name or engine.model_name, server.host, server.port,
                "required" if server.api_key else "off")
    uvicorn.run(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level)
    return 0
