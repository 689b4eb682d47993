"""How many threads torch's CPU kernels get: one per physical core the process may use.

Hyper-threads share a core's vector units, and a matmul thread per logical CPU only makes the
threads wait on each other; a process pinned to fewer CPUs (taskset, a container's cpuset) or
limited by a CPU quota must not start more threads than it can run at once. `OMP_NUM_THREADS`,
when set, wins.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from pagedserve import envs

logger = logging.getLogger(__name__)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int]) -> int:
    """Distinct (package, core) pairs among `cpus`; their count where the topology is hidden."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def cpu_quota() -> int | None:
    """A cgroup v2 CPU limit in whole CPUs (rounded up), None without one."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def cpu_threads() -> int:
    cpus = usable_cpus()
    quota = cpu_quota()
    return min(physical_cores(cpus), quota if quota is not None else len(cpus))


def configure_cpu_threads() -> int:
    """Set torch's intra-op threads for CPU inference; returns the count in use."""
    if envs.OMP_NUM_THREADS is not None:
        return torch.get_num_threads()
    threads = cpu_threads()
    if torch.get_num_threads() != threads:
        logger.info("CPU threads: %d (one per physical core this process may use; was %d)",
                    threads, torch.get_num_threads())
        torch.set_num_threads(threads)
    return threads
