"""Kept GGUF weights (their blocks decoded to codes in the W4A16 kernel's layout,
`gguf_codes.py`) against gguf's own dequantizer: in the Triton interpreter on the CPU (small
shapes, float32 activations: the interpreter's bf16 is broken), every kept block type decodes
bit for bit as `gguf.quants.dequantize` does, through the codes and through the kernel's
whole-weight dequantization, and the GEMM equals x @ dequantize(W)^T in float32; `gpu` tests
over an 8B model's projection shapes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from pagedserve.quantization.gguf_blocks import random_blocks
from pagedserve.quantization.gguf_codes import check_blocks, gguf_codes
from pagedserve.quantization.gguf_types import BLOCKS
from pagedserve.quantization.ops import w4a16_gemm
from pagedserve.quantization.ops.w4a16_gemm import W4A16Weight, w4a16_linear, w4a16_mm
from tests.quantization.gguf_writer import quantize

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]
# (n, k): two and three super-blocks of 256 (8 and 24 blocks of 32), N not a tile multiple.
SHAPES = [(40, 512), (24, 768)]


def _reference(blocks: torch.Tensor, qtype: T) -> torch.Tensor:
    """gguf's numpy dequantizer: float32 [n, k]."""
    return torch.from_numpy(np.array(dequantize(blocks.numpy(), qtype)))


def _weight(qtype: T, n: int, k: int, seed: int) -> tuple[W4A16Weight, torch.Tensor]:
    """Blocks quantized from a random weight by the writers (gguf's quantizer, or the
    hand-made k-quant ones), and gguf's dequantization of them."""
    g = np.random.default_rng(seed)
    blocks = torch.from_numpy(quantize((g.standard_normal((n, k)) * 0.1).astype(np.float32),
                                       qtype))
    return gguf_codes(blocks, int(qtype), k).w4a16(), _reference(blocks, qtype)


def test_block_table_matches_gguf():
    import gguf

    for qtype, (block, size, name) in BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[T(qtype)] == (block, size) and T(qtype).name == name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_written_blocks_are_the_weights_gguf_reads(qtype):
    """The test's own blocks are valid: gguf decodes them to the weight, within the format's
    step (half a step of a 4-bit range over 15 levels, ...)."""
    w = (np.random.default_rng(3).standard_normal((8, 512)) * 0.1).astype(np.float32)
    back = dequantize(quantize(w, qtype), qtype)
    step = {T.Q8_0: 0.003, T.Q6_K: 0.012, T.Q5_K: 0.02}.get(qtype, 0.04)
    assert np.abs(back - w).max() < step
    assert np.abs(back - w).mean() < step / 3


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_is_ggufs_bit_for_bit_on_random_bytes(qtype):
    """Every bit pattern of the codes and scale fields (random bytes, finite float16 d)."""
    blocks = random_blocks(int(qtype), 24, 768, torch.Generator().manual_seed(int(qtype)))
    codes = gguf_codes(blocks, int(qtype), 768)
    want = _reference(blocks, qtype)
    assert torch.equal(codes.dequantize(), want)
    weight = codes.w4a16()
    assert weight.bits == (4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8)
    assert torch.equal(weight.dequantize(torch.float32), want)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_interpreted_gemm_against_the_dequantized_product(qtype, n, k, m):
    weight, dense = _weight(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = w4a16_mm(x, weight)
    want = x @ dense.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_float16_activations_round_the_weight_to_their_dtype():
    weight, dense = _weight(T.Q4_K, 40, 512, seed=0)
    x = torch.randn(3, 512).to(torch.float16)
    want = x.float() @ dense.to(torch.float16).float().T
    got = w4a16_mm(x, weight)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))


def test_a_layer_of_parts_of_different_types_and_the_dense_path(monkeypatch):
    """A Q4_K_M qkv: q and k in Q4_K, v in Q6_K; each part writes its columns, in the fused
    GEMM and above DEQUANTIZE_ABOVE_M through the whole decoded weight."""
    parts = [_weight(T.Q4_K, 48, 512, seed=1), _weight(T.Q6_K, 16, 512, seed=2)]
    x = torch.randn(2, 3, 512)
    bias = torch.randn(64)
    want = x @ torch.cat([d for _, d in parts]).T + bias
    blocks = [w for w, _ in parts]
    got = w4a16_linear(x, blocks, bias)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(w4a16_gemm, "DEQUANTIZE_ABOVE_M", 4)  # 6 rows: the dense path
    torch.testing.assert_close(w4a16_linear(x, blocks, bias), want, rtol=1e-5, atol=1e-4)


def test_wrong_shapes_are_refused():
    weight, _ = _weight(T.Q4_K, 8, 512, seed=0)
    with pytest.raises(ValueError, match="input has 256 features; the 4-bit weight takes 512"):
        w4a16_mm(torch.randn(1, 256), weight)
    with pytest.raises(ValueError, match="Q4_K weight of 500 inputs needs rows of"):
        check_blocks(int(T.Q4_K), torch.zeros(8, 288, dtype=torch.uint8), 500)


@pytest.mark.slow
def test_the_benchmark_runs_its_smoke_shape():
    """benchmarks/gguf_linear.py on its tiny shape in the interpreter: both paths agree."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        subprocess.run([sys.executable, str(root / "benchmarks/gguf_linear.py"), "--smoke",
                        "--tokens", "1", "--json", str(out)], check=True, cwd=root,
                       env={**__import__("os").environ, "PYTHONPATH": str(root)})
        result = json.loads(out.read_text())
    assert result["rows"][0]["rel_err"] < 1e-5
    assert 0.1 < result["gguf_bytes"] / result["dense_bytes"] < 0.2  # vs float32


@functools.cache
def _gpu_weight(qtype: T, n: int, k: int) -> tuple[W4A16Weight, torch.Tensor]:
    blocks = random_blocks(int(qtype), n, k, torch.Generator().manual_seed(0))
    return gguf_codes(blocks.cuda(), int(qtype), k).w4a16(), _reference(blocks, qtype).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 65, 1024, 8192])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gpu_gemm_against_the_dequantized_product(qtype, n, k, m):
    weight, dense = _gpu_weight(qtype, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = w4a16_linear(x, [weight])
    want = x.float() @ dense.to(torch.bfloat16).float().T
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
