"""torch's CPU threads: one per physical core the process may run on, OMP_NUM_THREADS winning."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.engine import cpu_threads


def _threads_in_child(env: dict[str, str], cpus: set[int] | None = None) -> int:
    code = ("import os, torch; from pagedserve.engine.cpu_threads import configure_cpu_threads;"
            + (f"os.sched_setaffinity(0, {sorted(cpus)!r});" if cpus else "")
            + "print(configure_cpu_threads(), torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    returned, actual = map(int, out.stdout.split())
    assert returned == actual
    return actual


def test_physical_cores_and_quota(monkeypatch, tmp_path) -> None:
    cpus = cpu_threads.usable_cpus()
    assert 1 <= cpu_threads.physical_cores(cpus) <= len(cpus)
    assert cpu_threads.cpu_threads() <= len(cpus)
    monkeypatch.setattr(cpu_threads, "cpu_quota", lambda: 1)
    assert cpu_threads.cpu_threads() == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_pinned_process_gets_one_thread_per_usable_core() -> None:
    env = {"OMP_NUM_THREADS": ""}
    runs = [(env, {min(cpu_threads.usable_cpus())}), (env, None), ({"OMP_NUM_THREADS": "1"}, None)]
    # Two children at a time: each is mostly one core's imports, and its threads are counted
    # from its affinity and environment, not from the load.
    with ThreadPoolExecutor(2) as pool:
        pinned, unpinned, one = pool.map(lambda run: _threads_in_child(*run), runs)
    assert pinned == 1
    assert unpinned == cpu_threads.cpu_threads()
    assert one == 1
