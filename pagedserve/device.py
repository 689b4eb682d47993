"""Host-to-device copies that never wait for the device's queued work."""

from __future__ import annotations

import numpy as np
import torch


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: a copy from pageable memory
    would first wait for the work already queued (with async scheduling, the step in
    flight). Pinned memory comes from torch's caching host allocator, which keeps the block
    until the copy has read it, so the host may refill its own buffer at once."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def array_to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A numpy array (an index list, a step's small metadata) on `device`, as
    `to_device_async`: a step's path never waits for the device to copy one."""
    return to_device_async(torch.from_numpy(np.ascontiguousarray(a)), device)
