"""The fused decoder-layer kernels (models/layer_kernels.py) against the torch path they replace:
on the CPU in the Triton interpreter (float32 and float16; the interpreter's bf16 is broken) and
on CUDA in bf16, where the model uses them."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedserve.models import layer_kernels as lk
from pagedserve.models.layers import RMSNorm, RotaryEmbedding, _rotate, fused_kernels

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (the norm's float32 sum runs in another
    order); in 16 bits, where that order rarely shows, most elements are bit-identical."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=1e-6)
    if want.dtype != torch.float32:
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_and_fused_add(device):
    for dtype in _dtypes(device):
        gen = torch.Generator().manual_seed(0)
        n = 576  # not a power of two
        x = (torch.randn(7, n, generator=gen) * 3).to(dtype).to(device)
        res = torch.randn(7, n, generator=gen).to(dtype).to(device)
        norm = RMSNorm(n, 1e-5).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(n, generator=gen) + 0.5)
        norm.requires_grad_(False)
        _close(lk.rms_norm(x, norm.weight, 1e-5), norm._norm(x))
        want_sum = x + res
        want = norm._norm(want_sum)
        got, got_sum = lk.fused_add_rms_norm(x, res.clone(), norm.weight, 1e-5)
        assert torch.equal(got_sum, want_sum)
        _close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_in_place_on_strided_views(device):
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rope_theta=10000.0)
    for dtype in _dtypes(device):
        rope = RotaryEmbedding(cfg, 16)
        rope.build_cache(torch.device(device), dtype)
        gen = torch.Generator().manual_seed(1)
        t = 9
        qkv = torch.randn(t, 4 * 16 + 2 * 2 * 16, generator=gen).to(dtype).to(device)
        q, k, v = qkv.split([64, 32, 32], dim=-1)
        q, k = q.view(t, 4, 16), k.view(t, 2, 16)
        positions = torch.tensor([0, 5, 6, 7, 100, 127, 1, 2, 3], device=device)
        cos, sin = rope.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        v_before = v.clone()
        lk.rotary_embedding_(positions, q, k, rope.cos_sin_cache)
        # Within one rounding step: on the H200 some fp16 elements differed by an ulp (the
        # compiler may keep a product in float32 across a rounding the source asks for).
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(q, want_q, rtol=2 * eps, atol=4 * eps)
        torch.testing.assert_close(k, want_k, rtol=2 * eps, atol=4 * eps)
        assert torch.equal(v, v_before)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul(device):
    for dtype in _dtypes(device):
        gen = torch.Generator().manual_seed(2)
        x = (torch.randn(5, 2 * 1536, generator=gen) * 4).to(dtype).to(device)
        gate, up = x.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        _close(lk.silu_and_mul(x), want)


def test_fused_path_only_for_16_bit_cuda():
    assert not _fused(torch.zeros(2, dtype=torch.float16))
    if torch.cuda.is_available():
        assert _fused(torch.zeros(2, dtype=torch.bfloat16, device="cuda"))
        assert not _fused(torch.zeros(2, device="cuda"))


def _fused(x: torch.Tensor) -> bool:
    return fused_kernels(x) is not None
