"""8-bit integer weights with 16-bit activations (W8A16) on the CPU: GPTQ 8-bit (gptq /
gptq_v2, symmetric or not, act-order) and compressed-tensors pack-quantized with num_bits 8
(symmetric or not) or int-quantized / naive-quantized (unpacked int8; per channel, group or
tensor), written by the tests' own packers (int4_writer), load dequantized into float32, and
their greedy tokens equal transformers' on the dequantized weights. The 4-bit MoE kernel
refuses 8-bit experts by name; other widths, and int8 activation quantization (W8A8), are
refused by name at the config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

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
    # int-quantized / naive-quantized: int8 as it is, not packed in words
    "int8-sym-channel": w.ct_int8_config(-1, sym=True),
    "int8-asym-g32": w.ct_int8_config(32, sym=False),
    "int8-sym-g64-actorder-naive": w.ct_int8_config(64, sym=True, act_order=True,
                                                    fmt="naive-quantized"),
    "int8-asym-tensor": w.ct_int8_config(None, sym=False),
}


@pytest.mark.parametrize("family,case", [
    ("llama", "gptq8-v1-sym-g128"), ("llama", "gptq8-v2-asym-g32"),
    ("qwen3_moe", "gptq8-v1-asym-g64-actorder"), ("llama", "ct8-sym-g128"),
    ("qwen3_moe", "ct8-asym-g32"), ("llama", "int8-sym-channel"), ("llama", "int8-asym-g32"),
    ("qwen3_moe", "int8-sym-g64-actorder-naive"), ("llama", "int8-asym-tensor"),
    pytest.param("llama", "ct8-asym-g64-actorder", marks=pytest.mark.slow)])
def test_int8_checkpoint_tokens_equal_transformers_on_dequantized_weights(
        float_models, tmp_path, family, case):
    w.write_int4(float_models[family], tmp_path / "int8", tmp_path / "ref", CASES[case])
    model = load_model(str(tmp_path / "int8"), torch.float32, CPU).model
    name = model.model.layers[0].self_attn.qkv_proj.quant_method.name
    assert ("GPTQ int8" if case.startswith("gptq") else "compressed-tensors int8") in name
    if case.startswith("int8"):
        strategy = CASES[case]["config_groups"]["group_0"]["weights"]["strategy"]
        assert {"group": "group ", "channel": "per channel", "tensor": "per tensor"}[
            strategy] in name
        experts = getattr(model.model.layers[0].mlp, "experts", None)
        if experts is not None:  # the MoE path dequantizes int8 experts too
            assert experts.quant_method.name.startswith("compressed-tensors int8")
    _check_tokens(tmp_path / "int8", tmp_path / "ref")


def test_eight_bit_packers_agree_with_the_formats_descriptions():
    """Hand-made words: four 8-bit codes a word, code i in bits 8i..8i+7, along either dim;
    a code of 255 in the top byte makes the word negative and still reads back."""
    from pagedserve.quantization.int_codes import unpack_int32

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


@pytest.mark.parametrize("case,fmt", [("gptq8-v1-asym-g64-actorder", "GPTQ int8"),
                                      ("int8-asym-g32", "compressed-tensors int8")])
def test_the_moe_kernel_refuses_eight_bit_experts_by_name(float_models, tmp_path, monkeypatch,
                                                          case, fmt):
    """The grouped expert GEMMs read 4-bit codes only: with the kernels on, 8-bit experts are
    refused naming the expert and the format (dequantized at load, they serve: above)."""
    from pagedserve.quantization import packed

    w.write_int4(float_models["qwen3_moe"], tmp_path / "int8", tmp_path / "ref", CASES[case])
    monkeypatch.setattr(packed, "KERNELS_ON_CPU", True)
    with pytest.raises(ValueError, match=rf"layers\.0\.mlp\.experts\.0\.(gate|up|down) is {fmt} "
                                         r".*: the MoE kernel reads 4-bit codes only"):
        load_model(str(tmp_path / "int8"), torch.float32, CPU)


@pytest.mark.parametrize("case", ["gptq8-v1-asym-g64-actorder", "ct8-asym-g32",
                                  "int8-asym-g32", "int8-sym-channel"])
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


def test_int_quantized_tensors_are_the_published_layout(float_models, tmp_path):
    """What llm-compressor writes for int-quantized: `weight` int8 [N, K] (the signed codes),
    `weight_scale` [N, K / group], `weight_zero_point` int8 shaped as the scale, nothing
    packed; and (weight - zero point) * scale is the reference's weight."""
    w.write_int4(float_models["llama"], tmp_path / "int8", tmp_path / "ref",
                 CASES["int8-asym-g32"])
    state, ref = load_file(tmp_path / "int8" / "model.safetensors"), \
        load_file(tmp_path / "ref" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    q, scale, zp = (state[f"{name}.{t}"] for t in ("weight", "weight_scale", "weight_zero_point"))
    n, k = ref[f"{name}.weight"].shape
    assert (q.dtype, tuple(q.shape)) == (torch.int8, (n, k))
    assert (scale.dtype, tuple(scale.shape)) == (torch.bfloat16, (n, k // 32))
    assert (zp.dtype, tuple(zp.shape)) == (torch.int8, (n, k // 32))
    assert f"{name}.weight_packed" not in state
    deq = (q.float() - zp.float().repeat_interleave(32, 1)) * scale.float().repeat_interleave(32, 1)
    assert torch.equal(deq, ref[f"{name}.weight"])


def _broken_int8(float_models, tmp_path, case, edit=None, config_edit=None) -> str:
    path = tmp_path / "int8"
    w.write_int4(float_models["llama"], path, tmp_path / "ref", CASES[case])
    if edit:
        state = load_file(path / "model.safetensors")
        edit(state)
        save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    if config_edit:
        config = json.loads((path / "config.json").read_text())
        config_edit(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _group(q):
    return q["config_groups"]["group_0"]


DOWN = "model.layers.0.mlp.down_proj"
INT8_REFUSALS = {
    "w8a8": ("int8-sym-channel", None, lambda q: _group(q).update(input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
        r"compressed-tensors int-quantized with input_activations .*'type': 'int'.* \(int8 "
        r"activation quantization, W8A8\) is not supported"),
    "w8a8-naive": ("int8-sym-channel", None, lambda q: (q.update(format="naive-quantized"),
                                                       _group(q).update(input_activations={
        "num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False})),
        r"compressed-tensors naive-quantized with input_activations .*W8A8"),
    "4-bit": ("int8-sym-channel", None, lambda q: _group(q)["weights"].update(num_bits=4),
              r"int-quantized targets \['Linear'\], weights \{'num_bits': 4.* not supported "
              r"\(supported: weights: 8-bit int"),
    "float-weight": ("int8-sym-channel",
                     lambda s: s.update({f"{DOWN}.weight": s[f"{DOWN}.weight"].float()}), None,
                     rf"{DOWN}\.weight is torch\.float32 .*int8 \[out, in\]"),
    "scale-shape": ("int8-asym-g32",
                    lambda s: s.update({f"{DOWN}.weight_scale": s[f"{DOWN}.weight_scale"][:, :1]}),
                    None, rf"{DOWN}\.weight_scale has shape \(\d+, 1\); a \[\d+, \d+\] weight "
                    r"in groups of 32 needs"),
    "zero-point-shape": ("int8-asym-g32", lambda s: s.update(
        {f"{DOWN}.weight_zero_point": s[f"{DOWN}.weight_zero_point"].t().contiguous()}), None,
        rf"{DOWN}\.weight_zero_point has shape"),
    "tensor-scale": ("int8-asym-tensor", lambda s: s.update(
        {f"{DOWN}.weight_scale": s[f"{DOWN}.weight_scale"].repeat(2)}), None,
        rf"{DOWN}\.weight_scale has shape \(2,\); a per-tensor weight needs one value"),
    "symmetric-zero-point": ("int8-sym-channel", lambda s: s.update(
        {f"{DOWN}.weight_zero_point": torch.ones_like(s[f"{DOWN}.weight_scale"],
                                                      dtype=torch.int8)}), None,
        rf"{DOWN}\.weight_zero_point is not all zero, but the config says the weights are "
        r"symmetric"),
}


def test_a_symmetric_weights_zero_points_of_zero_are_read(float_models, tmp_path):
    """Older compressed-tensors releases saved symmetric zero points (all zero) too."""
    def add_zero_points(state):
        for name in [n for n in state if n.endswith(".weight_scale")]:
            state[name.replace("_scale", "_zero_point")] = torch.zeros_like(
                state[name], dtype=torch.int8)

    path = _broken_int8(float_models, tmp_path, "int8-sym-channel", add_zero_points)
    _check_tokens(path, tmp_path / "ref")


@pytest.mark.parametrize("what", list(INT8_REFUSALS))
def test_int_quantized_checkpoints_we_cannot_run_are_refused_by_name(float_models, tmp_path,
                                                                    what):
    case, edit, config_edit, message = INT8_REFUSALS[what]
    path = _broken_int8(float_models, tmp_path, case, edit, config_edit)
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, CPU)


def test_naive_quantized_fp8_still_reads_as_fp8():
    """naive-quantized holds FP8 or int8: its weights' type picks the reader."""
    from pagedserve.quantization.compressed_tensors import CompressedTensorsConfig
    from pagedserve.quantization.compressed_tensors_int8 import CompressedTensorsInt8Config
    from pagedserve.quantization.registry import checkpoint_config

    config = w.ct_int8_config(-1, sym=True, fmt="naive-quantized")
    assert isinstance(checkpoint_config(config), CompressedTensorsInt8Config)
    _group(config)["weights"].update(type="float")
    assert isinstance(checkpoint_config(config), CompressedTensorsConfig)
