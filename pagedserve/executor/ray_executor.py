"""Ranks 1..N-1 as Ray actors, rank 0 in the engine's process.

The actors are placed in a placement group of one bundle per rank (a GPU each on CUDA, a CPU
each on the CPU), so Ray reserves them together or not at all; on CUDA the engine's own rank
runs on the GPU of bundle 0, which an idle actor holds so that no rank lands on it. Commands
are actor calls (Ray runs one caller's calls to an actor in order); their results are only
checked for errors, without waiting, by the engine's thread and by a watcher thread (rank 0
may be blocked in a collective). A call unfinished for `PAGEDSERVE_STEP_TIMEOUT_S` marks its
actor hung: it is reported and killed, so that rank 0's collective fails at once (Ray's own
health checks cover dead nodes and processes).
Ray is imported only when this executor is asked for; the engine starts a local Ray unless
one is running (or RAY_ADDRESS names a cluster).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.distributed import free_port_init_method
from pagedserve.executor.progress import StepProgress
from pagedserve.executor.remote import RemoteRanksExecutor
from pagedserve.executor.worker import Worker, WorkerSpec, join_group

logger = logging.getLogger(__name__)


class RayWorker:
    """The actor: a `Worker` whose methods Ray calls."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.worker = Worker(spec)

    def load(self) -> None:
        self.worker.load()

    def finish_setup(self) -> None:
        self.worker.finish_setup()

    def handle(self, kind: str, payload: Any = None) -> None:
        self.worker.handle(kind, payload)

    def close(self) -> None:
        self.worker.close()


class GpuHolder:
    """An idle actor on the engine's own bundle: it keeps that GPU reserved for rank 0 and
    says which one Ray gave it."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


def _local_index(gpu_id: str) -> int:
    """A Ray GPU id as this process's CUDA index (Ray names GPUs by CUDA_VISIBLE_DEVICES)."""
    visible = envs.CUDA_VISIBLE_DEVICES
    if visible:
        return [v.strip() for v in visible.split(",")].index(gpu_id)
    return int(gpu_id)


class RayExecutor(RemoteRanksExecutor):
    def __init__(self, config: EngineConfig, dtype: torch.dtype,
                 quantization: str | None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config)
        self._init_state(config.tensor_parallel_size)
        self.ray = ray
        if not ray.is_initialized():
            ray.init()
        cuda = config.torch_device.type == "cuda"
        # One bundle per rank; on CUDA bundle 0 is the engine's GPU (held by a GpuHolder, so
        # no actor lands on it), on the CPU the engine's rank needs no bundle.
        bundle = {"GPU": 1.0, "CPU": 1.0} if cuda else {"CPU": 1.0}
        first = 1 if cuda else 0
        count = self.world_size - 1 + first
        self.placement = placement_group([bundle] * count, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=envs.PAGEDSERVE_DIST_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement)
            raise ValueError(f"Ray could not reserve {count} bundles of {bundle} for "
                             f"tensor_parallel_size {self.world_size} (cluster resources: "
                             f"{ray.cluster_resources()})") from None

        def on_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(self.placement,
                                                    placement_group_bundle_index=index)

        self.holder = None
        if cuda:
            self.holder = ray.remote(num_cpus=0, num_gpus=1)(GpuHolder).options(
                scheduling_strategy=on_bundle(0)).remote()
            (gpu,) = ray.get(self.holder.gpu_ids.remote())
            config.device = f"cuda:{_local_index(gpu)}"  # the engine loads rank 0 there
        init_method = free_port_init_method(ray.util.get_node_ip_address())
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0)(RayWorker)
        self.actors = []
        for rank in range(1, self.world_size):
            spec = WorkerSpec(config, rank, self.world_size, init_method, dtype, quantization,
                              device="cuda:0" if cuda else "cpu")  # an actor sees its one GPU
            self.actors.append(actor_cls.options(
                scheduling_strategy=on_bundle(rank - 1 + first)).remote(spec))
        # Calls not yet known to have succeeded: object ref -> rank. The engine's thread and
        # the watcher both poll them.
        self._outstanding: dict[Any, int] = {}
        self._calls_lock = threading.Lock()
        self._commands_done = dict.fromkeys(range(1, self.world_size), 0)
        self.progress = StepProgress(range(1, self.world_size))
        # Ray runs one caller's calls to an actor in order: finish_setup after load.
        self._load = {actor.load.remote(): rank for rank, actor in enumerate(self.actors, 1)}
        self._setup = {actor.finish_setup.remote(): rank
                       for rank, actor in enumerate(self.actors, start=1)}
        self._outstanding.update(self._load)
        self._outstanding.update(self._setup)
        self._loaded = self._ready = 0
        threading.Thread(target=self._watch, name="pagedserve-tp ray monitor",
                         daemon=True).start()
        self._while_watching(lambda: join_group(config, 0, self.world_size, init_method),
                             "joining the group")

    def _watch(self) -> None:
        """Poll while rank 0 may be blocked in a collective (on the CPU its forward waits
        there), so a hung actor is declared and killed within the step timeout."""
        while True:
            time.sleep(0.25)
            if self._closed:
                return
            try:
                self._poll()
            except Exception as exc:  # Ray itself went away under us
                self._fail(f"tensor-parallel ranks: Ray failed: {exc}")
                return

    def _poll(self) -> None:
        with self._calls_lock:
            if not self._closed:  # after shutdown the actors and maybe Ray are gone
                self._poll_calls()

    def _poll_calls(self) -> None:
        if self._outstanding:
            refs = list(self._outstanding)
            done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in done:
                rank = self._outstanding.pop(ref)
                try:
                    self.ray.get(ref)
                except Exception as exc:  # RayActorError (it died), RayTaskError (it raised)
                    self._fail(f"tensor-parallel rank {rank} failed: {exc}")
                    continue
                if ref in self._load:
                    self._loaded += 1
                elif ref in self._setup:
                    self._ready += 1
                else:  # a step's command: an actor runs its calls in order, so a count
                    self._commands_done[rank] += 1
                    self.progress.done(rank, self._commands_done[rank])
        if self.failure is None and not self._closing:
            late = self.progress.overdue(envs.PAGEDSERVE_STEP_TIMEOUT_S)
            if late is not None:
                message = f"tensor-parallel rank {late.rank} (Ray actor) {late.describe()}"
                logger.error("%s: killing it", message)
                self._fail(message)
                self.ray.kill(self.actors[late.rank - 1])

    def _all_loaded(self) -> bool:
        return self._loaded == self.world_size - 1

    def _all_ready(self) -> bool:
        return self._ready == self.world_size - 1

    def _send(self, command: tuple[str, Any]) -> None:
        with self._calls_lock:
            self.progress.sent(command[0])
            for rank, actor in enumerate(self.actors, start=1):
                self._outstanding[actor.handle.remote(*command)] = rank
            if len(self._outstanding) > 64 * len(self.actors):
                self._poll_calls()  # results of calls long done: let them go

    def _stop_ranks(self) -> None:
        for actor in [*self.actors, *([self.holder] if self.holder is not None else [])]:
            self.ray.kill(actor)
        self.ray.util.remove_placement_group(self.placement)
