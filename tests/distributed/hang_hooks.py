"""Test-only worker entry points, imported by the spawned worker process itself (the
executor's `worker_main` is swapped for one of these in the engine's process, and spawn
pickles the target by reference, so the product code carries no test hook)."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

from pagedserve.executor.worker import Worker, WorkerSpec, worker_main


def worker_main_stuck_at_launch(stuck_at: int, spec: WorkerSpec, commands: Connection,
                                replies: Connection) -> None:
    """A worker whose `stuck_at`-th step never finishes (as a kernel or collective that never
    returns), while its heartbeat thread goes on beating."""
    launch = Worker.launch
    launches = 0

    def stuck_launch(self: Worker, msg) -> None:
        nonlocal launches
        launches += 1
        if launches == stuck_at:
            threading.Event().wait()
        launch(self, msg)

    Worker.launch = stuck_launch
    worker_main(spec, commands, replies)
