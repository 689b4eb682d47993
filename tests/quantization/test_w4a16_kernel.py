"""The W4A16 Triton GEMM (4- and 8-bit codes) against the float32 product of the dequantized
weight: in the interpreter on the CPU (small shapes, float32 and float16 inputs; the
interpreter's bf16 is broken), the kernel layout against each format's own dequantization, and
`gpu` tests over the projection shapes of an 8B model, M = 1 to 8,192."""

from __future__ import annotations

import pytest
import torch

from pagedserve.quantization.int_codes import IntCodes
from pagedserve.quantization.ops import w4a16_gemm as gemm
from pagedserve.quantization.ops.w4a16_gemm import w4a16_layout, w4a16_linear, w4a16_mm


def _codes(n: int, k: int, group_size: int, act_order: bool, seed: int = 0,
           device: str = "cpu", bits: int = 4) -> IntCodes:
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    group = torch.arange(k) // group_size
    if act_order:
        group = group[torch.randperm(k, generator=g)]
    top = 1 << bits  # zeros up to 2^bits: GPTQ v1's stored maximum plus one
    c = IntCodes(torch.randint(0, top, (n, k), generator=g, dtype=torch.int32),
                  torch.randint(0, top + 1, (n, groups), generator=g, dtype=torch.int32),
                  (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).to(torch.float16),
                  group, bits)
    return IntCodes(*(t.to(device) for t in (c.codes, c.zeros, c.scales, c.group)), bits)


