"""What an executor with ranks outside the engine's process shares, whatever carries its
commands (pipes to worker processes, Ray actor calls): rank 0's runner does the engine's
calls and each step is also sent to the other ranks; a rank's failure, once known, stops every
rank and becomes a `WorkerError` that names it.

A rank's failure is learnt two ways: the transport reports it (a process sentinel, an error
the worker sent, a failed actor call, a rank declared hung), or a collective in rank 0's
forward fails (gloo: the dead peer's socket closes), after which the transport gets a moment
to say which rank. A rank that hangs is declared so by the transport's watcher (no heartbeat,
or a step unfinished for `PAGEDSERVE_STEP_TIMEOUT_S`: `progress.StepProgress`) and killed, so
that rank 0's collective fails at once; the group's timeout (`PAGEDSERVE_DIST_TIMEOUT_S`) is
the last resort.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pagedserve import envs
from pagedserve.distributed import destroy_distributed
from pagedserve.distributed.parallel_state import abort_distributed
from pagedserve.engine.runner_outputs import ModelRunnerOutput, PendingStep
from pagedserve.executor.base import Executor, StepMessage, WorkerError
from pagedserve.scheduler import Request, SchedulerOutput

T = TypeVar("T")


class RankFailures:
    """The first failure of another rank, recorded by whichever thread learns of it (the
    engine's, or the transport's watcher). A watcher thread holds this and what it watches,
    never the executor: an executor dropped without shutdown() must be collected, so that its
    finalizer stops the ranks and leaves the group."""

    def __init__(self) -> None:
        self.first: str | None = None
        self.closing = False  # our own shutdown: ranks exiting then is no failure
        self._lock = threading.Lock()

    def record(self, message: str) -> None:
        """The first failure is the one reported (a rank's own error beats its exit code)."""
        with self._lock:
            if self.first is None and not self.closing:
                self.first = message


class RemoteRanksExecutor(Executor):
    """Subclasses start the ranks, then call `_join` with their group's rendezvous; they
    implement `_send`, `_poll`, `_all_ready` and `_stop_ranks`."""

    def _init_state(self, world_size: int) -> None:
        self.world_size = world_size
        self.failures = RankFailures()
        self._closed = False
        self._finished: list[str] = []

    @property
    def failure(self) -> str | None:
        """The first rank failure recorded, if any."""
        return self.failures.first

    # ---- the transport's part ---------------------------------------------------------------

    def _send(self, command: tuple[str, Any]) -> None:
        """Give every other rank `command` (in order)."""
        raise NotImplementedError

    def _poll(self) -> None:
        """Learn of failures the transport knows of now (`_fail`), without blocking."""

    def _all_loaded(self) -> bool:
        """Whether every other rank has loaded its shard."""
        raise NotImplementedError

    def _all_ready(self) -> bool:
        """Whether every other rank has finished starting."""
        raise NotImplementedError

    def _wait_until(self, done: Callable[[], bool], timeout_s: float | None, what: str) -> None:
        """Wait for the other ranks while watching them."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done() and self.failure is None:
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"tensor-parallel ranks did not finish {what} in {timeout_s:.0f} s")
                break
            self._poll()
            time.sleep(0.02)
        self.check_health()

    def _stop_ranks(self) -> None:
        """End every other rank (politely, then by force); none may outlive this."""
        raise NotImplementedError

    # ---- failures -----------------------------------------------------------------------------

    def _fail(self, message: str) -> None:
        self.failures.record(message)

    def _await_failure(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.failure is None and time.monotonic() < deadline:
            self._poll()
            time.sleep(0.02)

    def check_health(self) -> None:
        self._poll()
        if self.failure is not None:
            self._raise()

    def _raise(self, cause: BaseException | None = None) -> None:
        """Stop every rank, then raise the failing rank's error (or, when no rank failed,
        `cause` itself: this process's own error)."""
        failure = self.failure
        self.shutdown()
        if failure is None and cause is not None:
            raise cause
        raise WorkerError(failure) from cause

    @contextmanager
    def _guard(self) -> Iterator[None]:
        self.check_health()
        try:
            yield
        except WorkerError:
            raise
        except Exception as exc:
            self._await_failure(2.0)
            self._raise(exc)

    def _while_watching(self, fn: Callable[[], T], what: str) -> T:
        """Run a start-up phase that blocks on the other ranks (the group's rendezvous, the
        first collectives) in a thread, so a rank that fails meanwhile is reported with its
        own message at once rather than after the group's timeout."""
        result: list[Any] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                result.append(fn())
            except BaseException as exc:
                error.append(exc)

        thread = threading.Thread(target=run, name=f"pagedserve-tp {what}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            self._poll()
            if self.failure is not None:
                self._raise()
        if error:
            self._await_failure(2.0)
            self._raise(error[0])
        return result[0]

    # ---- the runner's interface -------------------------------------------------------------

    def start_runner(self, model: Any, vocab_size: int, max_model_len: int,
                     eos_token_id: int | None) -> None:
        with self._guard():
            super().start_runner(model, vocab_size, max_model_len, eos_token_id)

    def determine_cache_size(self) -> tuple[int, int]:
        # Loading takes as long as it takes on each rank: no collective (and so no group
        # timeout) until every rank has its shard; from here on the ranks move together.
        self._wait_until(self._all_loaded, None, "loading")
        return self._while_watching(super().determine_cache_size, "sizing the cache")

    def warmup(self) -> None:
        self._while_watching(super().warmup, "warm-up")
        self._wait_until(self._all_ready, envs.PAGEDSERVE_DIST_TIMEOUT_S, "starting")

    def add_request(self, request: Request) -> None:
        self.check_health()
        super().add_request(request)

    def finish_request(self, request_id: str) -> None:
        super().finish_request(request_id)
        self._finished.append(request_id)

    def launch(self, batch: SchedulerOutput) -> PendingStep:
        with self._guard():
            self._send(("launch", StepMessage.of(batch, self._finished)))
            self._finished = []
            return self.runner.launch(batch)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        with self._guard():
            self._send(("collect", None))
            self.runner.queue_sampling(pending)  # a guided step's, if its launch left it
            self._wait_for_device(pending)
            return self.runner.collect(pending)

    def _wait_for_device(self, pending: PendingStep) -> None:
        """On CUDA, wait for the step's samples while watching the ranks: a step whose NCCL
        peer died would otherwise hold the host until the group's timeout."""
        event = pending.host_copy[1]
        if event is None:
            return
        start = next_poll = time.monotonic()
        while not event.query():
            if time.monotonic() >= next_poll:
                self._poll()
                next_poll = time.monotonic() + 0.01
            if self.failure is not None:
                self._raise()
            time.sleep(50e-6)
        self.runner.wait_seconds += time.monotonic() - start  # the runner's own wait is then 0

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.failures.closing = True
        self._stop_ranks()
        if self.failure is not None:
            abort_distributed()  # collectives may be stuck in flight: do not wait for them
        else:
            destroy_distributed()
