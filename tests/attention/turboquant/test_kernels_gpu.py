"""TURBOQUANT on CUDA: the fused store kernel writes the torch format's codes, the attention
kernel matches float32 attention over the dequantized cache (and the torch path on the same
GPU), the decode benchmark runs, and the engine serves the bundled model with it."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
import torch

from pagedserve.attention.ops import turboquant_format as tqf
from tests.attention.turboquant.test_kernels import PRESETS, references, run_turboquant_case
from tests.utils.conformance import BATCHES
from tests.utils.paged import bundled_gguf

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _code_planes(preset: tqf.KVPreset, slots: torch.Tensor, d: int):
    """(codes, meta as int16 bit patterns) of K then V of each slot record."""
    out = []
    off = 0
    for codec in (preset.key, preset.value):
        n = codec.code_bytes(d)
        rec = slots[..., off:off + codec.record_bytes(d)]
        codes = tqf.unpack_codes(rec[..., :n], codec.bits, d)
        meta = rec[..., n:].contiguous().view(torch.int16).long()
        out.append((codes, meta))
        off += codec.record_bytes(d)
    return out


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kernel_writes_reference_codes(preset, head_size, dtype):
    from pagedserve.attention.ops.turboquant_kernels import format_tensors, tq_store

    p = tqf.PRESETS[preset]
    gen = torch.Generator().manual_seed(0)
    t, hkv, bs, num_blocks = 300, 4, 16, 40
    key = (torch.randn(t, hkv, head_size, generator=gen) * 2 + 0.5).to(dtype)
    key[:, :, 7] *= 12  # an outlier channel
    value = torch.randn(t, hkv, head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    slots[::9] = -1
    shape = tqf.cache_shape(p, num_blocks, bs, hkv, head_size)
    expected = torch.zeros(shape, dtype=torch.uint8)
    tqf.store_kv(p, expected, key.float(), value.float(), slots)
    got = torch.zeros(shape, dtype=torch.uint8, device=CUDA)
    tq_store(p, format_tensors(p, head_size, torch.device(CUDA)), key.to(CUDA),
             value.to(CUDA), got, slots.to(CUDA))
    # Compare slot records (the cache holds them as planes, turboquant_format).
    expected = tqf.slot_records(p, expected, head_size)
    got = tqf.slot_records(p, got.cpu(), head_size)
    # Padding slots are untouched.
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not got.permute(0, 2, 1, 3).reshape(num_blocks * bs, -1)[~written].any()
    # Codes are exact except, rarely, one level off where a coordinate sits on a decision
    # boundary (the kernel rotates with a matmul, the reference with a butterfly); norms and
    # scales within one fp16 ulp.
    for (c_ref, m_ref), (c_got, m_got) in zip(_code_planes(p, expected, head_size),
                                              _code_planes(p, got, head_size), strict=True):
        diff = (c_ref - c_got).abs()
        assert diff.max() <= 1
        assert (diff > 0).float().mean() < 1e-3
        assert (m_ref - m_got).abs().max() <= 1


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("head_size", [64, 128])
def test_attention_kernel_matches_reference_bf16(preset, batch, head_size):
    out, _, reqs, *_ = run_turboquant_case(preset, BATCHES[batch], num_heads=8, num_kv_heads=2,
                                           head_size=head_size, dtype=torch.bfloat16,
                                           use_kernels=True, device=CUDA)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tiles", ["16/64/8/2", "16/64/4/2", "16/32/4/2", "16/128/8/2",
                                   "16/64/2/4", "16/64/8/3/gather", "16/64/8/2/select",
                                   "16/64/8/2/prmt/128", "16/32/4/2/prmt/128",
                                   "16/128/8/2/prmt/128", "16/64/8/2/prmt",
                                   "16/32/4/1/prmt/128/1", "16/64/8/1/prmt/128/1",
                                   "16/64/4/1/prmt/0/1"])
@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit"])
def test_attention_kernel_decode_tiles_and_lookups_bf16(preset, tiles):
    """Every launch shape and codebook lookup of the decode sweep gives the same attention."""
    from pagedserve.attention.ops.turboquant_kernels import TQTiles

    out, _, reqs, *_ = run_turboquant_case(preset, BATCHES["decode"], num_heads=32,
                                           num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                           use_kernels=True, device=CUDA,
                                           tiles=TQTiles.parse(tiles))
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit"])
def test_attention_kernel_split_kv_decode_bf16(preset, num_splits):
    """Split-KV decode with the default (prmt) decode tiles agrees with the reference."""
    batch = [(700, 1), (16, 1), (5, 1), (0, 1), (1000, 1)]
    out, _, reqs, *_ = run_turboquant_case(preset, batch, num_heads=32, num_kv_heads=8,
                                           head_size=128, dtype=torch.bfloat16,
                                           use_kernels=True, device=CUDA, num_splits=num_splits)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("batch,window,soft_cap,block_size", [
    ("mixed", 8, None, 16), ("decode", 20, 5.0, 1), ("decode", None, None, 32),
    ("chunked_prefill", None, None, 16)])
@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit", "naive_int4"])
def test_attention_kernel_prefetch_bf16(preset, batch, window, soft_cap, block_size):
    """The register-prefetching loop (unmasked key and value-meta loads of page 0 past the
    context, on a cache of arbitrary bits) with windows, soft caps and page sizes."""
    from pagedserve.attention.ops.turboquant_kernels import TQTiles

    out, _, reqs, *_ = run_turboquant_case(preset, BATCHES[batch], block_size, 8, 2,
                                           head_size=128, dtype=torch.bfloat16, window=window,
                                           soft_cap=soft_cap, use_kernels=True, device=CUDA,
                                           tiles=TQTiles.parse("16/32/4/1/prmt/128/1"),
                                           fill=255)
    assert torch.isfinite(out).all()
    dequant, _ = references(preset, reqs, window, soft_cap)
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("preset", ["tq_4bit", "naive_int3"])
@pytest.mark.parametrize("window,soft_cap,block_size", [(8, None, 16), (None, 5.0, 1),
                                                         (None, None, 32)])
def test_attention_kernel_fp32_options(preset, window, soft_cap, block_size):
    args = dict(block_size=block_size, num_heads=12, num_kv_heads=3, window=window,
                soft_cap=soft_cap, device=CUDA)
    kernel, *_ = run_turboquant_case(preset, BATCHES["mixed"], use_kernels=True, **args)
    torch_path, _, reqs, *_ = run_turboquant_case(preset, BATCHES["mixed"], use_kernels=False,
                                                  **args)
    dequant, _ = references(preset, reqs, window, soft_cap)
    torch.testing.assert_close(kernel, dequant, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch_path, dequant, rtol=1e-4, atol=1e-4)


# Decode batches for the CUDA kernel: contexts around tile (16) and warp-round (64) edges, an
# empty context, and long ones.
CUDA_DECODE_BATCH = [(0, 1), (1, 1), (15, 1), (16, 1), (17, 1), (63, 1), (64, 1), (65, 1),
                     (300, 1), (1000, 1)]
# (head size, (query heads, KV heads), block size): query groups of 1, 3, 4 and 8 (one n-tile)
# and 12 and 16 (two), and both head sizes.
CUDA_DECODE_SHAPES = [(128, (32, 8), 16), (128, (32, 8), 64), (128, (9, 3), 16),
                      (128, (16, 2), 32), (128, (12, 1), 16), (128, (8, 8), 16),
                      (128, (16, 1), 16), (64, (9, 3), 16), (64, (16, 2), 64)]


@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit"])
@pytest.mark.parametrize("head_size,heads,block_size", CUDA_DECODE_SHAPES)
def test_cuda_decode_kernel_matches_reference_bf16(preset, head_size, heads, block_size):
    """The CUDA decode kernel (ops/csrc/tq_decode.cu) on an unwritten-slot fill of 255 (NaN
    metas and fp8 codes past the context)."""
    out, _, reqs, *_ = run_turboquant_case(preset, CUDA_DECODE_BATCH, block_size, *heads,
                                           head_size=head_size, dtype=torch.bfloat16,
                                           use_kernels=True, device=CUDA, fill=255,
                                           decode_kernel="cuda")
    assert torch.isfinite(out).all()
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)
    # Outputs over long contexts are small, so also bound the error relative to their norm
    # (bf16 outputs, P and levels: a few 1e-3).
    assert _relative_error(out, dequant) < 1.5e-2


def _relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference).norm() / reference.norm())


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit"])
@pytest.mark.parametrize("head_size", [128, 64])
def test_cuda_decode_kernel_split_kv_bf16(preset, num_splits, head_size):
    """Split-KV: contexts cut into whole-tile ranges, some of them empty (short contexts), the
    new token in the last; partials merged by reduce_split_kv."""
    out, _, reqs, *_ = run_turboquant_case(preset, CUDA_DECODE_BATCH, 16, 32, 8,
                                           head_size=head_size,
                                           dtype=torch.bfloat16, use_kernels=True, device=CUDA,
                                           fill=255, num_splits=num_splits, decode_kernel="cuda")
    assert torch.isfinite(out).all()
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit"])
@pytest.mark.parametrize("head_size", [128, 64])
def test_cuda_decode_kernel_float16_and_agrees_with_triton(preset, head_size):
    args = dict(block_size=32, num_heads=32, num_kv_heads=8, head_size=head_size,
                dtype=torch.float16, use_kernels=True, device=CUDA)
    cuda, _, reqs, *_ = run_turboquant_case(preset, CUDA_DECODE_BATCH, decode_kernel="cuda",
                                            **args)
    triton_out, *_ = run_turboquant_case(preset, CUDA_DECODE_BATCH, decode_kernel="triton",
                                         **args)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(cuda.float(), dequant, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(cuda.float(), triton_out.float(), rtol=1e-2, atol=1e-2)
    # No less accurate than the Triton kernel (both a few 1e-3 in fp16).
    assert _relative_error(cuda, dequant) <= 1.5 * _relative_error(triton_out, dequant) + 1e-3


@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_3bit"])
def test_cuda_decode_kernel_takes_fused_qkv_views(preset):
    """Query, key and value as views of one fused QKV output (row strides of the whole) and an
    output with padded rows, as a model's layer hands them over."""
    out, _, reqs, *_ = run_turboquant_case(preset, CUDA_DECODE_BATCH, 16, 12, 4, head_size=128,
                                           dtype=torch.bfloat16, use_kernels=True, device=CUDA,
                                           decode_kernel="cuda", fused=True)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)
    assert _relative_error(out, dequant) < 1.5e-2


