"""Backend selection: refusals name the layers they are about."""

import pytest
import torch

from pagedserve.attention import (
    AttentionLayerConfig,
    BackendSelectionError,
    get_backend_cls,
    select_backend,
)
from pagedserve.attention.registry import _layer_problems

CPU = torch.device("cpu")
FULL = AttentionLayerConfig(8, 2, 64, torch.bfloat16)
# gpt-oss alternates windowed and full layers, all with sinks.
SINK_WINDOW = AttentionLayerConfig(8, 2, 64, torch.bfloat16, sliding_window=128, has_sinks=True)
SINK_FULL = AttentionLayerConfig(8, 2, 64, torch.bfloat16, has_sinks=True)


def test_reasons_name_the_layers_they_hold_for():
    layers = [FULL, SINK_WINDOW, FULL, SINK_WINDOW, FULL, SINK_WINDOW]
    problems = _layer_problems(get_backend_cls("ROCM"), layers, 16, CPU)
    assert problems == ["layers 1, 3, 5: attention sinks not supported"]


def test_runs_of_layers_and_every_layer():
    layers = [SINK_FULL] * 4 + [FULL, FULL, SINK_WINDOW, FULL]
    problems = _layer_problems(get_backend_cls("TURBOQUANT"), layers, 16, CPU)
    assert "layers 0-3, 6: attention sinks not supported" in problems
    everything = _layer_problems(get_backend_cls("ROCM"), [SINK_FULL] * 3, 16, CPU)
    assert everything == ["all 3 layers: attention sinks not supported"]
    assert _layer_problems(get_backend_cls("CPU"), layers, 16, CPU) == []


def test_a_named_backend_that_cannot_run_some_layers_says_which():
    if not get_backend_cls("TRITON").is_available()[0]:
        pytest.skip("TRITON is not available here")
    odd = AttentionLayerConfig(8, 2, 72, torch.float32)
    plain = AttentionLayerConfig(8, 2, 64, torch.float32)
    with pytest.raises(BackendSelectionError) as err:
        select_backend("TRITON", CPU, [plain, odd, plain, odd], 16)
    assert "layers 1, 3: head size 72 not in" in str(err.value)


def test_a_slow_fallback_is_chosen_automatically_only_when_nothing_after_it_can_run(
        monkeypatch):
    """FLASH_ATTN without FlashAttention's kernels runs its torch path (pages gathered every
    step, no CUDA graphs): on CUDA the automatic choice goes on to TRITON, and takes the
    fallback only where TRITON cannot run the layers; named, it is taken as asked."""
    from pagedserve.attention import registry
    from pagedserve.attention.backends import flash_attn

    cuda = torch.device("cuda")
    layers = [AttentionLayerConfig(4, 2, 64, torch.bfloat16)]
    status = {name: (name in ("FLASH_ATTN", "TRITON"), "test") for name in registry._REGISTRY}
    monkeypatch.setattr(registry, "backend_status", lambda: status)
    monkeypatch.setattr(flash_attn, "choose_implementation",
                        lambda: flash_attn.ImplChoice("torch", "torch: test"))
    monkeypatch.setattr(registry, "_layer_problems", lambda cls, *a: [])
    flash = registry.get_backend_cls("FLASH_ATTN")
    assert flash.is_fallback()
    assert select_backend(None, cuda, layers, 16).get_name() == "TRITON"
    assert select_backend("FLASH_ATTN", cuda, layers, 16) is flash
    monkeypatch.setattr(registry, "_layer_problems",
                        lambda cls, *a: ["cannot"] if cls.get_name() == "TRITON" else [])
    assert select_backend(None, cuda, layers, 16) is flash
    # With FlashAttention's own kernels it comes before TRITON, as before.
    monkeypatch.setattr(flash_attn, "choose_implementation",
                        lambda: flash_attn.ImplChoice("fa3", "fa3: test"))
    monkeypatch.setattr(registry, "_layer_problems", lambda cls, *a: [])
    assert not flash.is_fallback()
    assert select_backend(None, cuda, layers, 16) is flash
