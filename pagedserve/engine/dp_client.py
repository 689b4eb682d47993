"""Data parallelism: several engine cores, each a process of its own with its own model copy
(and GPUs), behind one front. A request (all its `n` sequences) goes to the core with the fewest
unfinished sequences; outputs are taken from whichever core has one, in turn. Aborts and stop
strings go to the core that holds the sequence. Same methods as MPClient, so LLMEngine and
AsyncLLM drive it unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import EngineDeadError, MPClient
from pagedserve.engine.core_messages import CoreInfo, CoreRequest, CoreStats, StepOutput


def core_configs(config: EngineConfig) -> list[EngineConfig]:
    """Each core's settings: on CUDA core i takes the GPUs after core i - 1's (its
    tensor-parallel ranks included), from the configured device on; on the CPU all share it."""
    n, tp = config.data_parallel_size, config.tensor_parallel_size
    device = config.torch_device
    if device.type != "cuda":
        return [dataclasses.replace(config, data_parallel_size=1) for _ in range(n)]
    base = device.index or 0
    visible = torch.cuda.device_count()
    if base + n * tp > visible:
        raise ValueError(f"data_parallel_size {n} x tensor_parallel_size {tp} from cuda:{base} "
                         f"needs {base + n * tp} GPUs; {visible} are visible")
    return [dataclasses.replace(config, data_parallel_size=1, device=f"cuda:{base + i * tp}")
            for i in range(n)]


class DPClient:
    """N MPClients, one per engine core."""

    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        self.clients: list[MPClient] = []
        try:
            # Started side by side (each loads its model and captures its graphs at once).
            for core_config in core_configs(config):
                self.clients.append(MPClient(core_config, log_stats, wait=False))
            for client in self.clients:
                client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.info: CoreInfo = self.clients[0].info
        self.idle_poll_s = self.clients[0].idle_poll_s
        self._owner: dict[str, int] = {}  # sequence id -> its core
        self._load = [0] * len(self.clients)  # unfinished sequences per core
        self._turn = 0  # the core whose outputs are looked at first

    # ---- requests -----------------------------------------------------------------------

    def add_requests(self, requests: list[CoreRequest]) -> None:
        """One request's sequences, all to the least loaded core (they share its prefix
        cache)."""
        core = min(range(len(self.clients)), key=self._load.__getitem__)
        self.clients[core].add_requests(requests)
        for request in requests:
            self._owner[request.request_id] = core
        self._load[core] += len(requests)

    def abort_requests(self, seq_ids: list[str], stopped: bool = False) -> None:
        by_core: dict[int, list[str]] = {}
        for seq_id in seq_ids:
            core = self._forget(seq_id)
            if core is not None:
                by_core.setdefault(core, []).append(seq_id)
        for core, ids in by_core.items():
            self.clients[core].abort_requests(ids, stopped)

    def _forget(self, seq_id: str) -> int | None:
        core = self._owner.pop(seq_id, None)
        if core is not None:
            self._load[core] -= 1
        return core

    # ---- outputs ------------------------------------------------------------------------

    def get_output(self, timeout: float | None = 0.05) -> StepOutput | None:
        """The next step output of any core, or None after `timeout` seconds without one."""
        import zmq

        for client in self.clients:
            client.send_queued()
        out = self._next_ready()
        if out is not None:
            return out
        poller = zmq.Poller()
        for client in self.clients:
            poller.register(client.output_socket, zmq.POLLIN)
        if not poller.poll(None if timeout is None else int(timeout * 1000)):
            self.check_alive()
            return None
        return self._next_ready()

    def _next_ready(self) -> StepOutput | None:
        n = len(self.clients)
        for k in range(n):
            core = (self._turn + k) % n
            out = self.clients[core].next_output()
            if out is not None:
                self._turn = (core + 1) % n
                for seq_id in (*out.finished, *out.failed):
                    self._forget(seq_id)
                return out
        return None

    def has_unfinished_requests(self) -> bool:
        return any(client.has_unfinished_requests() for client in self.clients)

    # ---- stats and utilities ------------------------------------------------------------

    def stats(self) -> CoreStats:
        return merge_stats([client.stats() for client in self.clients])

    def call_utility(self, name: str) -> Any:
        """Every core's answer: stats merged, reset_prefix_cache True when all did, else the
        first core's."""
        results = [client.call_utility(name) for client in self.clients]
        if name == "stats":
            return merge_stats(results)
        if name == "reset_prefix_cache":
            return all(results)
        return results[0]

    # ---- lifetime -----------------------------------------------------------------------

    @property
    def dead(self) -> str | None:
        return next((c.dead for c in self.clients if c.dead is not None), None)

    def check_alive(self) -> None:
        """One core gone fails the engine: its requests cannot move to another core."""
        for client in self.clients:
            client.check_alive()

    def on_death(self, callback: Callable[[], None]) -> None:
        for client in self.clients:
            client.on_death(callback)

    def shutdown(self) -> None:
        for client in self.clients:
            try:
                client.shutdown()
            except EngineDeadError:
                pass


def merge_stats(stats: list[CoreStats]) -> CoreStats:
    """The cores' counters as one engine's: sums, the mean cache usage, all free when all are."""
    per_pos = "spec_decode_num_accepted_tokens_per_pos"
    merged = {f: sum(getattr(s, f) for s in stats) for f in CoreStats.__struct_fields__
              if f != per_pos}
    merged[per_pos] = [sum(col) for col in zip(*(getattr(s, per_pos) for s in stats),
                                               strict=True)]
    merged["kv_cache_usage"] = sum(s.kv_cache_usage for s in stats) / len(stats)
    merged["all_free"] = all(s.all_free for s in stats)
    return CoreStats(**merged)