def test_cuda_decode_kernel_falls_back_or_refuses():
    """'auto' takes the Triton kernel where the CUDA one cannot run (a sliding window, head
    size 32, naive presets); 'cuda' says why instead."""
    for preset, head_size, window in (("tq_4bit", 128, 8), ("tq_4bit", 32, None),
                                      ("naive_int4", 128, None)):
        args = dict(num_heads=8, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16,
                    window=window, use_kernels=True, device=CUDA)
        out, _, reqs, *_ = run_turboquant_case(preset, CUDA_DECODE_BATCH[:6],
                                               decode_kernel="auto", **args)
        dequant, _ = references(preset, reqs, window)
        torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)
        with pytest.raises(RuntimeError, match="CUDA decode kernel"):
            run_turboquant_case(preset, CUDA_DECODE_BATCH[:6], decode_kernel="cuda", **args)


def _benchmark_module():
    path = pathlib.Path(__file__).parents[3] / "benchmarks" / "kv_quant_quality.py"
    spec = importlib.util.spec_from_file_location("kv_quant_quality", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_decode_benchmark_runs_and_agrees_with_bf16():
    rows = _benchmark_module().decode_benchmark(num_seqs=8, context=1024)
    errors = {r["impl"]: r["rel_err"] for r in rows}
    # Random K/V: the output's relative error is about the value codes' rms error, the square
    # root of the Lloyd-Max distortion at their width (0.0975 at 4 bits, 0.186 at 3), plus what
    # the keys' codes move in the weights: allow half as much again. (Measured on the H200:
    # 0.100, 0.139, 0.262.)
    for name in ("tq_k8v4", "tq_4bit", "tq_3bit"):
        levels = tqf.lloyd_max_codebook(tqf.PRESETS[name].value.bits)
        assert errors[f"TURBOQUANT {name}"] < 1.5 * tqf.gaussian_distortion(levels) ** 0.5


def test_engine_bundled_model_tq_k8v4(make_llm):
    from pagedserve import SamplingParams

    prompts = ["The capital of France is", "Photosynthesis is the process by which"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # A fixed pool: several engines live at once here, so memory profiling would not fit.
    common = dict(model=str(bundled_gguf()), device=CUDA, dtype="bfloat16",
                  num_gpu_blocks_override=256)
    base = make_llm(attention_backend="TRITON", **common)
    ids = [base.tokenizer.encode(p) for p in prompts]
    expected = [o.outputs[0].token_ids for o in base.generate(ids, params, use_tqdm=False)]
    reference = base.score(ids, expected)
    for preset in PRESETS:
        llm = make_llm(attention_backend="TURBOQUANT", kv_cache_dtype=preset, **common)
        outs = llm.generate(ids, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
        if preset == "tq_k8v4":
            got = llm.score(ids, expected)
            top1 = np.mean([float((r.argmax(-1) == g.argmax(-1)).float().mean())
                            for r, g in zip(reference, got, strict=True)])
            assert top1 >= 0.9
