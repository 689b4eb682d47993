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
import weakref
from typing import Any

import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.distributed import free_port_init_method
from pagedserve.distributed.parallel_state import abort_distributed
from pagedserve.executor.progress import StepProgress
from pagedserve.executor.remote import RankFailures, RemoteRanksExecutor
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
        # Ray runs one caller's calls to an actor in order: finish_setup after load.
        self.calls = ActorCalls(ray, self.actors, self.failures,
                                [actor.load.remote() for actor in self.actors],
                                [actor.finish_setup.remote() for actor in self.actors])
        # The actors are killed, and the group left, even when the engine is dropped without
        # shutdown(): the watcher thread holds `self.calls`, not the executor, so this runs
        # when the engine is collected, or else at exit.
        self._stopper = weakref.finalize(self, _stop_actors, self.calls, self.holder,
                                         self.placement)
        threading.Thread(target=self.calls.watch, name="pagedserve-tp ray monitor",
                         daemon=True).start()
        world_size = self.world_size
        self._while_watching(lambda: join_group(config, 0, world_size, init_method),
                             "joining the group")

    def _poll(self) -> None:
        self.calls.poll()

    def _all_loaded(self) -> bool:
        return self.calls.loaded == self.world_size - 1

    def _all_ready(self) -> bool:
        return self.calls.ready == self.world_size - 1

    def _send(self, command: tuple[str, Any]) -> None:
        self.calls.send(command)

    def _stop_ranks(self) -> None:
        self._stopper()


class ActorCalls:
    """The actor calls not yet known to have succeeded (object ref -> rank) and what their
    results have told: polled by the engine's thread and by the watcher thread, which holds
    this, not the executor (see `RankFailures`)."""

    def __init__(self, ray: Any, actors: list[Any], failures: RankFailures,
                 load: list[Any], setup: list[Any]) -> None:
        self.ray = ray
        self.actors = actors
        self.failures = failures
        self.lock = threading.Lock()
        self.closed = False  # after shutdown the actors and maybe Ray are gone
        self.load = {ref: rank for rank, ref in enumerate(load, start=1)}
        self.setup = {ref: rank for rank, ref in enumerate(setup, start=1)}
        self.outstanding: dict[Any, int] = {**self.load, **self.setup}
        self.loaded = self.ready = 0
        self.commands_done = dict.fromkeys(range(1, len(actors) + 1), 0)
        self.progress = StepProgress(range(1, len(actors) + 1))

    def watch(self) -> None:
        """Poll while rank 0 may be blocked in a collective (on the CPU its forward waits
        there), so a hung actor is declared and killed within the step timeout."""
        while True:
            time.sleep(0.25)
            if self.closed:
                return
            try:
                self.poll()
            except Exception as exc:  # Ray itself went away under us
                self.failures.record(f"tensor-parallel ranks: Ray failed: {exc}")
                return

    def poll(self) -> None:
        with self.lock:
            if not self.closed:
                self._poll_calls()

    def _poll_calls(self) -> None:
        if self.outstanding:
            refs = list(self.outstanding)
            done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in done:
                rank = self.outstanding.pop(ref)
                try:
                    self.ray.get(ref)
                except Exception as exc:  # RayActorError (it died), RayTaskError (it raised)
                    self.failures.record(f"tensor-parallel rank {rank} failed: {exc}")
                    continue
                if ref in self.load:
                    self.loaded += 1
                elif ref in self.setup:
                    self.ready += 1
                else:  # a step's command: an actor runs its calls in order, so a count
                    self.commands_done[rank] += 1
                    self.progress.done(rank, self.commands_done[rank])
        if self.failures.first is None and not self.failures.closing:
            late = self.progress.overdue(envs.PAGEDSERVE_STEP_TIMEOUT_S)
            if late is not None:
                message = f"tensor-parallel rank {late.rank} (Ray actor) {late.describe()}"
                logger.error("%s: killing it", message)
                self.failures.record(message)
                self.ray.kill(self.actors[late.rank - 1])

    def send(self, command: tuple[str, Any]) -> None:
        with self.lock:
            self.progress.sent(command[0])
            for rank, actor in enumerate(self.actors, start=1):
                self.outstanding[actor.handle.remote(*command)] = rank
            if len(self.outstanding) > 64 * len(self.actors):
                self._poll_calls()  # results of calls long done: let them go


def _stop_actors(calls: ActorCalls, holder: Any, placement: Any) -> None:
    """Kill the actors (and the GPU holder), free their bundles and leave the group. Ray may
    be shut down already (its own exit hook, or the caller's ray.shutdown()): its actors went
    with it."""
    with calls.lock:
        calls.closed = True  # neither thread polls the actors from here on
    ray = calls.ray
    if ray.is_initialized():
        for actor in [*calls.actors, *([holder] if holder is not None else [])]:
            ray.kill(actor)
        ray.util.remove_placement_group(placement)
    abort_distributed()
