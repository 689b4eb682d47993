"""`random:<preset>` with --quantization fp8: the float model's very weights, each quantized per
output row as it is made (so a 70B shape never holds its bf16 weights)."""

from __future__ import annotations

import torch

from pagedserve.models.loader import load_random_model
from pagedserve.quantization import fp8 as fp8_method
from tests.quantization import fp8_writer as w

CPU = torch.device("cpu")


def test_random_fp8_weights_are_the_float_models_quantized(monkeypatch):
    exact = load_random_model("tiny", torch.float32, CPU).model
    fp8 = load_random_model("tiny", torch.float32, CPU, quantization="fp8").model
    want = exact.model.layers[1].mlp.gate_up_proj.weight.detach()
    got = fp8.model.layers[1].mlp.gate_up_proj.weight
    assert got.dtype == torch.float32  # the CPU dequantizes
    torch.testing.assert_close(got, w.quantize(want, "channel")[2], rtol=0, atol=0)
    torch.testing.assert_close(fp8.lm_head.weight, exact.lm_head.weight, rtol=0, atol=0)
    # Where kernels run, the layers keep their codes: half the bytes of bf16.
    monkeypatch.setattr(fp8_method, "KERNELS_ON_CPU", True)
    kept = load_random_model("tiny", torch.bfloat16, CPU, quantization="fp8").model
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.fp8_kernel == "scaled_mm"
    assert qkv.weight_scale.shape == (qkv.out_features,)
