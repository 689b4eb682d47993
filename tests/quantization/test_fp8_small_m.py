"""The small-M FP8 linear (`ops/fp8_small_m.py`) and the per-token quantization kernel
(`ops/fp8_token_quant.py`) against float32 references: in the interpreter on the CPU (small
shapes, N and K not multiples of the tiles or blocks; float32 and float16 x, the interpreter's
bf16 being broken), and the linear method's routing of small M to it. The `gpu` tests run the
same over the 8B projection shapes in bf16."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagedserve.quantization import fp8_linear
from pagedserve.quantization.fp8_format import Fp8Scheme
from pagedserve.quantization.ops import fp8_small_m
from pagedserve.quantization.ops.fp8_block_gemm import quantize_per_token_group
from pagedserve.quantization.ops.fp8_fused import Fp8Activation
from pagedserve.quantization.ops.fp8_small_m import SMALL_M_MAX, SmallMTiles, small_m_linear
from pagedserve.quantization.ops.fp8_token_quant import quantize_per_token_triton
from tests.quantization import fp8_writer as w

E4M3 = torch.float8_e4m3fn
N, K = 80, 200  # 2.5 N tiles of 32, 6.25 K steps of 32; partial 48 x 32 and 32 x 64 blocks
NO_SPLIT = SmallMTiles(32, 32, 1, 1, 1)
SPLIT = SmallMTiles(32, 32, 3, 1, 1)  # 7 K steps in splits of 3, 3, 1


def _weight(kind: str, block: tuple[int, int] | None, seed: int = 0):
    torch.manual_seed(seed)
    codes, scale, deq = w.quantize(torch.randn(N, K), kind, block)
    return codes, (scale.reshape(-1) if kind == "channel" else scale), deq


def _fp8_x(m: int, group: int | None, seed: int = 1):
    """Codes and scales as a fused producer emits them; their float32 value."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, K, generator=g) * 100).clamp(-448, 448).to(E4M3)
    groups = 1 if group is None else math.ceil(K / group)
    scale = torch.rand(m, groups, generator=g) * 0.01 + 1e-3
    width = K if group is None else group
    return codes, scale, codes.float() * scale.repeat_interleave(width, 1)[:, :K]


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    torch.testing.assert_close(got.float(), want, rtol=rel, atol=rel * float(want.abs().max()))


# Rows against split-K on and off (one row tile either way).
ROWS_TILES = pytest.mark.parametrize("m,tiles", [(1, NO_SPLIT), (3, SPLIT), (16, NO_SPLIT),
                                                 (16, SPLIT)], ids=["1", "3-split", "16",
                                                                    "16-split"])


@ROWS_TILES
@pytest.mark.parametrize("kind,block", [("channel", None), ("block", (48, 32)),
                                        ("block", (32, 64))])
def test_float_x_against_the_dequantized_product(m, kind, block, tiles):
    codes, scale, deq = _weight(kind, block)
    x = torch.randn(m, K)
    bias = torch.randn(N) if m != 3 else None
    want = x @ deq.T + (0 if bias is None else bias)
    got = small_m_linear(x, codes, scale, bias, block=block, tiles=tiles)
    assert got.dtype == torch.float32 and got.shape == (m, N)
    _close(got, want, 1e-5)
    # 16-bit x: the product of the rounded x, rounded once to fp16.
    half = small_m_linear(x.half(), codes, scale, bias, block=block, tiles=tiles)
    assert half.dtype == torch.float16
    _close(half, x.half().float() @ deq.T + (0 if bias is None else bias), 1e-3)


@ROWS_TILES
@pytest.mark.parametrize("kind,block,group", [("channel", None, None), ("block", (48, 32), 32),
                                              ("block", (32, 64), 64), ("block", (48, 32), None),
                                              ("channel", None, 32)])
def test_fp8_x_against_the_dequantized_product(m, kind, block, group, tiles):
    """Per-row and per-group activation scales with either weight layout."""
    codes, scale, deq = _weight(kind, block)
    q, qs, xf = _fp8_x(m, group, seed=m)
    bias = torch.randn(N)
    got = small_m_linear(q, codes, scale, bias, block=block, x_scale=qs, x_group=group,
                         out_dtype=torch.float32, tiles=tiles)
    _close(got, xf @ deq.T + bias, 1e-5)
    inferred = small_m_linear(q, codes, scale, bias, block=block, x_scale=qs,
                              out_dtype=torch.float16, tiles=tiles)
    _close(inferred, xf @ deq.T + bias, 1e-3)


def test_refuses_what_it_cannot_step_through():
    codes, scale, _ = _weight("block", (48, 32))
    with pytest.raises(ValueError, match="at most"):
        small_m_linear(torch.randn(SMALL_M_MAX + 1, K), codes, scale, block=(48, 32))
    with pytest.raises(ValueError, match="powers of two"):
        small_m_linear(torch.randn(2, K), codes, torch.ones(2, 5), block=(48, 40))
    q, qs, _ = _fp8_x(2, 32)
    with pytest.raises(ValueError, match="output dtype"):
        small_m_linear(q, codes, scale, block=(48, 32), x_scale=qs)


