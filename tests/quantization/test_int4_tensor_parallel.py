"""4-bit weights split over tensor-parallel ranks: each rank's weight, dequantized at load or
laid out for the W4A16 kernel or the 4-bit MoE kernel, equals that rank's slice of the whole
dequantized weight (rows of column-parallel parts, inputs and their act-order groups of
row-parallel ones). The ranks are simulated in one process, as in the FP8 tests."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.moe import FusedMoE
from pagedserve.models.parallel import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.quantization import packed
from pagedserve.quantization.gptq import GptqFormat
from pagedserve.quantization.packed import PackedLinearMethod, PackedMoEMethod
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


# (group size, act-order, the experts' intermediate size, whether gate and up share a map):
# act-order maps, and groups in order whose row-parallel slice splits a group (24 of 48
# inputs a rank in groups of 16) or does not (32 of 64).
MOE = [(16, True, 48, True), (16, True, 48, False), (16, False, 48, True),
       (16, False, 64, True)]


@pytest.mark.parametrize("group,act_order,inter,shared", MOE)
def test_each_rank_holds_its_experts_slice(monkeypatch, group, act_order, inter, shared):
    """GPTQ experts at two ranks, laid out for the 4-bit MoE kernel: each rank's gate_up and
    down, dequantized from the layout, equal its rows and inputs of the whole dequantized
    experts; a group map is kept only where the groups do not run in order; the ranks' kernel
    outputs (in the interpreter) sum to the whole experts' product."""
    from pagedserve.models.moe import torch_experts
    from pagedserve.quantization.ops.w4_moe_kernels import w4_fused_experts

    monkeypatch.setattr(packed, "KERNELS_ON_CPU", True)
    torch.manual_seed(0)
    e, hidden = 3, 32
    fmt = GptqFormat(group, act_order=act_order, zero_offset=1)
    experts = []
    for expert in range(e):  # each expert its own act-order permutation, as GPTQ's are
        gate_seed = 10 * expert
        up_seed = gate_seed if shared else gate_seed + 1
        experts.append({shard: w.gptq_tensors(torch.randn(*shape), group, sym=False,
                                              act_order=act_order, v1=True, seed=seed)
                        for shard, shape, seed in (("gate", (inter, hidden), gate_seed),
                                                   ("up", (inter, hidden), up_seed),
                                                   ("down", (hidden, inter), gate_seed + 2))})
    x = torch.randn(5, hidden)
    ids, weights = torch.stack([torch.randperm(e)[:2] for _ in range(5)]), torch.rand(5, 2)
    summed = torch.zeros(5, hidden)
    for rank in range(2):
        _as_rank(monkeypatch, rank)
        layer = FusedMoE(e, hidden, inter)
        method = PackedMoEMethod(fmt)
        method.create_weights(layer, torch.float32)
        for expert, shards in enumerate(experts):
            for shard, (tensors, _) in shards.items():
                for name, t in tensors.items():
                    method.load_expert(layer, expert, shard, name, t)
        method.process_after_loading(layer)
        gate_up, down = layer.w4_experts
        rows = slice(inter // 2 * rank, inter // 2 * (rank + 1))
        want_gate_up = torch.stack([torch.cat([s["gate"][1][rows], s["up"][1][rows]])
                                    for s in experts])
        assert torch.equal(gate_up.dequantize(), want_gate_up)
        assert torch.equal(down.dequantize(), torch.stack([s["down"][1][:, rows]
                                                           for s in experts]))
        assert (gate_up.g_idx is None) == (not act_order)
        assert (down.g_idx is None) == (not act_order and (inter // 2) % group == 0)
        if gate_up.g_idx is not None:
            assert gate_up.g_idx.shape == (e, 1 if shared else 2, hidden)
        summed += w4_fused_experts(x, gate_up, down, weights, ids)
    whole = torch_experts(x, torch.stack([torch.cat([s["gate"][1], s["up"][1]])
                                          for s in experts]),
                          torch.stack([s["down"][1] for s in experts]), weights, ids)
    torch.testing.assert_close(summed, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()))


def test_a_slice_that_splits_a_byte_is_refused_by_name():
    """Two codes a byte: a rank whose inputs start or end between them cannot take the
    kernel's layout (no GPTQ or compressed-tensors checkpoint has such a split: their inputs
    come eight a word)."""
    from types import SimpleNamespace

    from pagedserve.quantization import w4_moe

    part = w4_moe._Codes(torch.zeros(4, 5, dtype=torch.uint8), torch.ones(4, 1),
                         torch.zeros(4, 1, dtype=torch.uint8), torch.zeros(10, dtype=torch.long))
    layer = SimpleNamespace(rank_slice=lambda name, shard: (1, 5, 5))
    with pytest.raises(ValueError, match=r"experts\.0\.down: this rank's inputs 5\.\.10 split "
                                         r"a byte of two 4-bit codes"):
        w4_moe._rank_part(layer, part, "down", "experts.0.down")


def test_an_expert_of_the_wrong_shape_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(packed, "KERNELS_ON_CPU", True)
    _as_rank(monkeypatch, 0, world=1)
    layer = FusedMoE(2, 32, 48)
    layer.prefix = "model.layers.0.mlp.experts"
    method = PackedMoEMethod(GptqFormat(16, act_order=True, zero_offset=1))
    method.create_weights(layer, torch.float32)
    for expert in range(2):
        for shard, shape in (("gate", (48, 32)), ("up", (40 if expert else 48, 32)),
                             ("down", (32, 48))):
            tensors, _ = w.gptq_tensors(torch.randn(*shape), 16, sym=False, act_order=True,
                                        v1=True, seed=expert)
            for name, t in tensors.items():
                method.load_expert(layer, expert, shard, name, t)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.1\.up has shape "
                                         r"\(40, 32\) in 4 bits .* expects \(48, 32\)"):
        method.process_after_loading(layer)
