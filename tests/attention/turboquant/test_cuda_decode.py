"""The CUDA TurboQuant decode kernel's host side, on any machine: its level-pair tables, the
kernel choice, the refusals, and (where nvcc exists) that it builds and that the Python mirror of
its parameter struct has the C layout. Its numerics are tested on the GPU
(test_turboquant_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.ops import tq_decode_cuda as tqc
from pagedserve.attention.ops import turboquant_format as tqf


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
    from tests.attention.turboquant.test_kernels import run_turboquant_case

    batch = [(5, 1), (40, 1), (0, 1)]
    plain, *_ = run_turboquant_case("tq_3bit", batch, 16, 12, 4, head_size=64)
    fused, *_ = run_turboquant_case("tq_3bit", batch, 16, 12, 4, head_size=64, fused=True)
    torch.testing.assert_close(fused, plain)


def test_builder_reads_the_decode_kernel_setting(monkeypatch):
    from tests.attention.turboquant.test_kernels import run_turboquant_case

    monkeypatch.setenv("PAGEDSERVE_TQ_DECODE_KERNEL", "cuda")
    # On the CPU the torch path runs (no kernel plan); the builder still reads the variable.
    from pagedserve.attention import BuilderConfig
    from pagedserve.attention.backends.turboquant import TurboQuantBackend

    config = BuilderConfig(8, 2, 128, torch.float32, 16, 4, 4, 8, torch.device("cpu"),
                           kv_cache_dtype="tq_4bit")
    builder = TurboQuantBackend.for_preset("tq_4bit").get_builder_cls()(config)
    assert builder.decode_kernel == "cuda"
    # And the torch path's answers do not depend on it.
    out, *_ = run_turboquant_case("tq_4bit", [(5, 1), (0, 1)], head_size=128)
    assert torch.isfinite(out).all()


@pytest.mark.skipif(tqc.nvcc_path() is None, reason="needs nvcc")
def test_kernel_builds_and_its_params_match_the_mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    path = tqc.build("90a")
    assert path.is_file() and path.parent == tmp_path / "kernels"
    assert tqc.build("90a") == path  # cached: no second compile
    tqc._Library(path)  # raises if the size or a field offset differs from the ctypes mirror
