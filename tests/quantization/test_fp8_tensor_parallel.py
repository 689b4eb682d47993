"""FP8 weights and their scales split over tensor-parallel ranks: each rank's dequantized part
equals that rank's slice of the whole dequantized weight (block scales sliced by block, channel
scales by row, tensor scales whole), and a split inside a block is refused at load. The ranks
are simulated in one process (the layers only read the rank and world size)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.distributed import parallel_state
from pagedserve.models.moe import FusedMoE
from pagedserve.models.parallel import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.quantization.fp8 import Fp8LinearMethod
from pagedserve.quantization.fp8_format import Fp8Scheme
from pagedserve.quantization.fp8_moe import Fp8MoEMethod
from tests.quantization import fp8_writer as w

BLOCK = Fp8Scheme("block", "dynamic", (16, 16), "weight_scale_inv")
CHANNEL = Fp8Scheme("channel", "dynamic")
TENSOR = Fp8Scheme("tensor", "static")


def _as_rank(monkeypatch, rank: int, world: int = 2) -> None:
    monkeypatch.setattr(parallel_state, "_rank", rank)
    monkeypatch.setattr(parallel_state, "_world_size", world)


def _attach(layer, method, tensors: dict) -> None:
    """Load full checkpoint tensors {shard: (codes, scale)} through `method`, as the model's
    loader does (rows of each fused part in this rank's layer), then finish."""
    layer.prefix = "layer"
    method.create_weights(layer, torch.float32)
    layer.weight.data = torch.empty(layer.weight.shape, dtype=torch.float8_e4m3fn)
    offset = 0
    for shard, (codes, scale) in tensors.items():
        size = (layer.rank_part(codes, "weight", shard).shape[0])
        rows = (offset, size) if shard else None
        method.load(layer, "weight", codes, shard, rows)
        method.load(layer, method.scheme.scale_name, scale, shard, rows)
        if method.scheme.activation == "static":
            method.load(layer, "input_scale", torch.tensor([0.1]), shard, rows)
        offset += size
    method.process_after_loading(layer)


@pytest.mark.parametrize("scheme", [BLOCK, CHANNEL, TENSOR], ids=lambda s: s.weight)
def test_each_rank_dequantizes_its_slice(monkeypatch, scheme):
    torch.manual_seed(0)
    block = scheme.block
    gate, up = (w.quantize(torch.randn(64, 48), scheme.weight, block) for _ in range(2))
    down = w.quantize(torch.randn(48, 64), scheme.weight, block)
    q, k, v = (w.quantize(torch.randn(n, 48), scheme.weight, block) for n in (64, 32, 32))
    for rank in range(2):
        _as_rank(monkeypatch, rank)
        merged = MergedColumnParallelLinear(48, 64)
        _attach(merged, Fp8LinearMethod(scheme), {"gate": gate[:2], "up": up[:2]})
        rows = slice(32 * rank, 32 * rank + 32)
        assert torch.equal(merged.weight, torch.cat([gate[2][rows], up[2][rows]]))
        row = RowParallelLinear(64, 48)
        _attach(row, Fp8LinearMethod(scheme), {None: down[:2]})
        assert torch.equal(row.weight, down[2][:, rows])
        qkv = QKVParallelLinear(48, 16, 4, 2)
        _attach(qkv, Fp8LinearMethod(scheme), {"q": q[:2], "k": k[:2], "v": v[:2]})
        half = slice(16 * rank, 16 * rank + 16)
        assert torch.equal(qkv.weight, torch.cat([q[2][rows], k[2][half], v[2][half]]))


def test_experts_split_by_block_and_a_split_block_is_refused(monkeypatch):
    torch.manual_seed(1)
    gate = w.quantize(torch.randn(32, 48), "block", (16, 16))
    down = w.quantize(torch.randn(48, 32), "block", (16, 16))
    _as_rank(monkeypatch, 1)
    experts = FusedMoE(1, 48, 32)
    method = Fp8MoEMethod(BLOCK)
    method.create_weights(experts, torch.float32)
    for name in ("gate_up_proj", "down_proj"):
        getattr(experts, name).data = torch.empty(getattr(experts, name).shape,
                                                  dtype=torch.float8_e4m3fn)
    for shard, (codes, scale, _) in (("gate", gate), ("up", gate), ("down", down)):
        method.load_expert(experts, 0, shard, "weight", codes)
        method.load_expert(experts, 0, shard, "weight_scale_inv", scale)
    method.process_after_loading(experts)
    assert torch.equal(experts.gate_up_proj[0], torch.cat([gate[2][16:], gate[2][16:]]))
    assert torch.equal(experts.down_proj[0], down[2][:, 16:])
    # Four ranks give each 8 of the 32 rows: inside a 16-row block.
    _as_rank(monkeypatch, 1, world=4)
    layer = MergedColumnParallelLinear(48, 32)
    with pytest.raises(ValueError, match=r"rows 8\.\.16 of the weight, which splits a "
                                         r"16-wide FP8 block"):
        _attach(layer, Fp8LinearMethod(BLOCK), {"gate": gate[:2], "up": gate[:2]})
