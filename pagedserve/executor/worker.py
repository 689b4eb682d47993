"""A rank other than the engine's: it loads its shard, builds its runner and runs each step the
engine's executor tells it, keeping copies of the engine's requests (`StepMessage`). The
same object serves a worker process (`worker_main`) and a Ray actor."""

from __future__ import annotations

import dataclasses
import logging
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.distributed import all_reduce_min, destroy_distributed, init_distributed
from pagedserve.engine.cpu_threads import cpu_threads
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.runner_outputs import PendingStep
from pagedserve.executor.base import StepMessage
from pagedserve.process_start import take_environment
from pagedserve.scheduler import Request

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a rank needs to start, picklable."""

    config: EngineConfig
    rank: int
    world_size: int
    init_method: str
    dtype: torch.dtype
    quantization: str | None
    # The device this rank uses, where the executor places it (a Ray actor sees its one GPU
    # as cuda:0); None: `rank_device`.
    device: str | None = None
    # The engine's environment, where the worker does not inherit it (forked from a
    # forkserver started before the engine); None: the worker's own is the engine's.
    environ: dict[str, str] | None = None


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank r runs on the engine's device + r on CUDA (cuda:0 -> cuda:r), on the CPU on the
    CPU."""
    device = config.torch_device
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{(device.index or 0) + rank}"


def join_group(config: EngineConfig, rank: int, world_size: int, init_method: str) -> None:
    """This process joins the TP group as `rank` (NCCL on CUDA, gloo on the CPU). CPU ranks
    share the machine's cores."""
    device = config.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    else:
        torch.set_num_threads(max(1, cpu_threads() // world_size))
    init_distributed(rank, world_size, init_method, "nccl" if device.type == "cuda" else "gloo",
                     envs.PAGEDSERVE_DIST_TIMEOUT_S)


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.config = dataclasses.replace(
            spec.config, device=spec.device or rank_device(spec.config, spec.rank))
        self.runner: ModelRunner | None = None
        # The engine's requests as this rank knows them, by id.
        self.requests: dict[str, Request] = {}
        self.pending: deque[PendingStep] = deque()
        self.commands_done = 0  # what the heartbeat reports: the engine's progress check

    def load(self) -> None:
        """Join the group and load this rank's shard. Ranks load at their own pace (no
        collective meanwhile); the engine waits for every rank's word before the next part."""
        from pagedserve.models.loader import load_model, text_config_of

        spec, m = self.spec, self.config.model
        join_group(self.config, spec.rank, spec.world_size, spec.init_method)
        loaded = load_model(m.model, spec.dtype, self.config.torch_device, m.max_model_len,
                            m.tokenizer, m.generation_config, spec.quantization)
        eos = loaded.eos_token_ids[0] if loaded.eos_token_ids else None
        self.runner = ModelRunner(self.config, loaded.model,
                                  text_config_of(loaded.hf_config).vocab_size,
                                  loaded.max_model_len, eos)

    def finish_setup(self) -> None:
        """Size the cache as every rank agrees, allocate it, warm up: the engine's runner does
        the same in the same order (their collectives meet)."""
        num_blocks, num_slots = self.runner.determine_cache_size()
        num_blocks, num_slots = all_reduce_min([num_blocks, num_slots], self.runner.device)
        self.runner.allocate_kv_cache(num_blocks, num_slots)
        self.runner.warmup()

    def launch(self, msg: StepMessage) -> None:
        for request_id in msg.finished_request_ids:
            self.runner.finish_request(request_id)
            self.requests.pop(request_id, None)
        lora = self.runner.lora  # this rank's share of each adapter (as rank 0's core does)
        for request in msg.new_requests:
            if request.request_id not in self.requests:
                self.runner.add_request(request)
                if lora is not None and request.lora_request is not None:
                    lora.add_request(request.lora_request)
            self.requests[request.request_id] = request
        batch = msg.output(self.requests)
        if lora is not None:
            lora.set_batch(batch)
        self.pending.append(self.runner.launch(batch))

    def collect(self) -> None:
        """The oldest launched step's samples (rank 0's) into the token table and into the
        requests' outputs (a teacher-forced request reads how many it has). A verify step's
        are [B, Kmax+1], -1 past each request's kept tokens: a request gains every kept one
        (its rejected drafts are rolled back by the engine's next num_computed_tokens)."""
        pending = self.pending.popleft()
        sampled = self.runner.collect(pending).sampled_token_ids
        requests = pending.batch.requests
        rows = sampled if sampled.ndim == 2 else sampled[:, None]
        for i in np.flatnonzero(pending.batch.will_sample).tolist():
            for token in rows[i][rows[i] >= 0].tolist():
                requests[i].append_output_token(token)

    def handle(self, kind: str, payload: Any = None) -> None:
        if kind == "launch":
            self.launch(payload)
        elif kind == "collect":
            self.collect()
        else:
            raise ValueError(f"unknown worker command {kind!r}")
        self.commands_done += 1

    def close(self) -> None:
        destroy_distributed()


HEARTBEAT_INTERVAL_S = 0.5


class _Replies:
    """The reply pipe, shared by the main thread (loaded, ready, its error) and the heartbeat
    thread: one message at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, kind: str, rank: int, payload: Any) -> None:
        with self.lock:
            self.conn.send((kind, rank, payload))


def _heartbeat(replies: _Replies, worker: Worker, stop: threading.Event) -> None:
    """("alive", rank, commands finished) every HEARTBEAT_INTERVAL_S: its absence tells the
    engine the process is stopped or wedged, the count whether its steps still finish."""
    interval = max(0.05, min(HEARTBEAT_INTERVAL_S,
                             envs.PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S / 4))
    rank = worker.spec.rank
    while not stop.wait(interval):
        try:
            replies.send("alive", rank, worker.commands_done)
        except OSError:  # the engine is gone; the main thread learns it from its own pipe
            return


def worker_main(spec: WorkerSpec, commands: Connection, replies: Connection) -> None:
    """A worker process: set up, say ready (or why not), then run commands until None, with a
    heartbeat from "ready" on."""
    take_environment(spec.environ)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp{spec.rank} %(levelname)s %(name)s: %(message)s")
    worker = Worker(spec)
    out = _Replies(replies)
    stop_beating = threading.Event()
    try:
        worker.load()
        out.send("loaded", spec.rank, None)
        worker.finish_setup()
        out.send("ready", spec.rank, None)
        threading.Thread(target=_heartbeat, args=(out, worker, stop_beating), daemon=True,
                         name=f"pagedserve-tp{spec.rank} heartbeat").start()
        while (command := commands.recv()) is not None:
            worker.handle(*command)
    except EOFError:  # the engine went away
        pass
    except BaseException as exc:
        try:
            out.send("error", spec.rank, f"{type(exc).__name__}: {exc}\n"
                                         f"{traceback.format_exc()}")
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        stop_beating.set()
        worker.close()
