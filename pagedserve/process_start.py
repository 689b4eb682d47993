"""How pagedserve starts its own processes (an engine core process, tensor-parallel workers):
`spawn`, a fresh interpreter each (the default), or `forkserver`, forked from one helper
process that imported their modules once (PAGEDSERVE_PROCESS_START_METHOD). A process that
starts many engines, the test suite, pays for torch's import once rather than once a process.

A forked process inherits the helper's environment, taken when the helper started, not its
engine's: the engine hands its own over (`handed_environment`), and the process takes it on
first thing (`take_environment`)."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

from pagedserve import envs

METHODS = ("spawn", "forkserver")
# Both entry points' modules: the helper starts once, with whatever the first process needed.
PRELOAD = ["pagedserve.engine.core_process", "pagedserve.executor.worker"]


def start_context() -> BaseContext:
    method = envs.PAGEDSERVE_PROCESS_START_METHOD
    if method not in METHODS:
        raise ValueError(f"PAGEDSERVE_PROCESS_START_METHOD must be one of {METHODS}, "
                         f"got {method!r}")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def handed_environment(ctx: BaseContext) -> dict[str, str] | None:
    """The environment a process started in `ctx` must be handed; None: it inherits it."""
    return envs.snapshot() if ctx.get_start_method() == "forkserver" else None


def take_environment(environ: dict[str, str] | None) -> None:
    if environ is not None:
        envs.restore(environ)
