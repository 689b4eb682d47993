"""`pagedserve serve`: the OpenAI-compatible HTTP server, and how it stops.

The first SIGTERM or SIGINT drains: new requests get 503 (and /health too, so a balancer stops
sending), running ones get `--shutdown-timeout` seconds, then whatever still runs ends with an
error event, and the process exits. A second signal exits at once. An engine that dies stops
the server with exit status 1, so a supervisor restarts it instead of a server answering 503
forever.
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

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
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.core_client import EngineStartupError
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.api import build_app

    try:
        server = server_config(args)
        check_port_free(server.host, server.port)  # before a load that may take minutes
        engine = LLMEngine(engine_config(args), log_stats=not args.disable_log_stats)
    except (ValueError, OSError, EngineStartupError) as exc:
        raise SystemExit(f"pagedserve serve: error: {exc}") from None
    if server.api_key is None:
        server.api_key = envs.PAGEDSERVE_API_KEY
    llm = AsyncLLM(engine, server.max_waiting_requests)
    try:
        app = build_app(llm, server)
    except ValueError as exc:  # settings only checkable against the loaded model's name
        engine.shutdown()
        raise SystemExit(f"pagedserve serve: error: {exc}") from None
    uvicorn_server = DrainingServer(
        uvicorn.Config(app, host=server.host, port=server.port,
                       log_level=server.uvicorn_log_level, timeout_graceful_shutdown=5),
        app.state.server, llm, server.shutdown_timeout)
    llm.on_dead = uvicorn_server.stop_now
    logger.info("serving %s on http://%s:%d (API key %s)",
                server.served_model_name or engine.model_name, server.host, server.port,
                "required" if server.api_key else "off")
    uvicorn_server.run()
    if llm.error is not None:
        logger.error("the engine died (%r): exiting with status 1", llm.error)
        return 1
    return 0


def check_port_free(host: str, port: int) -> None:
    """OSError naming the address when another process listens there (bound and released as
    uvicorn binds: its address family, SO_REUSEADDR on, so a port in TIME_WAIT still
    passes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose signals drain first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: Any, llm: Any, timeout: float) -> None:
        super().__init__(config)
        self.state = state  # the app's ServerState: its draining flag and in-flight count
        self.llm = llm
        self.timeout = timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self.should_exit:  # the second signal
            logger.warning("second signal: exiting now")
            self.force_exit = self.should_exit = True
            return
        self.state.draining = True
        logger.info("draining: %d request(s) running, %.0f s to finish", self.state.in_flight,
                    self.timeout)
        threading.Thread(target=self._drain, name="pagedserve-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.state.in_flight and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if self.state.in_flight:
            logger.warning("drain timeout: ending %d request(s) with an error",
                           self.state.in_flight)
            self.llm.shutdown()  # every open stream ends with an error event
        self.should_exit = True

    def stop_now(self) -> None:
        self.should_exit = True
