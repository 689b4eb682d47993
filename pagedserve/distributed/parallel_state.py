"""The process's place in the tensor-parallel group and the collectives the layers use.

One group per process: every rank of it holds a shard of every layer (no pipeline stages yet),
so the world group is the TP group. The state is module-level because layers read it when they
are built (how many heads, which rows) and the loader when it slices weights; a process that
never calls `init_distributed` is rank 0 of 1 and every collective below returns its input.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

_rank = 0
_world_size = 1


def tp_rank() -> int:
    return _rank


def tp_world_size() -> int:
    return _world_size


def free_port_init_method(host: str = "127.0.0.1") -> str:
    """A TCP rendezvous address on a port free now (the driver picks it; the ranks meet
    there)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def init_distributed(rank: int, world_size: int, init_method: str, backend: str,
                     timeout_s: float) -> None:
    """Join the group as `rank` of `world_size` (`init_method`: tcp://host:port or
    file://path, chosen by the driver). `timeout_s` bounds every collective: a rank that stops
    answering becomes an error on the others, not a hang."""
    global _rank, _world_size
    if world_size > 1 and dist.is_initialized():
        raise RuntimeError("this process is in a tensor-parallel group already: shut the "
                           "engine that uses it down first (LLM.close(), "
                           "LLMEngine.shutdown(), or drop every reference to it)")
    if world_size > 1:
        # Imported first: imported while a group exists (transformers' config classes import
        # it through their FSDP helpers), torch's sharding module keeps references to the
        # group past destroy_process_group, and gloo's threads then outlive it and abort the
        # process at exit ("terminate called without an active exception").
        import torch.distributed.fsdp  # noqa: F401

        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    _rank, _world_size = rank, world_size


def destroy_distributed() -> None:
    global _rank, _world_size
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _world_size = 0, 1


def abort_distributed() -> None:
    """Leave a group whose collectives may never complete (a rank died): abort them rather
    than wait, then forget the group."""
    global _rank, _world_size
    if dist.is_initialized():
        from torch.distributed import distributed_c10d

        abort = getattr(distributed_c10d, "_abort_process_group", None)
        try:
            # NCCL's in-flight kernels wait on the dead peer; gloo's calls have failed already.
            if abort is not None and dist.get_backend() == "nccl":
                abort()
            else:
                dist.destroy_process_group()
        except Exception:  # a broken group may refuse even this; the process is leaving it
            pass
    _rank, _world_size = 0, 1


@contextmanager
def single_rank() -> Iterator[None]:
    """Build layers as one rank would (the whole model's shapes, e.g. on the meta device to
    enumerate its full tensors); collectives do nothing inside."""
    global _rank, _world_size
    saved = _rank, _world_size
    _rank, _world_size = 0, 1
    try:
        yield
    finally:
        _rank, _world_size = saved


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, in place; `x` itself at one rank."""
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    if _world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def broadcast_(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` into every rank's `x`, in place."""
    if _world_size > 1:
        dist.broadcast(x, src)
    return x


def all_reduce_min(values: list[int], device: torch.device) -> list[int]:
    """The smallest of each value over the ranks (sizes all ranks must agree on)."""
    if _world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]
