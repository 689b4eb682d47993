"""4-bit weights split over tensor-parallel ranks: each rank's weight, dequantized at load or
laid out for the W4A16 kernel, equals that rank's slice of the whole dequantized weight (rows
of column-parallel parts, inputs and their act-order groups of row-parallel ones). The ranks
are simulated in one process, as in the FP8 tests."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.parallel import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.quantization import packed
from pagedserve.quantization.gptq import GptqFormat
from pagedserve.quantization.packed import PackedLinearMethod
from tests.quantization import int4_writer as w
from tests.quantization.test_fp8_tensor_parallel import _as_rank


def _gptq(n: int, k: int, seed: int) -> tuple[dict, torch.Tensor]:
    return w.gptq_tensors(torch.randn(n, k), 16, sym=False, act_order=True, v1=True, seed=seed)


def _attach(layer, parts: dict) -> torch.Tensor:
    """Load full checkpoint tensors {shard: tensors} through the GPTQ act-order method as the
    model's loader does; the rank's weight as float32 [N, K], whichever form it took."""
    method = PackedLinearMethod(GptqFormat(16, act_order=True, zero_offset=1), ["layer"])
    method.create_weights(layer, torch.float32)
    layer.weight.data = torch.empty(0)
    offset = 0
    for shard, tensors in parts.items():
        size = layer.rank_part(torch.empty(tensors["scales"].shape[1], 1), "weight",
                               shard).shape[0] if shard else layer.out_features
        for name, t in tensors.items():
            method.load(layer, name, t, shard, (offset, size) if shard else None)
        offset += size
    method.process_after_loading(layer)
    if layer.weight is None:
        return layer.w4a16.dequantize(torch.float32)
    return layer.weight


@pytest.mark.parametrize("kernel", [False, True], ids=["dequantized", "kernel"])
def test_each_rank_holds_its_slice(monkeypatch, kernel):
    monkeypatch.setattr(packed, "KERNELS_ON_CPU", kernel)
    torch.manual_seed(0)
    gate, up = _gptq(64, 48, seed=1), _gptq(64, 48, seed=1)
    down = _gptq(48, 64, seed=2)
    q, k, v = (_gptq(n, 48, seed=3) for n in (64, 32, 32))
    for rank in range(2):
        _as_rank(monkeypatch, rank)
        rows = slice(32 * rank, 32 * rank + 32)
        merged = MergedColumnParallelLinear(48, 64)
        got = _attach(merged, {"gate": gate[0], "up": up[0]})
        assert torch.equal(got, torch.cat([gate[1][rows], up[1][rows]]))
        row = RowParallelLinear(64, 48)
        assert torch.equal(_attach(row, {None: down[0]}), down[1][:, rows])
        qkv = QKVParallelLinear(48, 16, 4, 2)
        half = slice(16 * rank, 16 * rank + 16)
        got = _attach(qkv, {"q": q[0], "k": k[0], "v": v[0]})
        assert torch.equal(got, torch.cat([q[1][rows], k[1][half], v[1][half]]))
        assert (merged.weight is None) == kernel and (qkv.weight is None) == kernel
