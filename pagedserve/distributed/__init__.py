"""Tensor parallelism's process group and collectives: thin wrappers over torch.distributed
(NCCL on CUDA, gloo on the CPU) that do nothing when the group has one rank, so the
single-device path pays for none of it."""

from pagedserve.distributed.parallel_state import (
    all_gather,
    all_reduce,
    all_reduce_min,
    broadcast_,
    destroy_distributed,
    free_port_init_method,
    init_distributed,
    tp_rank,
    tp_world_size,
)

__all__ = ["all_gather", "all_reduce", "all_reduce_min", "broadcast_", "destroy_distributed",
           "free_port_init_method", "init_distributed", "tp_rank", "tp_world_size"]
