"""The FP8 kernels against a float32 reference of the dequantized product: the Triton
per-token-group quantization and block-scaled GEMM in the interpreter on the CPU (small shapes;
float32 and float16 inputs, the interpreter's bf16 being broken), `torch._scaled_mm` through
its CPU path, the kernel each layer layout picks, and a fused layer's parts' scales laid out
for them. The `gpu` tests run the same on CUDA over the real projection shapes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.models.parallel import QKVParallelLinear
from pagedserve.quantization import fp8 as fp8_method
from pagedserve.quantization import fp8_linear
from pagedserve.quantization.fp8_format import Fp8Scheme
from pagedserve.quantization.ops.fp8_block_gemm import (
    block_scaled_mm,
    fp8_block_linear,
    quantize_per_token_group,
)
from tests.quantization import fp8_writer as w

E4M3 = torch.float8_e4m3fn


def _group_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    groups = math.ceil(k / group)
    padded = torch.zeros(m, groups * group)
    padded[:, :k] = x.float()
    scale = (padded.view(m, groups, group).abs().amax(-1) / 448.0).clamp_min(1e-10)
    q = (padded.view(m, groups, group) / scale[..., None]).clamp(-448, 448).to(E4M3)
    return q.view(m, -1)[:, :k], scale


def _dequant_rows(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(group, 1)[:, :q.shape[1]]


def _representable(m: int, k: int, group: int, seed: int = 0) -> torch.Tensor:
    """Activations whose groups quantize without rounding: e4m3 values, each group's largest
    at +-448, times a power of two. The interpreter's float -> e4m3 cast rounds a value just
    below a power of two down a whole binade (124.3 -> 64); the GPU's does not, and the `gpu`
    tests cover rounding. Here the kernels' scales, groups, masks and sums are what is tested."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=g) * 100).clamp(-440, 440).to(E4M3).float()
    codes[:, ::group] = 448.0 * torch.sign(torch.randn(m, len(range(0, k, group)), generator=g))
    exponents = torch.randint(-12, -2, (m, math.ceil(k / group)), generator=g).float()
    return codes * torch.exp2(exponents).repeat_interleave(group, 1)[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_group_quantization(dtype):
    x = _representable(5, 200, 64).to(dtype)
    x[2] = 0  # an all-zero token keeps a finite scale
    q, s = quantize_per_token_group(x, 64)
    ref_q, ref_s = _group_reference(x, 64)
    torch.testing.assert_close(s, ref_s, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), ref_q.float())


@pytest.mark.parametrize("m,n,k,block", [(1, 96, 128, (128, 128)), (7, 160, 192, (128, 64)),
                                         (33, 80, 200, (48, 32))])
def test_block_scaled_gemm_equals_the_dequantized_product(m, n, k, block):
    """Partial blocks at both edges; rows past one tile."""
    torch.manual_seed(m)
    codes, scale, deq = w.quantize(torch.randn(n, k), "block", block)
    x = _representable(m, k, block[1], seed=m)
    q, s = quantize_per_token_group(x, block[1])
    got = block_scaled_mm(q, s, codes, scale, block, torch.float32)
    want = _dequant_rows(q, s, block[1]) @ deq.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # The whole layer (quantize, GEMM, round to x's dtype) against the float product.
    torch.testing.assert_close(fp8_block_linear(x, codes, scale, block), x @ deq.T,
                               rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    half = fp8_block_linear(x.half(), codes, scale, block)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_scaled_mm_rowwise_with_static_and_dynamic_activations():
    torch.manual_seed(0)
    codes, scale, deq = w.quantize(torch.randn(48, 64), "channel")
    x, bias = torch.randn(5, 64), torch.randn(48)
    dynamic = fp8_linear.scaled_mm_linear(x, codes, scale.reshape(-1), None, bias)
    q, qs = fp8_linear.quantize_per_token(x, None)
    torch.testing.assert_close(dynamic, (q.float() * qs) @ deq.T + bias, rtol=1e-5, atol=1e-4)
    static = fp8_linear.scaled_mm_linear(x, codes, scale.reshape(-1), torch.tensor(0.02), bias)
    xq = (x / 0.02).clamp(-448, 448).to(E4M3).float() * 0.02
    torch.testing.assert_close(static, xq @ deq.T + bias, rtol=1e-5, atol=1e-4)


def _qkv_layer(scheme: Fp8Scheme, per_part) -> QKVParallelLinear:
    """A q/k/v layer (64 in; q 64, k and v 32 rows) loaded part by part with its own scales."""
    layer = QKVParallelLinear(64, 16, 4, 2)
    layer.prefix = "qkv"
    method = fp8_method.Fp8LinearMethod(scheme)
    method.create_weights(layer, torch.float32)
    layer.weight.data = torch.empty(layer.weight.shape, dtype=E4M3)
    layer.quant_method = method
    for shard, rows, (codes, scale) in per_part:
        method.load(layer, "weight", codes, shard, rows)
        method.load(layer, scheme.scale_name, scale, shard, rows)
    method.process_after_loading(layer)
    return layer


@pytest.mark.parametrize("kind,block,kernel", [("tensor", None, "scaled_mm"),
                                               ("channel", None, "scaled_mm"),
                                               ("block", (32, 32), "triton_block"),
                                               ("block", (48, 32), "triton_block"),
                                               ("block", (24, 40), "dequantized")])
def test_fused_parts_scales_laid_out_for_the_kernel(monkeypatch, kind, block, kernel):
    """Each part keeps its own scale: tensor scales become rows, aligned blocks concatenate,
    parts inside one block row are re-quantized whole (48-row blocks over 64 + 32 + 32), and a
    block the kernel cannot step through is dequantized."""
    monkeypatch.setattr(fp8_linear, "KERNELS_ON_CPU", True)
    torch.manual_seed(1)
    name = "weight_scale_inv" if kind == "block" else "weight_scale"
    scheme = Fp8Scheme(kind, "dynamic", block, name)
    parts, deq = [], []
    for shard, rows in (("q", (0, 64)), ("k", (64, 32)), ("v", (96, 32))):
        codes, scale, d = w.quantize(torch.randn(rows[1], 64) * (1 + rows[0] / 32), kind, block)
        parts.append((shard, rows, (codes, scale)))
        deq.append(d)
    layer = _qkv_layer(scheme, parts)
    assert layer.fp8_kernel == kernel
    x = _representable(3, 64, 32)  # FP8 activations equal to x: the weights' error alone
    want = x @ torch.cat(deq).T
    got = layer(x)
    # Exact but for the sums' order; re-quantized parts carry one more FP8 rounding.
    requantized = block == (48, 32)
    tolerance = 0.05 if requantized else 1e-5
    assert float((got - want).norm() / want.norm()) < tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 128, 1024, 8192])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (576, 7168), (24576, 1536)])
def test_gpu_kernels_against_the_dequantized_product(m, n, k):
    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda") * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    codes, scale, deq = (t.cuda() for t in w.quantize(weight.cpu(), "block", (128, 128)))
    q, s = quantize_per_token_group(x, 128)
    got = block_scaled_mm(q, s, codes, scale, (128, 128), torch.float32)
    want = _dequant_rows(q, s, 128) @ deq.T
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    codes, scale, deq = (t.cuda() for t in w.quantize(weight.cpu(), "channel"))
    got = fp8_linear.scaled_mm_linear(x, codes, scale.reshape(-1), None, None).float()
    q, qs = fp8_linear.quantize_per_token(x, None)
    want = (q.float() * qs) @ deq.T
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
