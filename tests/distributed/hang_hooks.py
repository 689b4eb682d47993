"""Test-only worker entry points, imported by the spawned worker process itself (the
executor's `worker_main` is swapped for one of these in the engine's process, and spawn
pickles the target by reference, so the product code carries no test hook)."""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection

from pagedserve.executor.worker import Worker, WorkerSpec, worker_main

STUCK_AT = "HANG_HOOKS_STUCK_AT"


def worker_main_stuck_at_launch(spec: WorkerSpec, commands: Connection,
                                replies: Connection) -> None:
    """A worker whose $HANG_HOOKS_STUCK_AT-th step never finishes (as a kernel or collective
    that never returns), while its heartbeat thread goes on beating. The number is read at the
    first step, inside `worker_main`: a worker forked from a forkserver that started before the
    test set it finds it only if `worker_main` took on the engine's environment."""
    launch = Worker.launch
    launches = 0

    def stuck_launch(self: Worker, msg) -> None:
        nonlocal launches
        launches += 1
        if launches == int(os.environ[STUCK_AT]):
            threading.Event().wait()
        launch(self, msg)

    Worker.launch = stuck_launch
    worker_main(spec, commands, replies)
