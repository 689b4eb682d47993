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


def arrays_to_device(arrays: list[np.ndarray], device: torch.device | str
                     ) -> list[torch.Tensor]:
    """Several int64 arrays on `device` through one staging buffer and one copy (each copy
    costs the host a pinned allocation and a launch): views of it, one per array, each of
    its array's shape."""
    flat = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    # A fresh array: on the CPU nothing on the host shares it, so it is used as it is.
    whole = to_device_async(torch.from_numpy(np.concatenate(flat) if flat
                                             else np.zeros(0, np.int64)), device)
    out, start = [], 0
    for a, f in zip(arrays, flat, strict=True):
        out.append(whole[start:start + f.size].view(np.shape(a)))
        start += f.size
    return out
