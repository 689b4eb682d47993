"""How the front reaches the engine core: in its own process (InprocClient, the debugging mode
and what most CPU tests use) or in a core process over ZeroMQ (MPClient). Both have the same
methods; LLMEngine picks one by `EngineConfig.use_engine_core_process` (engine/dp_client.py
puts several core processes behind one front)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

import msgspec

from pagedserve.config import EngineConfig
from pagedserve.engine.core import EngineCore
from pagedserve.engine.core_messages import CoreInfo, CoreRequest, CoreStats, StepOutput
from pagedserve.process_start import handed_environment, start_context
from pagedserve.scheduler import RequestStatus

logger = logging.getLogger(__name__)

# How long the front waits for the core to start (loading a large model, capturing graphs)
# and to stop before it is terminated.
STARTUP_TIMEOUT_S = 1800.0
SHUTDOWN_TIMEOUT_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down, crashed, or its core process died); no request can make
    progress."""


class EngineStartupError(RuntimeError):
    """The core process failed to start (out of memory, a model it cannot build): its own
    error, as one line."""


class InprocClient:
    """The core in the front's process: a step runs when the front asks for an output."""

    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        self.core = EngineCore(config, log_stats=log_stats)
        self.info: CoreInfo = self.core.info()
        # Nothing arrives while the front is idle; with other ranks, an idle front still
        # checks on them (check_alive).
        self.idle_poll_s: float | None = 0.5 if self.core.runner.world_size > 1 else None

    def add_requests(self, requests: list[CoreRequest]) -> None:
        self.core.add_requests(requests)

    def abort_requests(self, seq_ids: list[str], stopped: bool = False) -> None:
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        self.core.abort_requests(seq_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_output(self, timeout: float | None = None) -> StepOutput | None:
        if not self.core.has_unfinished_requests():
            return None
        return self.core.step()

    def call_utility(self, name: str) -> Any:
        return self.core.call_utility(name)

    def stats(self) -> CoreStats:
        return self.core.stats()

    def check_alive(self) -> None:
        self.core.check_health()

    def on_death(self, callback: Callable[[], None]) -> None:
        pass

    def shutdown(self) -> None:
        self.core.shutdown()


class MPClient:
    """The core in a daemon process of its own (spawned by default); adds and aborts are sent
    in one message per flush (before each wait for an output), outputs arrive one message per
    step."""

    idle_poll_s: float | None = 0.2  # an idle front still reads the core's late stats

    def __init__(self, config: EngineConfig, log_stats: bool = False,
                 wait: bool = True) -> None:
        """Start the core process and wait until it is ready; with `wait=False` return once
        it is started (call `wait_ready()` before anything else: data parallelism starts its
        cores side by side)."""
        import zmq

        from pagedserve.engine.core_process import (
            SOCKET_HWM,
            StepMessage,
            decoder,
            encoder,
            run_engine_core,
        )

        self._dir = tempfile.mkdtemp(prefix="pagedserve-core-")
        input_addr = f"ipc://{self._dir}/input"
        output_addr = f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        # Few steps buffered on either side: a front that falls behind soon holds the core.
        self._output.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        self._output.bind(output_addr)
        self._encoder = encoder()
        self._decoder = decoder(StepMessage)
        mp = start_context()
        parent_conn, child_conn = mp.Pipe(duplex=False)
        self.proc = mp.Process(
            target=run_engine_core, name="pagedserve-engine-core", daemon=True,
            args=(config, input_addr, output_addr, child_conn,
                  logging.getLogger("pagedserve").getEffectiveLevel(), log_stats, os.getpid(),
                  handed_environment(mp)))
        self._handle = _CoreHandle(self.proc, self._ctx, self._input, self._encoder, self._dir)
        self.dead: str | None = None  # why the core is gone, once it is
        self._callbacks: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, self._handle.close)
        with _main_module_hidden():
            self.proc.start()
        child_conn.close()
        self._parent_conn = parent_conn
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for the started core's CoreInfo (or its start-up error, raised here)."""
        try:
            self.info: CoreInfo = self._wait_ready(self._parent_conn)
        except BaseException:
            self._finalizer()
            raise
        self._adds: list[list[CoreRequest]] = []
        self._aborts: list[str] = []
        self._stopped: list[str] = []
        self._utility: list[tuple[int, str]] = []
        self._call_ids = itertools.count()
        self._results: dict[int, tuple[bool, Any]] = {}
        self._outputs: collections.deque[StepOutput] = collections.deque()
        self._stats: CoreStats | None = None
        # The watcher holds the client weakly: a dropped LLM still shuts its core down.
        self._watcher = threading.Thread(target=_watch, args=(self._handle, weakref.ref(self)),
                                         name="pagedserve-core-watch", daemon=True)
        self._watcher.start()
        self._stats = self.call_utility("stats")

    def _wait_ready(self, conn: Any) -> CoreInfo:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if conn.poll(0.1):
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = None
                if msg is not None and msg[0] == "ready":
                    return msg[1]
                if msg is not None:
                    _, kind, line = msg
                    # A bad setting stays a ValueError (the CLI prints it as one line).
                    error = (ValueError if kind in ("ValueError", "ModelNotFoundError")
                             else OSError if kind in _OS_ERRORS else EngineStartupError)
                    raise error(f"the engine core failed to start: {line}")
            if not self.proc.is_alive():
                self.proc.join(1)
                raise EngineStartupError(f"the engine core process exited during start-up "
                                         f"(exit code {self.proc.exitcode}); see its log above")
        raise EngineStartupError(f"the engine core did not start within "
                                 f"{STARTUP_TIMEOUT_S:.0f} s")

    # ---- requests -----------------------------------------------------------------------

    def add_requests(self, requests: list[CoreRequest]) -> None:
        self.check_alive()
        self._adds.append(requests)

    def abort_requests(self, seq_ids: list[str], stopped: bool = False) -> None:
        """Sent at once: the core frees the blocks before its next step."""
        (self._stopped if stopped else self._aborts).extend(seq_ids)
        self._flush()

    def _flush(self) -> None:
        from pagedserve.engine.core_process import CoreInput

        if not (self._adds or self._aborts or self._stopped or self._utility):
            return
        if self.dead is not None:
            self._adds, self._aborts, self._stopped, self._utility = [], [], [], []
            return
        msg = CoreInput(self._adds, self._aborts, self._stopped, self._utility)
        self._adds, self._aborts, self._stopped, self._utility = [], [], [], []
        self._input.send(self._encoder.encode(msg), copy=False)

    # ---- outputs ------------------------------------------------------------------------

    def get_output(self, timeout: float | None = 0.05) -> StepOutput | None:
        """The next step's outputs, or None after `timeout` seconds without one."""
        self._flush()
        if self._outputs:
            return self._outputs.popleft()
        self.check_alive()
        return self._receive(timeout)

    @property
    def output_socket(self) -> Any:
        """Where the core's step messages arrive (a front polling several cores waits on all)."""
        return self._output

    def send_queued(self) -> None:
        """Send the adds, aborts and utility calls queued since the last send."""
        self._flush()

    def next_output(self) -> StepOutput | None:
        """An output already here (kept while waiting for a utility call, or waiting in the
        socket), or None at once."""
        if self._outputs:
            return self._outputs.popleft()
        return self._receive(0)

    def _receive(self, timeout: float | None) -> StepOutput | None:
        if not self._output.poll(None if timeout is None else int(timeout * 1000)):
            self.check_alive()
            return None
        msg = self._decoder.decode(self._output.recv(copy=False).buffer)
        if msg.error is not None:
            # The core's own line says more than the watcher's exit code: it wins.
            self.dead = None
            self._die(f"the engine core failed: {msg.error}")
            self.check_alive()
        out = msg.output
        if msg.stats is not None:
            self._stats = msg.stats
        for call_id, ok, result in out.utility:
            self._results[call_id] = (ok, result)
        return out

    def call_utility(self, name: str, timeout: float = 60.0) -> Any:
        """Call a core utility by name (stats, reset_prefix_cache, ping) and wait for its
        result; step outputs that arrive meanwhile are kept for get_output()."""
        self.check_alive()
        call_id = next(self._call_ids)
        self._utility.append((call_id, name))
        self._flush()
        deadline = time.monotonic() + timeout
        while call_id not in self._results:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine core did not answer {name!r} in {timeout} s")
            out = self._receive(0.1)
            if out is not None and out.seq_ids:
                self._outputs.append(out)
        ok, result = self._results.pop(call_id)
        if not ok:
            raise RuntimeError(f"engine core utility {name!r}: {result}")
        if name == "stats":  # structs travel as arrays: typed again here
            result = msgspec.convert(result, CoreStats)
        return result

    def has_unfinished_requests(self) -> bool:
        s = self._stats
        return bool(self._outputs) or (s is not None and (s.num_running + s.num_waiting) > 0)

    def stats(self) -> CoreStats:
        return self._stats

    # ---- lifetime -----------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead is None:
            return
        # A failed step's error may still be in the socket behind the process's exit.
        try:
            while self._output.poll(0):
                self._receive(0)
        except EngineDeadError:
            pass
        except Exception:  # the socket is closed: the reason already set stands
            pass
        raise EngineDeadError(self.dead)

    def on_death(self, callback: Callable[[], None]) -> None:
        """`callback()` from another thread once the core process is gone (not after shutdown)."""
        self._callbacks.append(callback)

    def _die(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            logger.error("%s", why)
            for callback in self._callbacks:
                callback()

    def shutdown(self) -> None:
        """Ask the core to stop, then join it (terminate, kill if it does not)."""
        self._finalizer()


_OS_ERRORS = {"OSError", "FileNotFoundError", "PermissionError", "IsADirectoryError",
              "NotADirectoryError"}


class _CoreHandle:
    """What stopping the core needs, apart from the client: the finalizer (run by shutdown(),
    at garbage collection and at exit) and the death watcher hold this, not the client."""

    def __init__(self, proc: Any, ctx: Any, sock: Any, enc: Any, directory: str) -> None:
        self.proc, self.ctx, self.sock, self.enc, self.directory = proc, ctx, sock, enc, directory
        self.closing = False

    def close(self) -> None:
        from pagedserve.engine.core_process import CoreInput

        self.closing = True
        proc = self.proc
        if proc.pid is not None and proc.is_alive():
            try:
                self.sock.send(self.enc.encode(CoreInput(shutdown=True)), copy=False,
                               flags=_zmq_noblock())
            except Exception:  # the socket is gone or full: terminate below does it
                pass
            proc.join(SHUTDOWN_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.directory, ignore_errors=True)


def _zmq_noblock() -> int:
    import zmq

    return zmq.NOBLOCK


def _watch(handle: _CoreHandle, client_ref: weakref.ref) -> None:
    wait([handle.proc.sentinel])
    client = client_ref()
    if client is not None and not handle.closing:
        client._die(f"the engine core process died (exit code {handle.proc.exitcode})")


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawn runs the parent's main script again in the child unless it is guarded by
    `if __name__ == "__main__"`; the core's entry point lives in this package and needs
    nothing of it, so the child is not told where the script is."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__} \
        if main is not None else {}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)