# (n, k, group size, act-order): K not a multiple of 8 or of the tile, groups of 32 / 64 /
# per channel, act-order's scattered groups.
SHAPES = [(48, 96, 32, False), (40, 100, 50, True), (64, 128, 64, True), (24, 72, 72, False),
          (16, 98, 98, False)]  # K = 98: padded to whole words at 8 bits too


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group,act_order", SHAPES)
def test_layout_dequantizes_as_the_format_does(n, k, group, act_order, bits):
    c = _codes(n, k, group, act_order, bits=bits)
    weight = w4a16_layout(c.codes, c.zeros, c.scales, c.group, bits)
    assert weight.qweight.shape == (-(-k // (32 // bits)), n)
    assert torch.equal(weight.dequantize(torch.float32), c.dequantize())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n,k,group,act_order", SHAPES)
def test_interpreted_kernel_against_the_dequantized_product(m, n, k, group, act_order, dtype,
                                                            bits):
    c = _codes(n, k, group, act_order, seed=m, bits=bits)
    weight = w4a16_layout(c.codes, c.zeros, c.scales, c.group, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = w4a16_mm(x, weight)
    # The kernel rounds each dequantized value to x's dtype and sums in float32.
    want = x.float() @ c.dequantize().to(dtype).float().T
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,split_k", [(1, 3), (3, 2), (20, 4)])
def test_split_k_and_one_group_tiles(m, split_k, bits):
    """Act-order groups of 128 put in order (one scale row a tile) and K cut into slices whose
    partial sums are added atomically, at one row and in the dot path."""
    c = _codes(40, 512, 128, True, seed=3, bits=bits)
    weight = w4a16_layout(c.codes, c.zeros, c.scales, c.group, bits)
    assert weight.perm is not None and weight.group_size == 128
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(2))
    tiles = gemm.Tiles(1 if m == 1 else 16, 32, 128, 1, 1, 1, split_k)
    want = x @ c.dequantize().T
    torch.testing.assert_close(w4a16_mm(x, weight, tiles), want, rtol=1e-5,
                               atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("n,k,group,act_order", SHAPES + [(40, 512, 128, True)])
def test_one_row_gemv_in_the_words_shape(n, k, group, act_order, split_k, bits):
    """`_w4a16_gemv_kernel` (tiles' gemv), a program per row: equal to the float32 product
    where groups are whole words, and the default path's where they are not (group 50)."""
    c = _codes(n, k, group, act_order, seed=7, bits=bits)
    weight = w4a16_layout(c.codes, c.zeros, c.scales, c.group, bits)
    assert weight.whole_word_groups == (group % (32 // bits) == 0 or k == group)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(8))
    tiles = gemm.Tiles(1, 32, 64, 1, 1, 1, split_k, gemv=True)
    want = x @ c.dequantize().T
    torch.testing.assert_close(w4a16_mm(x, weight, tiles), want, rtol=1e-5,
                               atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group,act_order", SHAPES + [(40, 512, 128, True)])
def test_field_dots_against_the_dequantized_product(n, k, group, act_order, bits):
    """`_w4a16_field_dots_kernel` (tiles' field_dots): a dot per bit-field, float32 and
    float16 inputs, K in two slices where it has two tiles."""
    c = _codes(n, k, group, act_order, seed=9, bits=bits)
    weight = w4a16_layout(c.codes, c.zeros, c.scales, c.group, bits)
    tiles = gemm.Tiles(16, 32, 16 * (32 // bits), 1, 1, 1, 2, field_dots=True)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x = torch.randn(20, k, generator=torch.Generator().manual_seed(10)).to(dtype)
        want = x.float() @ c.dequantize().to(dtype).float().T
        got = w4a16_mm(x, weight, tiles).float()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("start", [37, 32])
def test_a_slice_of_k_that_starts_inside_a_group(start):
    """A tensor-parallel rank's inputs from `start` on, in groups of 64: the first group is
    short, the layout says by how much, and the kernel and the dequantized weight read it so
    (each position's scale read, at 37; at 32, tiles of 32 positions each in one group)."""
    full = _codes(24, start + 192, 64, False, seed=5)
    c = IntCodes(full.codes[:, start:], full.zeros, full.scales, full.group[start:], 4)
    weight = w4a16_layout(c.codes, c.zeros, c.scales, c.group)
    assert (weight.group_size, weight.group_offset) == (64, start)
    assert weight.tile_groups(32) == (0 if start % 32 else 1)
    assert torch.equal(weight.dequantize(torch.float32), c.dequantize())
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(4))
    want = x @ c.dequantize().T
    torch.testing.assert_close(w4a16_mm(x, weight), want, rtol=1e-5,
                               atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("offsets", [False, True])
def test_symmetric_zeros_are_one_row_and_offsets_add(offsets):
    """Symmetric codes (every zero 8) keep one row of zeros, read with stride 0; the offset
    form (GGUF's K types: w = code * scale + offset) reads float offsets per group."""
    c = _codes(40, 256, 32, False, seed=6)
    zeros = torch.randn(40, 8) * 0.01 if offsets else torch.full((40, 8), 8)
    weight = w4a16_layout(c.codes, zeros, c.scales, c.group, offsets=offsets)
    assert weight.zeros.shape[0] == (8 if offsets else 1)
    g = c.group
    scales = c.scales.float()[:, g]
    want_w = c.codes * scales + zeros[:, g] if offsets else (c.codes - 8) * scales
    assert torch.equal(weight.dequantize(torch.float32), want_w)
    for m in (1, 3):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        want = x @ want_w.T
        torch.testing.assert_close(w4a16_mm(x, weight), want, rtol=1e-5,
                                   atol=1e-5 * float(want.abs().max()))


def test_groups_of_different_sizes_are_refused():
    c = _codes(16, 96, 32, False)
    uneven = torch.tensor([0] * 32 + [1] * 10 + [2] * 22)
    with pytest.raises(ValueError, match="input groups are not of one size"):
        w4a16_layout(c.codes, c.zeros, c.scales[:, :3], uneven)


def test_linear_adds_the_bias_and_keeps_leading_dims(monkeypatch):
    c = _codes(48, 96, 32, False)
    weight = w4a16_layout(c.codes, c.zeros, c.scales, c.group)
    x = torch.randn(2, 3, 96)
    bias = torch.randn(48)
    want = x @ c.dequantize().T + bias
    torch.testing.assert_close(w4a16_linear(x, weight, bias), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(gemm, "DEQUANTIZE_ABOVE_M", 4)  # 6 rows: the dense path
    torch.testing.assert_close(w4a16_linear(x, weight, bias), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="input has 95 features; the 4-bit weight takes 96"):
        w4a16_mm(x[0, :, :95], weight)
    with pytest.raises(ValueError, match="reads 4- or 8-bit codes, not 3-bit"):
        w4a16_layout(c.codes, c.zeros, c.scales, c.group, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 1024, 8192])
@pytest.mark.parametrize("n,k,group,act_order", [(6144, 4096, 128, False),
                                                 (4096, 4096, 128, True),
                                                 (28672, 4096, 128, False),
                                                 (4096, 14336, 128, False),
                                                 (4096, 4096, 32, False)])
def test_gpu_kernel_against_the_dequantized_product(m, n, k, group, act_order, bits):
    c = _codes(n, k, group, act_order, device="cuda", bits=bits)
    weight = w4a16_layout(c.codes, c.zeros, c.scales, c.group, bits)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = w4a16_mm(x, weight).float()
    want = x.float() @ c.dequantize().to(torch.bfloat16).float().T
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