def _representable_rows(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of e4m3 values, each with a +-448 element, times a power of two."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=g) * 100).clamp(-440, 440).to(E4M3).float()
    codes[:, 7] = 448.0 * torch.sign(torch.randn(m, generator=g))
    return codes * torch.exp2(torch.randint(-12, 4, (m, 1), generator=g).float())


@pytest.mark.parametrize("k", [40, 3000])  # one chunk; two chunks, the second partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_quantization_equals_the_torch_function(k, dtype):
    """Random rows (rounding: ties, subnormals, values just below a power of two) and exact
    ones, per row and by a static scale. As values: the interpreter's cast drops the sign of
    a zero (-0 codes as +0); the `gpu` test compares the bits."""
    g = torch.Generator().manual_seed(k)
    x = torch.cat([torch.randn(3, k, generator=g) * torch.tensor([[1e-3], [1.0], [30.0]]),
                   _representable_rows(2, k), torch.zeros(1, k)]).to(dtype)
    x[0, :5] = torch.tensor([124.3, 100.0, -3.3, 1e-7, 0.013]) * 1e-3 / 448
    for static in (None, torch.tensor(2.0 ** -5), torch.tensor(0.0123)):
        q, s = quantize_per_token_triton(x, static)
        ref_q, ref_s = fp8_linear.quantize_per_token_reference(x, static)
        assert s.shape == ref_s.shape == (6, 1) and s.dtype == ref_s.dtype == torch.float32
        assert torch.equal(s, ref_s)
        assert torch.equal(q.float(), ref_q.float())


def _layer(kind: str, block: tuple[int, int] | None):
    codes, scale, deq = _weight(kind, block, seed=3)
    scheme = Fp8Scheme(kind, "dynamic", block, "weight_scale_inv" if block else "weight_scale")
    layer = SimpleNamespace(weight=codes, weight_scale=scale, fp8_scheme=scheme,
                            input_scale=None, in_features=K, prefix="layer",
                            fp8_kernel=fp8_linear.TRITON_BLOCK if block else
                            fp8_linear.SCALED_MM)
    return layer, deq


@pytest.mark.parametrize("kind,block", [("channel", None), ("block", (48, 32))])
def test_the_linear_method_routes_small_m_to_the_kernel(monkeypatch, kind, block):
    monkeypatch.setattr(fp8_linear, "KERNELS_ON_CPU", True)
    calls = []
    real = fp8_small_m.small_m_linear

    def spy(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fp8_small_m, "small_m_linear", spy)
    layer, deq = _layer(kind, block)
    bias = torch.randn(N)
    x = torch.randn(2, SMALL_M_MAX // 2, K)  # 16 rows in [2, 8, K]
    got = fp8_linear.apply_fp8(layer, x, bias)
    assert calls == [SMALL_M_MAX] and got.shape == (2, SMALL_M_MAX // 2, N)
    _close(got, x @ deq.T + bias, 1e-5)
    group = K if block is None else block[1]
    q, qs, xf = _fp8_x(3, None if block is None else group)
    got = fp8_linear.apply_fp8(layer, Fp8Activation(q, qs, group, torch.float32), bias)
    assert calls == [SMALL_M_MAX, 3]
    _close(got, xf @ deq.T + bias, 1e-5)
    # Past the bound: the prefill kernels (the activation quantized, then the W8A8 GEMM).
    big = _representable_rows(SMALL_M_MAX + 1, K)
    got = fp8_linear.apply_fp8(layer, big, None)
    assert calls == [SMALL_M_MAX, 3]
    assert float((got - big @ deq.T).norm() / (big @ deq.T).norm()) < 0.05


# ---- GPU: the 8B projections ---------------------------------------------------------------

SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_gpu_small_m_against_the_dequantized_product(m, n, k):
    torch.manual_seed(0)
    weight = torch.randn(n, k) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for kind, block in (("channel", None), ("block", (128, 128))):
        codes, scale, deq = (t.cuda() for t in w.quantize(weight, kind, block))
        scale = scale.reshape(-1) if block is None else scale
        want = x.float() @ deq.T + bias.float()
        got = small_m_linear(x, codes, scale, bias, block=block)
        assert got.dtype == torch.bfloat16
        _close(got, want, 1e-2)
        # FP8 x as the fused producers emit it: per token for channel, per 128 for blocks.
        group = 128 if block else None
        q, qs = (fp8_linear.quantize_per_token(x, None) if group is None else
                 quantize_per_token_group(x, group))
        width = k if group is None else group
        xf = q.float() * qs.repeat_interleave(width, 1)[:, :k]
        got = small_m_linear(q, codes, scale, None, block=block, x_scale=qs, x_group=group,
                             out_dtype=torch.float32)
        _close(got, xf @ deq.T, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 4096), (37, 14336), (300, 4096)])
def test_gpu_token_quantization_equals_the_torch_function(m, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    x[0] = 0
    for static in (None, torch.tensor(0.0123, device="cuda")):
        q, s = quantize_per_token_triton(x, static)
        ref_q, ref_s = fp8_linear.quantize_per_token_reference(x, static)
        assert torch.equal(s, ref_s)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
