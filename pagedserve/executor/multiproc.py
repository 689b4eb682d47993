"""Ranks 1..N-1 in worker processes (spawned, or forked from a forkserver), rank 0 in the
engine's process.

Commands go down one pipe per worker (a `StepMessage` per launch, a word per collect);
answers come up another: "loaded" and "ready" at start-up, the rank's error, and from "ready"
on a heartbeat every 0.5 s carrying how many commands the worker has finished. A monitor
thread watches the workers' process sentinels and answer pipes, so a worker that dies or fails
is known at once (`remote.RemoteRanksExecutor` turns it into the engine's error), and one that
hangs within seconds: silent for `PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S` (stopped, wedged with
the GIL held), or beating but not finishing a command within `PAGEDSERVE_STEP_TIMEOUT_S` of
its sending (stuck in a kernel or a collective). The monitor then kills it, so that rank 0's
collective fails at once rather than after the group's timeout.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.distributed import free_port_init_method
from pagedserve.distributed.parallel_state import abort_distributed
from pagedserve.executor.progress import StepProgress
from pagedserve.executor.remote import RankFailures, RemoteRanksExecutor
from pagedserve.executor.worker import WorkerSpec, join_group, worker_main
from pagedserve.process_start import handed_environment, start_context

logger = logging.getLogger(__name__)


def _stop(processes: list[Any], commands: list[Connection], lock: threading.Lock,
          grace_s: float = 5.0) -> None:
    """Ask the workers to exit, then terminate, then kill: none outlives this. The group goes
    with them (an engine dropped without shutdown() frees the process for the next one).
    Exits are awaited on the sentinels, which reads nothing: a forkserver's child's exit code
    is one message on its sentinel, and of two threads reading it at once (the monitor's
    join, this one) the loser records 255; both read it only under `lock`."""
    for conn in commands:
        try:
            conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    pending = [proc.sentinel for proc in processes]
    while pending and (left := deadline - time.monotonic()) > 0:
        for ready in wait(pending, left):
            pending.remove(ready)
    with lock:
        for proc in processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    abort_distributed()


class WorkerMonitor:
    """The monitor thread's part: until every worker has exited, record readiness,
    heartbeats, errors and deaths, and declare a worker hung when it falls silent or behind.
    The thread holds this, not the executor, so that an engine dropped without shutdown() is
    collected and its finalizer stops the workers (which ends this thread)."""

    def __init__(self, processes: list[Any], replies: list[Connection],
                 failures: RankFailures, lock: threading.Lock) -> None:
        self.processes = processes
        self.lock = lock  # around reading a worker's exit code (see `_stop`)
        self.replies = replies
        self.failures = failures
        self.loaded: set[int] = set()
        self.ready: set[int] = set()
        self.heard: dict[int, float] = {}  # rank -> when it last spoke, from "ready" on
        self.progress = StepProgress(range(1, len(processes) + 1))

    def run(self) -> None:
        rank_of = {p.sentinel: r for r, p in enumerate(self.processes, start=1)}
        pipes = list(self.replies)
        sentinels = list(rank_of)
        while sentinels:
            for ready in wait(pipes + sentinels, timeout=0.25):
                if ready not in rank_of:
                    self._read(ready, pipes)
                    continue
                sentinels.remove(ready)
                rank = rank_of[ready]
                self._read(self.replies[rank - 1], pipes)  # its own error first, if it sent one
                self.heard.pop(rank, None)
                self.progress.forget(rank)
                proc = self.processes[rank - 1]
                with self.lock:
                    proc.join(0.5)
                    code = proc.exitcode
                self.failures.record(f"tensor-parallel rank {rank} (pid {proc.pid}) exited "
                                     f"with code {code}")
            # Only after the pipes that had something are read: a monitor that was itself
            # held up must not blame a worker for words it has not read yet.
            self._check_liveness(time.monotonic())

    def _read(self, pipe: Connection, pipes: list[Connection]) -> None:
        """Whatever a worker has sent: "loaded", "ready", a heartbeat, or its error."""
        try:
            while pipe in pipes and pipe.poll():
                kind, rank, payload = pipe.recv()
                if kind == "alive":
                    self.heard[rank] = time.monotonic()
                    self.progress.done(rank, payload)
                elif kind == "loaded":
                    self.loaded.add(rank)
                elif kind == "ready":
                    self.heard[rank] = time.monotonic()
                    self.ready.add(rank)
                else:
                    self.failures.record(f"tensor-parallel rank {rank} failed: {payload}")
        except (EOFError, OSError):
            pipes.remove(pipe)

    def _check_liveness(self, now: float) -> None:
        if self.failures.first is not None or self.failures.closing:
            return  # the ranks are being stopped anyway
        silence = envs.PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S
        for rank, heard in list(self.heard.items()):
            if now - heard > silence:
                self._hung(rank, f"stopped responding: no heartbeat for {silence:g} s")
                return
        late = self.progress.overdue(envs.PAGEDSERVE_STEP_TIMEOUT_S, now)
        if late is not None:
            self._hung(late.rank, late.describe())

    def _hung(self, rank: int, what: str) -> None:
        """Report a hung worker, then kill it: its peers' collectives (rank 0's among them)
        fail at once when its sockets close, and the engine raises this message (the first
        failure recorded wins over the exit the kill causes)."""
        proc = self.processes[rank - 1]
        message = f"tensor-parallel rank {rank} (pid {proc.pid}) {what}"
        logger.error("%s: killing it", message)
        self.failures.record(message)
        self.heard.pop(rank, None)
        proc.kill()


class MultiprocExecutor(RemoteRanksExecutor):
    def __init__(self, config: EngineConfig, dtype: torch.dtype,
                 quantization: str | None) -> None:
        super().__init__(config)
        self._init_state(config.tensor_parallel_size)
        world_size = self.world_size
        init_method = free_port_init_method()
        ctx = start_context()
        environ = handed_environment(ctx)
        self.processes: list[Any] = []
        self.commands: list[Connection] = []
        self.replies: list[Connection] = []
        for rank in range(1, world_size):
            spec = WorkerSpec(config, rank, world_size, init_method, dtype, quantization,
                              environ=environ)
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
        # Workers are stopped, and the group left, even when the engine is dropped without
        # shutdown(): nothing else holds the executor (the monitor thread holds its
        # `WorkerMonitor`), so this runs when the engine is collected, or else at exit.
        lock = threading.Lock()
        self._stopper = weakref.finalize(self, _stop, list(self.processes), list(self.commands),
                                         lock)
        self.monitor = WorkerMonitor(self.processes, self.replies, self.failures, lock)
        threading.Thread(target=self.monitor.run, name="pagedserve-tp monitor",
                         daemon=True).start()
        self._while_watching(lambda: join_group(config, 0, world_size, init_method),
                             "joining the group")

    def _all_loaded(self) -> bool:
        return len(self.monitor.loaded) == self.world_size - 1

    def _all_ready(self) -> bool:
        return len(self.monitor.ready) == self.world_size - 1

    def _send(self, command: tuple[str, Any]) -> None:
        self.monitor.progress.sent(command[0])
        for conn in self.commands:
            conn.send(command)

    def _stop_ranks(self) -> None:
        self._stopper()
