"""M-RoPE's rotary layer: [T] positions are three equal rows; the fused kernel's path (the
step's own cos | sin table indexed by token) equals the torch path, in Triton's interpreter
on the CPU in float16."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from pagedserve.models import mrope_rotary
from pagedserve.models.mrope_rotary import MRotaryEmbedding


def _rope(interleaved: bool, dtype: torch.dtype) -> MRotaryEmbedding:
    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]})
    rope = MRotaryEmbedding(config, 16, interleaved=interleaved)
    rope.build_cache(torch.device("cpu"), dtype)
    return rope


def _qk(dtype: torch.dtype, t: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(t, 4, 16, generator=gen).to(dtype),
            torch.randn(t, 2, 16, generator=gen).to(dtype))


@pytest.mark.parametrize("interleaved", [False, True])
def test_flat_positions_are_three_equal_rows(interleaved):
    rope = _rope(interleaved, torch.float32)
    q, k = _qk(torch.float32)
    flat = torch.tensor([0, 3, 4, 9, 10, 11, 40])
    want = rope(flat, q.clone(), k.clone())
    got = rope(flat.expand(3, -1).clone(), q.clone(), k.clone())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_kernel_path_equals_torch_path(monkeypatch, interleaved):
    from pagedserve.models import layer_kernels

    rope = _rope(interleaved, torch.float16)
    q, k = _qk(torch.float16)
    positions = torch.tensor([[0, 1, 2, 2, 2, 5, 6], [0, 1, 2, 3, 4, 5, 6], [0, 1, 3, 2, 4, 5, 6]])
    want = rope(positions, q.clone(), k.clone())
    monkeypatch.setattr(mrope_rotary, "fused_kernels", lambda x: layer_kernels)
    rope._rows_of = None  # gather the table again
    got = rope(positions, q.clone(), k.clone())
    eps = torch.finfo(torch.float16).eps
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2 * eps, atol=4 * eps)
