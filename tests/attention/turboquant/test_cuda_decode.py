"""The CUDA TurboQuant decode kernel (ops/csrc/tq_decode.cu). Its host side, on any machine: its
level-pair tables, the kernel choice, the refusals, and (where nvcc exists) that it builds and
that the Python mirror of its parameter struct has the C layout. Its numerics on CUDA (the `gpu`
tests): against the float32 references with unwritten slots of 0xFF, split-KV, float16 next to
the Triton kernel, fused QKV views, and the fallback to Triton or the refusal where it cannot
run."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.ops import tq_decode_cuda as tqc
from pagedserve.attention.ops import turboquant_format as tqf
from tests.attention.turboquant.harness import CUDA, references, run_turboquant_case

# ---- the host side ----------------------------------------------------------------------------

@pytest.mark.parametrize("preset,bits", [("tq_4bit", 4), ("tq_3bit", 3), ("tq_k8v4", 4)])
def test_pair_table_holds_the_levels_of_each_code_pair(preset, bits):
    table = tqc.pair_table(preset, bits, "cpu")
    assert table.dtype == torch.int32 and table.numel() == 1 << (2 * bits)
    halves = table.view(torch.int16).view(-1, 2).contiguous().view(torch.float16).float()
    levels = tqf.codebook_levels(tqf.PRESETS[preset].value).half().float()
    entries = torch.arange(1 << (2 * bits))
    mask = (1 << bits) - 1
    # Little-endian: the low half is the pair's first channel (the low bits of the entry).
    assert torch.equal(halves[:, 0], levels[entries & mask])
    assert torch.equal(halves[:, 1], levels[entries >> bits])


def test_requested_kernel_reads_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_TQ_DECODE_KERNEL", raising=False)
    assert tqc.requested_kernel() == "auto"
    for value in ("cuda", "triton", "AUTO"):
        monkeypatch.setenv("PAGEDSERVE_TQ_DECODE_KERNEL", value)
        assert tqc.requested_kernel() == value.lower()
    monkeypatch.setenv("PAGEDSERVE_TQ_DECODE_KERNEL", "fast")
    with pytest.raises(ValueError, match="'fast'"):
        tqc.requested_kernel()


def test_unsupported_reasons():
    p = tqf.PRESETS["tq_4bit"]
    args = dict(head_size=128, block_size=16, dtype=torch.bfloat16, num_queries_per_kv=4,
                sliding_window=None, soft_cap=None)
    assert "NVIDIA" in tqc.unsupported_reason(p, device=torch.device("cpu"), **args)
    if not torch.cuda.is_available():
        return
    cuda = torch.device("cuda")
    cases = [(dict(head_size=32), "head size 32"), (dict(block_size=8), "block size 8"),
             (dict(block_size=48), "block size 48"), (dict(dtype=torch.float32), "float32"),
             (dict(num_queries_per_kv=32), "32 query heads"),
             (dict(sliding_window=128), "sliding window")]
    for change, reason in cases:
        assert reason in tqc.unsupported_reason(p, device=cuda, **{**args, **change})
    assert "naive_int4" in tqc.unsupported_reason(tqf.PRESETS["naive_int4"], device=cuda,
                                                  **args)


def test_fused_views_reach_the_torch_path_unchanged():
    """The fused-QKV views the CUDA kernel is tested with on the GPU give the same answer as
    separate tensors on the CPU path (the harness itself is right)."""
    batch = [(5, 1), (40, 1), (0, 1)]
    plain, *_ = run_turboquant_case("tq_3bit", batch, 16, 12, 4, head_size=64)
    fused, *_ = run_turboquant_case("tq_3bit", batch, 16, 12, 4, head_size=64, fused=True)
    torch.testing.assert_close(fused, plain)


def test_builder_reads_the_decode_kernel_setting(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TQ_DECODE_KERNEL", "cuda")
    # On the CPU the torch path runs (no kernel plan); the builder still reads the variable.
    from pagedserve.attention import BuilderConfig
    from pagedserve.attention.backends.turboquant import TurboQuantBackend

    config = BuilderConfig(8, 2, 128, torch.float32, 16, 4, 4, 8, torch.device("cpu"),
                           kv_cache_dtype="tq_4bit")
    builder = TurboQuantBackend.for_kv_cache_dtype("tq_4bit").get_builder_cls()(config)
    assert builder.decode_kernel == "cuda"
    # And the torch path's answers do not depend on it.
    out, *_ = run_turboquant_case("tq_4bit", [(5, 1), (0, 1)], head_size=128)
    assert torch.isfinite(out).all()


@pytest.mark.slow  # 16 s of nvcc; every GPU test of the kernel builds it too
@pytest.mark.skipif(tqc.nvcc_path() is None, reason="needs nvcc")
def test_kernel_builds_and_its_params_match_the_mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    path = tqc.build("90a")
    assert path.is_file() and path.parent == tmp_path / "kernels"
    assert tqc.build("90a") == path  # cached: no second compile
    tqc._Library(path)  # raises if the size or a field offset differs from the ctypes mirror


# ---- the kernel on CUDA -----------------------------------------------------------------------

# Decode batches for the CUDA kernel: contexts around tile (16) and warp-round (64) edges, an
# empty context, and long ones.
CUDA_DECODE_BATCH = [(0, 1), (1, 1), (15, 1), (16, 1), (17, 1), (63, 1), (64, 1), (65, 1),
                     (300, 1), (1000, 1)]


# (head size, (query heads, KV heads), block size): query groups of 1, 3, 4 and 8 (one n-tile)
# and 12 and 16 (two), and both head sizes.
CUDA_DECODE_SHAPES = [(128, (32, 8), 16), (128, (32, 8), 64), (128, (9, 3), 16),
                      (128, (16, 2), 32), (128, (12, 1), 16), (128, (8, 8), 16),
                      (128, (16, 1), 16), (64, (9, 3), 16), (64, (16, 2), 64)]


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
