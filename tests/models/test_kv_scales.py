"""An fp8 KV cache's per-tensor scales read from a checkpoint onto the attention layers."""

import pytest
import torch
from torch import nn

from pagedserve.attention.layer import Attention
from pagedserve.models.checkpoint_loading import _load_kv_scale


def _model() -> nn.Module:
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.attn = Attention(4, 16, 0.25, 2, layer_idx=0)
    model = nn.Module()
    model.layer = layer
    return model


@pytest.mark.parametrize("k_name,v_name", [
    ("layer.self_attn.k_scale", "layer.self_attn.v_scale"),  # FP8 checkpoints
    ("layer.self_attn.k_proj.output_scale", "layer.self_attn.v_proj.output_scale"),  # c-t
])
def test_checkpoint_kv_scales_reach_the_layer(k_name, v_name):
    model = _model()
    modules = dict(model.named_modules())
    _load_kv_scale(modules, k_name, torch.tensor(0.5))
    _load_kv_scale(modules, v_name, torch.tensor([2.0], dtype=torch.bfloat16))
    attn = model.layer.self_attn.attn
    assert (attn.k_scale, attn.v_scale) == (0.5, 2.0)


def test_per_head_kv_scales_are_refused_by_name():
    model = _model()
    with pytest.raises(ValueError, match="k_scale has shape"):
        _load_kv_scale(dict(model.named_modules()), "layer.self_attn.k_scale", torch.ones(2))
