"""The kernels that emit a projection's input in FP8 (RMSNorm with the residual add, SiLU-and-
mul) against the unfused path: the same rounding to the model dtype, then the same
quantization (our group kernel, so that both run the interpreter's e4m3 cast)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.models.layers import RMSNorm
from pagedserve.quantization.ops.fp8_block_gemm import quantize_per_token_group
from pagedserve.quantization.ops.fp8_fused import rms_norm_fp8, silu_and_mul_fp8


def _same(act, ref: torch.Tensor, group: int, exact: bool = True) -> None:
    """Bit for bit; or, where float32 sums differ in order (the norm's sum of squares), the
    scales to float32 rounding and the codes but for values on a rounding boundary."""
    q, s = quantize_per_token_group(ref, group)
    if exact:
        assert torch.equal(act.scale, s)
        assert torch.equal(act.q.float(), q.float())
        return
    torch.testing.assert_close(act.scale, s, rtol=1e-5, atol=0)
    assert (act.q.float() != q.float()).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [None, 32])
def test_rms_norm_fp8_equals_norm_then_quantize(dtype, group):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64))
    x, residual = (torch.randn(5, 64) * 3).to(dtype), torch.randn(5, 64).to(dtype)
    want, want_residual = norm(x, residual.clone())
    got_residual = residual.clone()
    act = rms_norm_fp8(x, got_residual, norm.weight, norm.eps, group)
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)
    exact = dtype != torch.float32  # 16 bits round the norm's last-bit differences away
    _same(act, want.float(), group or 64, exact)
    assert act.group == (group or 64) and act.dtype == dtype
    _same(rms_norm_fp8(x, None, norm.weight, norm.eps, group), norm(x).float(), group or 64,
          exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [None, 32])
def test_silu_and_mul_fp8_equals_silu_and_mul_then_quantize(dtype, group):
    torch.manual_seed(1)
    x = (torch.randn(4, 2 * 96) * 2).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = (F.silu(gate.float()).to(dtype) * up).float()
    act = silu_and_mul_fp8(x, group)
    # Per token: 96 columns are one group of the reference's 128.
    _same(act, want, group or 128)
    assert act.group == (group or 96)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [4096, 7168, 14336])
@pytest.mark.parametrize("group", [None, 128])
def test_gpu_fused_fp8_inputs(width, group):
    torch.manual_seed(0)
    x = torch.randn(257, width, device="cuda", dtype=torch.bfloat16)
    norm = RMSNorm(width, 1e-6).cuda().bfloat16()
    reference_group = group or triton_width(width)
    _same(rms_norm_fp8(x, None, norm.weight, norm.eps, group), norm(x).float(),
          reference_group, exact=False)
    gate_up = torch.randn(257, 2 * width, device="cuda", dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    want = (F.silu(gate.float()).bfloat16() * up).float()
    _same(silu_and_mul_fp8(gate_up, group), want, reference_group, exact=False)


def triton_width(width: int) -> int:
    """The per-token reference: one group as wide as the row, padded to a power of two."""
    return 1 << (width - 1).bit_length()
