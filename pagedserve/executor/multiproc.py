"""Ranks 1..N-1 in worker processes (spawned), rank 0 in the engine's process.

Commands go down one pipe per worker (a `StepMessage` per launch, a word per collect);
answers come up another only at start-up ("ready" or the rank's error). A monitor thread
watches the workers' process sentinels and answer pipes, so a worker that dies or fails is
known at once; a collective with a dead rank fails in the engine (gloo: the peer's socket
closes; a rank that hangs: the group's timeout, `PAGEDSERVE_DIST_TIMEOUT_S`), and the executor
turns either into a `WorkerError` that names the rank, after stopping every worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.distributed import destroy_distributed, free_port_init_method
from pagedserve.engine.model_runner import ModelRunnerOutput, PendingStep
from pagedserve.executor.base import Executor, StepMessage, WorkerError
from pagedserve.executor.worker import WorkerSpec, join_group, worker_main
from pagedserve.scheduler import Request, SchedulerOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _stop(processes: list[Any], commands: list[Connection], grace_s: float = 5.0) -> None:
    """Ask the workers to exit, then terminate, then kill: none outlives this."""
    for conn in commands:
        try:
            conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, dtype: torch.dtype,
                 quantization: str | None) -> None:
        super().__init__(config)
        self.world_size = config.tensor_parallel_size
        init_method = free_port_init_method()
        ctx = mp.get_context("spawn")
        self.processes: list[Any] = []
        self.commands: list[Connection] = []
        self.replies: list[Connection] = []
        for rank in range(1, self.world_size):
            spec = WorkerSpec(config, rank, self.world_size, init_method, dtype, quantization)
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            reply_recv, reply_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(spec, cmd_recv, reply_send),
                               name=f"pagedserve-tp{rank}", daemon=True)
            proc.start()
            cmd_recv.close()
            reply_send.close()
            self.processes.append(proc)
            self.commands.append(cmd_send)
            self.replies.append(reply_recv)
        self._stop = weakref.finalize(self, _stop, list(self.processes), list(self.commands))
        self.failure: str | None = None
        self._closing = False  # our own shutdown: workers exiting then is no failure
        self.ready: set[int] = set()
        self._changed = threading.Condition()
        self._finished: list[str] = []
        self._monitor = threading.Thread(target=self._watch, name="pagedserve-tp-monitor",
                                         daemon=True)
        self._monitor.start()
        self._while_watching(lambda: join_group(config, 0, self.world_size, init_method),
                             "joining the tensor-parallel group")

    # ---- liveness ---------------------------------------------------------------------------

    def _watch(self) -> None:
        """Until every worker has exited: record readiness, errors and deaths."""
        rank_of = {p.sentinel: r for r, p in enumerate(self.processes, start=1)}
        live_pipes = list(self.replies)
        sentinels = list(rank_of)
        while sentinels:
            for ready in wait(live_pipes + sentinels):
                if ready in rank_of:
                    sentinels.remove(ready)
                    rank = rank_of[ready]
                    proc = self.processes[rank - 1]
                    proc.join(0.1)
                    self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                               f"{proc.exitcode}")
                    continue
                try:
                    kind, rank, text = ready.recv()
                except (EOFError, OSError):
                    live_pipes.remove(ready)
                    continue
                if kind == "ready":
                    with self._changed:
                        self.ready.add(rank)
                        self._changed.notify_all()
                else:
                    self._fail(f"tensor-parallel rank {rank} failed: {text}")

    def _fail(self, message: str) -> None:
        """The first failure is the one reported (a rank's own error beats its exit code)."""
        with self._changed:
            if self.failure is None and not self._closing:
                self.failure = message
            self._changed.notify_all()

    def check_health(self) -> None:
        if self.failure is not None:
            self._raise()

    def _raise(self, cause: BaseException | None = None) -> None:
        """Stop every worker, then raise the failing rank's error (or, when no rank failed,
        `cause` itself: this process's own error)."""
        failure = self.failure
        self.shutdown()
        if failure is None and cause is not None:
            raise cause
        raise WorkerError(failure) from cause

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """A failure inside (a collective with a dead or hung rank) or recorded by the monitor
        becomes the rank's WorkerError; the monitor gets a moment to learn which rank."""
        self.check_health()
        try:
            yield
        except Exception as exc:
            with self._changed:
                self._changed.wait_for(lambda: self.failure is not None, timeout=2.0)
            self._raise(exc)

    def _while_watching(self, fn: Callable[[], T], what: str) -> T:
        """Run a start-up phase that blocks on the other ranks (the group's rendezvous, the
        first collectives) in a thread, so a rank that fails meanwhile is reported at once
        rather than after the group's timeout."""
        result: list[Any] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                result.append(fn())
            except BaseException as exc:
                error.append(exc)

        thread = threading.Thread(target=run, name=f"pagedserve-tp-{what}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            if self.failure is not None:
                self._raise()
        if error:
            with self._changed:
                self._changed.wait_for(lambda: self.failure is not None, timeout=2.0)
            self._raise(error[0])
        return result[0]

    # ---- the runner's interface -------------------------------------------------------------

    def start_runner(self, model: Any, vocab_size: int, max_model_len: int,
                     eos_token_id: int | None) -> None:
        with self._guard():
            super().start_runner(model, vocab_size, max_model_len, eos_token_id)

    def determine_cache_size(self) -> tuple[int, int]:
        return self._while_watching(super().determine_cache_size, "sizing the cache")

    def warmup(self) -> None:
        self._while_watching(super().warmup, "warm-up")

        def all_ready() -> bool:
            return len(self.ready) == self.world_size - 1 or self.failure is not None

        with self._changed:
            self._changed.wait_for(all_ready, timeout=envs.PAGEDSERVE_DIST_TIMEOUT_S)
        self.check_health()
        if len(self.ready) < self.world_size - 1:
            self.failure = "tensor-parallel ranks did not finish starting in time"
            self._raise()

    def finish_request(self, request_id: str) -> None:
        super().finish_request(request_id)
        self._finished.append(request_id)

    def add_request(self, request: Request) -> None:
        self.check_health()
        super().add_request(request)

    def _send(self, command: tuple[str, Any]) -> None:
        for conn in self.commands:
            conn.send(command)

    def launch(self, batch: SchedulerOutput) -> PendingStep:
        with self._guard():
            self._send(("launch", StepMessage.of(batch, self._finished)))
            self._finished = []
            return self.runner.launch(batch)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        with self._guard():
            self._send(("collect", None))
            return self.runner.collect(pending)

    def shutdown(self) -> None:
        if not self._stop.alive:
            return
        self._closing = True
        self._stop()
        destroy_distributed()
