"""The 4-bit grouped expert GEMMs (`ops/w4_moe_kernels.py`) in the Triton interpreter against
`moe.torch_experts` on the dequantized weights, float32: MXFP4 with gpt-oss's clamped SwiGLU and
biases, int4 with zero points (symmetric or not, groups or per channel) and SiLU, act-order
experts (a group map per expert, and per gate and up) in float32 and float16 against weights
dequantized here from the integer codes; and the layout's decode against the MXFP4 format's
own dequantizer. `gpu` tests at the gpt-oss and Qwen3-30B-A3B shapes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.moe import ExpertActivation, torch_experts
from pagedserve.quantization.mxfp4 import dequantize_mxfp4
from pagedserve.quantization.ops.w4_moe_kernels import W4Experts, w4_fused_experts

E, H, INTER, TOP_K = 4, 64, 32, 2


def _mxfp4(n: int, k: int, g: torch.Generator) -> W4Experts:
    codes = torch.randint(0, 256, (E, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 126, (E, n, k // 32), generator=g, dtype=torch.uint8)
    scales[0, 0, 0] = 0  # the smallest exponent: a subnormal scale
    return W4Experts(codes, scales, None, 32)


def _int4(n: int, k: int, group: int, symmetric: bool, g: torch.Generator) -> W4Experts:
    codes = torch.randint(0, 256, (E, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(E, n, k // group, generator=g) * 0.02 + 1e-3
    zeros = (torch.full_like(scales, 8) if symmetric else
             torch.randint(0, 17, scales.shape, generator=g).float()).to(torch.uint8)
    return W4Experts(codes, scales, zeros, group)


def _act_order(n: int, k: int, group: int, symmetric: bool, parts: int, g: torch.Generator,
               device: str = "cpu", experts: int = 4) -> tuple[W4Experts, torch.Tensor]:
    """Random codes with a group map per expert and part of the rows (GPTQ's act-order: each
    group's inputs scattered by a permutation), and the float32 weights [E, n, k] they stand
    for, dequantized here from the integer codes."""
    groups = k // group
    small = dict(generator=g, device=device, dtype=torch.int16)  # the Qwen3 shape's memory
    codes = torch.randint(0, 16, (experts, n, k), **small)
    scales = (torch.rand(experts, n, groups, generator=g, device=device) * 0.02 + 1e-3).half()
    zeros = (torch.full_like(scales, 8, dtype=torch.int16) if symmetric else
             torch.randint(0, 17, scales.shape, **small))
    in_order = torch.arange(k, device=device) // group
    g_idx = torch.stack([torch.stack([in_order[torch.randperm(k, generator=g, device=device)]
                                      for _ in range(parts)]) for _ in range(experts)])
    per_row = g_idx.repeat_interleave(n // parts, dim=1)  # [E, n, k]
    want = (codes - zeros.gather(-1, per_row)).float() * scales.float().gather(-1, per_row)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return W4Experts(packed, scales.float(), zeros.to(torch.uint8), 0,
                     g_idx.to(torch.int32)), want


# (group, hidden, intermediate, maps per expert's gate_up): groups of 32 with gate and up
# apart, of 128 with them shared (GPTQ's, whose gate and up read one input).
ACT_ORDER = [
    pytest.param(group, hidden, inter, parts, sym, dt,
                 marks=[pytest.mark.slow] if group == 128 and sym else [],
                 id=f"g{group}-{'sym' if sym else 'asym'}-{str(dt)[6:]}")
    for group, hidden, inter, parts in ((32, 128, 64, 2), (128, 256, 256, 1))
    for sym in (True, False) for dt in (torch.float32, torch.float16)]


@pytest.mark.parametrize("group,hidden,inter,parts,symmetric,dtype", ACT_ORDER)
def test_act_order_experts(group, hidden, inter, parts, symmetric, dtype):
    """Each expert its own map (gate and up each theirs where parts is 2); the float32 product
    of the dequantized weights, the activations and weights rounded to `dtype` as the kernel
    rounds them."""
    g = torch.Generator().manual_seed(group + parts)
    gate_up, w_gate_up = _act_order(2 * inter, hidden, group, symmetric, parts, g)
    down, w_down = _act_order(hidden, inter, group, symmetric, 1, g)
    assert torch.equal(gate_up.dequantize(), w_gate_up)
    t = 17
    x = torch.randn(t, hidden, generator=g).to(dtype)
    weights, ids = _route(t, g)
    got = w4_fused_experts(x, gate_up, down, weights, ids)
    assert got.dtype == dtype
    want = torch_experts(x.float(), w_gate_up.to(dtype).float(), w_down.to(dtype).float(),
                         weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_a_map_of_the_wrong_shape_is_refused():
    g = torch.Generator().manual_seed(0)
    gate_up, _ = _act_order(2 * INTER, H, 32, True, 1, g)
    down, _ = _act_order(H, INTER, 32, True, 2, g)  # down has one part
    with pytest.raises(ValueError, match=r"need g_idx int32 \[4, 1, 32\]"):
        w4_fused_experts(torch.randn(2, H), gate_up, down, *_route(2, g))


def _route(t: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(t)])
    return torch.rand(t, TOP_K, generator=g), ids


def test_mxfp4_layout_decodes_as_the_format_does():
    w = _mxfp4(8, 64, torch.Generator().manual_seed(0))
    blocks = w.codes.view(E * 8, 2, 16)
    want = dequantize_mxfp4(blocks, w.scales.view(E * 8, 2), "w").view(E, 8, 64)
    assert torch.equal(w.dequantize(), want)


@pytest.mark.parametrize("t", [1, 3, 17])
def test_mxfp4_experts_with_clamped_swiglu_and_biases(t):
    g = torch.Generator().manual_seed(t)
    gate_up, down = _mxfp4(2 * INTER, H, g), _mxfp4(H, INTER, g)
    gb, db = torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g)
    x = torch.randn(t, H, generator=g) * 0.05
    weights, ids = _route(t, g)
    swiglu = ExpertActivation("swiglu_clamped")
    got = w4_fused_experts(x, gate_up, down, weights, ids, swiglu, gb, db)
    want = torch_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids, swiglu,
                         gb, db)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("group,symmetric", [(16, False), (32, True), (None, False)])
@pytest.mark.parametrize("t", [1, 17])
def test_int4_experts_with_silu(t, group, symmetric):
    g = torch.Generator().manual_seed(t)
    gate_up = _int4(2 * INTER, H, group or H, symmetric, g)  # None: per channel
    down = _int4(H, INTER, group or INTER, symmetric, g)
    x = torch.randn(t, H, generator=g)
    weights, ids = _route(t, g)
    got = w4_fused_experts(x, gate_up, down, weights, ids)
    want = torch_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_shapes_that_do_not_fit_are_refused():
    g = torch.Generator().manual_seed(0)
    gate_up, down = _int4(2 * INTER, H, 16, True, g), _int4(H, INTER, 16, True, g)
    x, (weights, ids) = torch.randn(2, H), _route(2, g)
    with pytest.raises(ValueError, match="4-bit expert shapes do not fit"):
        w4_fused_experts(torch.randn(2, H + 2), gate_up, down, weights, ids)
    bad = W4Experts(down.codes, down.scales, down.zeros, 12)
    with pytest.raises(ValueError, match="in groups of 12"):
        w4_fused_experts(x, gate_up, bad, weights, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 1024])
@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_gpu_experts_of_the_gpt_oss_20b_shape(fmt, t):
    """32 experts, top 4, hidden and intermediate 2,880, bf16 activations."""
    e, h, i, k = 32, 2880, 2880, 4
    g = torch.Generator(device="cuda").manual_seed(0)

    def experts(n: int, kk: int) -> W4Experts:
        codes = torch.randint(0, 256, (e, n, kk // 2), generator=g, dtype=torch.uint8,
                              device="cuda")
        if fmt == "mxfp4":
            return W4Experts(codes, torch.randint(118, 126, (e, n, kk // 32), generator=g,
                                                  dtype=torch.uint8, device="cuda"), None, 32)
        scales = torch.rand(e, n, kk // 32, generator=g, device="cuda") * 0.002
        return W4Experts(codes, scales, torch.full_like(scales, 8).to(torch.uint8), 32)

    gate_up, down = experts(2 * i, h), experts(h, i)
    x = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16) * 0.05
    ids = torch.stack([torch.randperm(e, generator=g, device="cuda")[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g, device="cuda")
    act = ExpertActivation("swiglu_clamped" if fmt == "mxfp4" else "silu")
    got = w4_fused_experts(x, gate_up, down, weights, ids, act)
    want = torch_experts(x.float(), gate_up.dequantize().to(torch.bfloat16).float(),
                         down.dequantize().to(torch.bfloat16).float(), weights, ids, act)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


@pytest.fixture(scope="module")
def qwen3_30b_act_order():
    """Qwen3-30B-A3B's experts (128, hidden 2,048, intermediate 768) as a GPTQ act-order
    checkpoint in groups of 128: a map per expert, gate's and up's apart."""
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = _act_order(2 * 768, 2048, 128, False, 2, g, "cuda", experts=128)
    down = _act_order(2048, 768, 128, False, 1, g, "cuda", experts=128)
    return gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 64, 512, 8192])
def test_gpu_act_order_experts_of_the_qwen3_30b_shape(qwen3_30b_act_order, t):
    """Top 8 of 128 experts, bf16 activations, against the float32 product of the
    dequantized weights rounded to bf16."""
    (gate_up, w_gate_up), (down, w_down) = qwen3_30b_act_order
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, 2048, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand(t, 128, generator=g, device="cuda").topk(8, dim=1).indices
    weights = torch.rand(t, 8, generator=g, device="cuda")
    got = w4_fused_experts(x, gate_up, down, weights, ids)
    want = torch_experts(x.float(), w_gate_up.to(torch.bfloat16).float(),
                         w_down.to(torch.bfloat16).float(), weights, ids)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
