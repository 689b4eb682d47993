"""The memory profile's baseline (`kv_cache_setup.memory_baseline`): what the process holds on
the device beside this engine's weights. Its weights are found on the engine's device however
it is named ("cuda" is the current device, its tensors say "cuda:0"); on the CPU the counters
are stubbed."""

from __future__ import annotations

import torch

from pagedserve.engine.kv_cache_setup import memory_baseline


class _OnDevice:
    """A tensor's size and device as the baseline reads them (no CUDA tensor on the CPU)."""

    def __init__(self, index: int, numel: int) -> None:
        self.device = torch.device("cuda", index)
        self._numel = numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 4


class _Model:
    def __init__(self, *tensors: _OnDevice) -> None:
        self.tensors = tensors

    def parameters(self):
        return iter(self.tensors[:-1])

    def buffers(self):
        return iter(self.tensors[-1:])


def test_weights_on_the_current_device_are_the_engines_own(monkeypatch):
    weight, cache = _OnDevice(0, 1000), _OnDevice(0, 10)
    other_card = _OnDevice(1, 500)  # (another rank's device: not this one's memory)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * 1010 + 300)
    model = _Model(weight, weight, other_card, cache)  # a tied weight counts once
    assert memory_baseline(model, torch.device("cuda")) == 300
    assert memory_baseline(model, torch.device("cuda:0")) == 300
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * 500 + 7)
    assert memory_baseline(model, torch.device("cuda:1")) == 7
