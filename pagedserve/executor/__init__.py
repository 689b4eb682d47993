"""Where the model's ranks run: in the engine's process (`UniProcExecutor`), in worker processes
(`MultiprocExecutor`) or Ray actors (`RayExecutor`); the engine talks to any of them as it
talked to its model runner (`Executor`)."""

from __future__ import annotations

import torch

from pagedserve.config import EngineConfig
from pagedserve.executor.base import Executor, UniProcExecutor, WorkerError


def executor_backend(config: EngineConfig) -> str:
    """The backend asked for, else uni at one rank and mp above."""
    if config.distributed_executor_backend is not None:
        return config.distributed_executor_backend
    return "uni" if config.tensor_parallel_size == 1 else "mp"


def create_executor(config: EngineConfig, dtype: torch.dtype,
                    quantization: str | None) -> Executor:
    """The executor for `config`; with more than one rank it has started the other ranks and
    joined their group, so the model this process loads next is rank 0's shard."""
    backend = executor_backend(config)
    if backend == "uni":
        return UniProcExecutor(config)
    device = config.torch_device
    if backend == "mp" and device.type == "cuda":
        needed = (device.index or 0) + config.tensor_parallel_size
        if torch.cuda.device_count() < needed:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} from "
                             f"{device} needs cuda:0..{needed - 1}; this machine has "
                             f"{torch.cuda.device_count()} GPUs")
    if backend == "mp":
        from pagedserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, dtype, quantization)
    from pagedserve.executor.ray_executor import RayExecutor

    return RayExecutor(config, dtype, quantization)


__all__ = ["Executor", "UniProcExecutor", "WorkerError", "create_executor", "executor_backend"]
