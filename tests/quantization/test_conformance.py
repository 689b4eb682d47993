"""Every linear method through the same motions, as the model's loader drives them: created on
the meta device, materialised, each tensor its `checkpoint_tensors` lists loaded part by part
into a fused q/k/v layer and a row-parallel layer with a bias, finished, applied; the product
against F.linear on the weights the checkpoint stands for. A tensor the method does not list
is refused by name. A new method joins by adding a row to METHODS."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pagedserve.models.parallel import QKVParallelLinear, RowParallelLinear
from pagedserve.quantization.base import LinearMethod
from pagedserve.quantization.fp8 import Fp8Config
from pagedserve.quantization.fp8_format import Fp8Scheme
from pagedserve.quantization.gguf_blocks import GgufLinearMethod, GGUFWeight
from pagedserve.quantization.int8_cpu import INT8
from pagedserve.quantization.unquantized import UNQUANTIZED
from tests.quantization import fp8_writer as w


def _float(weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    return {"weight": weight}, weight


def _fp8(kind: str, block=None, scale_name="weight_scale", static=False):
    def write(weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
        codes, scale, deq = w.quantize(weight, kind, block)
        tensors = {"weight": codes, scale_name: scale}
        if static:
            tensors["input_scale"] = torch.tensor([0.1])
        return tensors, deq
    return write


def _online(weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    return {"weight": weight}, w.quantize(weight, "channel")[2]


def _gguf(weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """A GGUF file's Q4_1 blocks of the weight, as the GGUF reader hands them over."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType.Q4_1
    blocks = quantize(weight.numpy(), qtype)
    deq = torch.from_numpy(dequantize(blocks, qtype))
    return {"weight": GGUFWeight(int(qtype), blocks, tuple(weight.shape), "blk.0.w")}, deq


def _fp8_method(scheme: Fp8Scheme) -> Callable[[], LinearMethod]:
    return lambda: Fp8Config(scheme).get_method(QKVParallelLinear(8, 4, 2, 1), "x", ["x"])


# name: (method factory, checkpoint writer, relative tolerance of the product)
METHODS = {
    "unquantized": (lambda: UNQUANTIZED, _float, 1e-6),
    "int8": (lambda: INT8, _float, 2e-2),
    "fp8-tensor-static": (_fp8_method(Fp8Scheme("tensor", "static")),
                          _fp8("tensor", static=True), 1e-6),
    "fp8-channel": (_fp8_method(Fp8Scheme("channel")), _fp8("channel"), 1e-6),
    "fp8-block": (_fp8_method(Fp8Scheme("block", "dynamic", (16, 32), "weight_scale_inv")),
                  _fp8("block", (16, 32), "weight_scale_inv"), 1e-6),
    "fp8-online": (_fp8_method(Fp8Scheme("channel", online=True)), _online, 1e-6),
    "gguf": (GgufLinearMethod, _gguf, 1e-5),
}
# Inputs of the fused layer: a whole number of every format's blocks (GGUF's are 32 wide).
HIDDEN = 64


def _build(cls, method: LinearMethod, *args, **kwargs):
    with torch.device("meta"):
        layer = cls(*args, **kwargs)
    if method is not UNQUANTIZED:
        method.create_weights(layer, torch.float32)
        layer.quant_method = method
    layer.prefix = "layer"
    return layer.to_empty(device="cpu")


@pytest.mark.parametrize("name", list(METHODS))
@torch.no_grad()
def test_linear_method_conformance(name):
    make, write, tolerance = METHODS[name]
    torch.manual_seed(0)
    method = make()
    qkv = _build(QKVParallelLinear, method, HIDDEN, 16, 2, 1)
    parts, want = [], []
    for shard, rows in (("q", (0, 32)), ("k", (32, 16)), ("v", (48, 16))):
        tensors, deq = write(torch.randn(rows[1], HIDDEN))
        assert set(tensors) == set(method.checkpoint_tensors(qkv))
        parts.append((shard, rows, tensors))
        want.append(deq)
    for shard, rows, tensors in parts:
        for leaf, tensor in tensors.items():
            method.load(qkv, leaf, tensor, shard, rows)
    with pytest.raises(ValueError, match="bogus"):
        method.load(qkv, "bogus", torch.ones(1), "q", (0, 32))
    method.process_after_loading(qkv)
    x = torch.randn(5, HIDDEN)
    ref = F.linear(x, torch.cat(want))
    assert float((qkv(x) - ref).norm() / ref.norm()) < tolerance

    row = _build(RowParallelLinear, method, 32, 24, bias=True)
    tensors, deq = write(torch.randn(24, 32))
    tensors["bias"] = torch.randn(24)
    assert set(tensors) == set(method.checkpoint_tensors(row))
    for leaf, tensor in tensors.items():
        method.load(row, leaf, tensor, None, None)
    method.process_after_loading(row)
    x = torch.randn(3, 32)
    ref = F.linear(x, deq, tensors["bias"])
    assert float((row(x) - ref).norm() / ref.norm()) < tolerance
