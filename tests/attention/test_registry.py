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
