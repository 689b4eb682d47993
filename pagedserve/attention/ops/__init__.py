"""Triton and CUDA kernels of the attention and state backends (imported lazily by them)."""

from __future__ import annotations

import torch

from pagedserve import envs


def state_kernels_enabled(device: torch.device) -> bool:
    """Whether state layers run their Triton kernels: on CUDA with triton installed, unless
    PAGEDSERVE_STATE_KERNELS=torch asks for the reference ops."""
    if device.type != "cuda" or envs.PAGEDSERVE_STATE_KERNELS == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
