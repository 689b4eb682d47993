"""8-bit integer weights with 16-bit activations (W8A16) on the CPU: GPTQ 8-bit (gptq /
gptq_v2, symmetric or not, act-order) and compressed-tensors pack-quantized with num_bits 8
(symmetric or not), written by the tests' own packers (int4_writer), load dequantized into
float32, and their greedy tokens equal transformers' on the dequantized weights. The 4-bit
MoE kernel refuses 8-bit experts by name; other widths are refused by name at the config."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models import load_model
from tests.quantization import int4_writer as w
from tests.quantization import test_int4_checkpoints as int4
from tests.quantization.test_fp8_checkpoints import _check_tokens

CPU = torch.device("cpu")
float_models = int4.float_models  # the float checkpoints the 4-bit tests quantize

CASES = {
    "gptq8-v1-sym-g128": w.gptq_config(128, sym=True, act_order=False, v1=True, bits=8),
    "gptq8-v2-asym-g32": w.gptq_config(32, sym=False, act_order=False, v1=False, bits=8),
    "gptq8-v1-asym-g64-actorder": w.gptq_config(64, sym=False, act_order=True, v1=True,
                                                bits=8),
    "ct8-sym-g128": w.ct_config(128, sym=True, act_order=False, bits=8),
    "ct8-asym-g32": w.ct_config(32, sym=False, act_order=False, bits=8),
    "ct8-asym-g64-actorder": w.ct_config(64, sym=False, act_order=True, bits=8),
}


@pytest.mark.parametrize("family,case", [
    ("llama", "gptq8-v1-sym-g128"), ("llama", "gptq8-v2-asym-g32"),
    ("qwen3_moe", "gptq8-v1-asym-g64-actorder"), ("llama", "ct8-sym-g128"),
    ("qwen3_moe", "ct8-asym-g32"),
    pytest.param("llama", "ct8-asym-g64-actorder", marks=pytest.mark.slow)])
def test_int8_checkpoint_tokens_equal_transformers_on_dequantized_weights(
        float_models, tmp_path, family, case):
    w.write_int4(float_models[family], tmp_path / "int8", tmp_path / "ref", CASES[case])
    model = load_model(str(tmp_path / "int8"), torch.float32, CPU).model
    name = model.model.layers[0].self_attn.qkv_proj.quant_method.name
    assert ("GPTQ int8" if case.startswith("gptq") else "compressed-tensors int8") in name
    _check_tokens(tmp_path / "int8", tmp_path / "ref")


def test_eight_bit_packers_agree_with_the_formats_descriptions():
    """Hand-made words: four 8-bit codes a word, code i in bits 8i..8i+7, along either dim;
    a code of 255 in the top byte makes the word negative and still reads back."""
    from pagedserve.quantization.int4_format import unpack_int32

    codes = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x01, 0x80, 0xFE, 0xFF]], dtype=torch.int32)
    words = w.pack(codes, 1, bits=8)
    assert words.tolist() == [[0x76543210, 0xFFFE8001 - (1 << 32)]]  # as int32
    assert torch.equal(unpack_int32(words, 1, "w", 8), codes)
    assert torch.equal(unpack_int32(w.pack(codes.t(), 0, bits=8), 0, "w", 8), codes.t())


@pytest.mark.parametrize("bits", [2])  # 3: test_int4_checkpoints' refusals
def test_other_gptq_widths_are_refused_by_name(float_models, tmp_path, bits):
    path = int4._broken(float_models, tmp_path, "gptq-v2-sym-g128",
                        config_edit=lambda q: q.update(bits=bits))
    with pytest.raises(ValueError, match=rf"GPTQ bits={bits}, checkpoint_format='gptq_v2' is "
                                         r"not supported \(supported: 4 or 8 bits"):
        load_model(path, torch.float32, CPU)


@pytest.mark.parametrize("bits", [2, 3])
def test_other_compressed_tensors_widths_are_refused_by_name(float_models, tmp_path, bits):
    path = int4._broken(float_models, tmp_path, "ct-sym-g128", config_edit=lambda q: q[
        "config_groups"]["group_0"]["weights"].update(num_bits=bits))
    with pytest.raises(ValueError, match=rf"pack-quantized .*'num_bits': {bits}.*not supported "
                                         r"\(supported: weights: 4- or 8-bit int"):
        load_model(path, torch.float32, CPU)


def test_the_moe_kernel_refuses_eight_bit_experts_by_name(float_models, tmp_path, monkeypatch):
    """The grouped expert GEMMs read 4-bit codes only: with the kernels on, 8-bit experts are
    refused naming the expert and the format (dequantized at load, they serve: above)."""
    from pagedserve.quantization import packed

    w.write_int4(float_models["qwen3_moe"], tmp_path / "int8", tmp_path / "ref",
                 CASES["gptq8-v1-asym-g64-actorder"])
    monkeypatch.setattr(packed, "KERNELS_ON_CPU", True)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.0\.(gate|up|down) is GPTQ "
                                         r"int8 .*: the MoE kernel reads 4-bit codes only"):
        load_model(str(tmp_path / "int8"), torch.float32, CPU)


@pytest.mark.parametrize("case", ["gptq8-v1-asym-g64-actorder", "ct8-asym-g32"])
def test_kernel_layout_runs_a_whole_model_in_eight_bits(float_models, tmp_path, monkeypatch,
                                                        case):
    """The CUDA layout on the CPU (the Triton GEMM with BITS=8 in the interpreter): every
    linear keeps its 8-bit codes, and the logits equal the dequantized path's to float32
    rounding."""
    from pagedserve.quantization import packed
    from tests.quantization.test_fp8_checkpoints import _prompts
    from tests.utils.paged import run_prefill

    w.write_int4(float_models["llama"], tmp_path / "int8", tmp_path / "ref", CASES[case])
    prompts = _prompts(int4.INT4["vocab_size"])
    exact = run_prefill(load_model(str(tmp_path / "int8"), torch.float32, CPU).model, prompts)
    monkeypatch.setattr(packed, "KERNELS_ON_CPU", True)
    model = load_model(str(tmp_path / "int8"), torch.float32, CPU).model
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        assert linear.weight is None and linear.w4a16.bits == 8
        assert linear.quant_method.name.endswith("-> W8A16 kernel")
    for got, want in zip(run_prefill(model, prompts), exact, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
