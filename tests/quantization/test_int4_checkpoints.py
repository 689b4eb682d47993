"""4-bit checkpoints on the CPU: AWQ, GPTQ (gptq / gptq_v2, symmetric or not, act-order),
compressed-tensors pack-quantized and gpt-oss's MXFP4 experts, written by the tests' own
packers (int4_writer), load dequantized into float32, and their greedy tokens equal
transformers' on the dequantized weights. Broken checkpoints are refused naming the tensor."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.models import load_model
from tests.quantization import int4_writer as w
from tests.quantization.test_fp8_checkpoints import COMMON, _check_tokens

CPU = torch.device("cpu")
# Inputs of 128 and 256 (hidden, MLP), outputs of 64 and more: groups of 32, 64 and 128 and
# AWQ's eight output columns a word all fit.
INT4 = {**COMMON, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


def _config(family: str) -> transformers.PretrainedConfig:
    if family == "llama":
        return transformers.LlamaConfig(**INT4)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**INT4, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=128, norm_topk_prob=True,
                                           mlp_only_layers=[1], decoder_sparse_step=1)
    return transformers.GptOssConfig(**{**COMMON, "intermediate_size": 64},
                                     num_local_experts=4, num_experts_per_tok=2,
                                     swiglu_limit=1.5, sliding_window=12,
                                     layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    out = {}
    for i, family in enumerate(("llama", "qwen3_moe", "gpt_oss")):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(
            _config(family), attn_implementation="eager", dtype=torch.float32)
        with torch.no_grad():  # transformers starts biases and sinks at zero
            for name, p in model.named_parameters():
                if name.endswith("bias") or "sinks" in name:
                    p.copy_(0.5 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = path
    return out


CASES = {
    "ct-sym-g128": w.ct_config(128, sym=True, act_order=False),
    "ct-asym-g32-actorder": w.ct_config(32, sym=False, act_order=True),
    "ct-sym-channel": w.ct_config(-1, sym=True, act_order=False),
    "ct-asym-channel": w.ct_config(-1, sym=False, act_order=False),
    "awq-g64": w.awq_config(64),
    "awq-g128": w.awq_config(128),
    "gptq-v1-asym-g32-actorder": w.gptq_config(32, sym=False, act_order=True, v1=True),
    "gptq-v2-sym-g128": w.gptq_config(128, sym=True, act_order=False, v1=False),
    "gptq-v1-sym-channel": w.gptq_config(-1, sym=True, act_order=False, v1=True),
    "gptq-v2-asym-g64-actorder": w.gptq_config(64, sym=False, act_order=True, v1=False),
}
FAST = [("llama", "ct-sym-g128"), ("qwen3_moe", "ct-asym-g32-actorder"),
        ("llama", "awq-g64"), ("qwen3_moe", "gptq-v1-asym-g32-actorder"),
        ("llama", "gptq-v2-sym-g128")]
SLOW = [("qwen3_moe", "ct-sym-channel"), ("llama", "ct-asym-channel"),
        ("qwen3_moe", "awq-g128"), ("llama", "gptq-v1-sym-channel"),
        ("llama", "gptq-v2-asym-g64-actorder")]


@pytest.mark.parametrize("family,case", [*FAST, *(pytest.param(*c, marks=pytest.mark.slow)
                                                  for c in SLOW)])
def test_int4_checkpoint_tokens_equal_transformers_on_dequantized_weights(
        float_models, tmp_path, family, case):
    w.write_int4(float_models[family], tmp_path / "int4", tmp_path / "ref", CASES[case])
    _check_tokens(tmp_path / "int4", tmp_path / "ref")


def test_act_order_per_channel_needs_no_g_idx(float_models, tmp_path):
    """desc_act with group_size -1: one group, so the checkpoint may leave g_idx out."""
    config = w.gptq_config(-1, sym=True, act_order=True, v1=True)
    w.write_int4(float_models["llama"], tmp_path / "int4", tmp_path / "ref", config)
    state = load_file(tmp_path / "int4" / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.endswith(".g_idx")},
              tmp_path / "int4" / "model.safetensors")
    _check_tokens(tmp_path / "int4", tmp_path / "ref")


def test_gpt_oss_mxfp4_experts(float_models, tmp_path):
    """gpt-oss as published: MXFP4 experts (stacked, gate and up interleaved), the rest float.
    The tests' packer agrees with transformers' own MXFP4 dequantizer."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w.write_mxfp4(float_models["gpt_oss"], tmp_path / "mxfp4", tmp_path / "ref")
    packed = load_file(tmp_path / "mxfp4" / "model.safetensors")
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{proj}"
        theirs = convert_moe_packed_tensors(packed[f"{name}_blocks"], packed[f"{name}_scales"],
                                            dtype=torch.float32)
        assert torch.equal(theirs, ref[name])
    model = load_model(str(tmp_path / "mxfp4"), torch.float32, CPU).model
    experts = model.model.layers[0].mlp.experts
    assert experts.quant_method.name == "MXFP4 experts, dequantized at load"
    assert "quant_method" not in vars(model.model.layers[0].self_attn.qkv_proj)
    _check_tokens(tmp_path / "mxfp4", tmp_path / "ref")


# ---- refusals -------------------------------------------------------------------------------

def _broken(float_models, tmp_path, case, edit=None, config_edit=None, family="llama") -> str:
    path = tmp_path / "int4"
    w.write_int4(float_models[family], path, tmp_path / "ref", CASES[case])
    if edit:
        state = load_file(path / "model.safetensors")
        edit(state)
        save_file(state, path / "model.safetensors")
    if config_edit:
        config = json.loads((path / "config.json").read_text())
        config_edit(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


L0 = "model.layers.0"
REFUSALS = {
    "act-order without g_idx": (
        "gptq-v1-asym-g32-actorder", lambda s: s.pop(f"{L0}.self_attn.k_proj.g_idx"), None,
        r"lacks 1 tensors.*layers\.0\.self_attn\.qkv_proj\.g_idx:k"),
    "weight_shape against weight_packed": (
        "ct-sym-g128", lambda s: s.update({f"{L0}.mlp.down_proj.weight_shape":
                                           torch.tensor([128, 200])}), None,
        r"layers\.0\.mlp\.down_proj\.weight_shape is \[128, 200\], but .*down_proj\."
        r"weight_packed has shape \(128, 32\)"),
    "group size the layer cannot divide": (
        "awq-g64", None, lambda q: q.update(group_size=96),
        r"layers\.0\.self_attn\.[qkv]_proj: group_size 96 does not divide its 128 input "
        r"columns"),
    "scales of another group size": (
        "gptq-v2-sym-g128", None, lambda q: q.update(group_size=64),
        r"layers\.0\.self_attn\.k_proj\.qzeros has shape \(1, 8\); a \[128, 64\] weight in "
        r"groups of 64 needs \(2, 8\)"),
    "a weight shape the model does not have": (
        "ct-sym-g128", lambda s: s.update({
            f"{L0}.mlp.up_proj.weight_packed": torch.zeros(200, 16, dtype=torch.int32),
            f"{L0}.mlp.up_proj.weight_scale": torch.ones(200, 1, dtype=torch.bfloat16),
            f"{L0}.mlp.up_proj.weight_shape": torch.tensor([200, 128])}), None,
        r"layers\.0\.mlp\.up_proj dequantized: .*shape \(200, 128\), the model expects "
        r"\(256, 128\)"),
    "a float weight where the config says packed": (
        "awq-g64", lambda s: s.update({f"{L0}.self_attn.o_proj.weight": torch.zeros(128, 128)}),
        None, r"o_proj\.weight is not part of AWQ int4, group 64 \(expected qweight, qzeros, "
              r"scales\)"),
    "an unsupported GPTQ width": ("gptq-v2-sym-g128", None, lambda q: q.update(bits=3),
                                  r"GPTQ bits=3, checkpoint_format='gptq_v2' is not supported "
                                  r"\(supported: 4 or 8 bits"),
    "AWQ's gemv layout": ("awq-g64", None, lambda q: q.update(version="gemv"),
                          r"AWQ bits=4, version='gemv'.*not supported"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_broken_checkpoints_are_refused_by_name(float_models, tmp_path, what):
    case, edit, config_edit, message = REFUSALS[what]
    path = _broken(float_models, tmp_path, case, edit, config_edit)
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, CPU)


def test_mxfp4_without_its_config_is_refused(float_models, tmp_path):
    w.write_mxfp4(float_models["gpt_oss"], tmp_path / "mxfp4", tmp_path / "ref")
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"expert 0's (gate|up|down) 'blocks': a float MoE "
                                         r"layer loads weights only"):
        load_model(str(tmp_path / "mxfp4"), torch.float32, CPU)


@pytest.mark.parametrize("case", ["awq-g64", "gptq-v2-sym-g128", "ct-sym-g128"])
def test_int4_without_its_config_is_refused_naming_the_tensor(float_models, tmp_path, case):
    path = _broken(float_models, tmp_path, case, config_edit=lambda q: q.clear())
    config = json.loads((tmp_path / "int4" / "config.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "int4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.\d+\.\w+\.\w+\."
                                         r"\w+' has no parameter.*a quantized checkpoint's "
                                         r"tensor, but the model's config\.json has no "
                                         r"quantization_config"):
        load_model(path, torch.float32, CPU)


def test_mxfp4_is_refused_for_other_families(float_models, tmp_path):
    path = _broken(float_models, tmp_path, "awq-g64",
                   config_edit=lambda q: (q.clear(), q.update(w.mxfp4_config())))
    with pytest.raises(ValueError, match="MXFP4 experts are read for gpt-oss only, not "
                                         "LlamaForCausalLM"):
        load_model(path, torch.float32, CPU)


def test_packers_agree_with_the_formats_descriptions():
    """Hand-made words: GPTQ / compressed-tensors nibble i is element 8c+i; AWQ's nibbles
    hold columns 0, 2, 4, 6, 1, 3, 5, 7."""
    from pagedserve.quantization.awq import _columns
    from pagedserve.quantization.int_codes import unpack_int32

    codes = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    words = w.pack(codes, 1)
    assert words[0, 0] == 0x76543210
    assert torch.equal(unpack_int32(words, 1, "w"), codes)
    awq = w.pack(codes, 1, w.AWQ_NIBBLE_COLUMNS)
    assert awq[0, 0] == 0x75316420
    assert torch.equal(_columns(awq, "w"), codes)
    assert torch.equal(unpack_int32(w.pack(codes.t(), 0), 0, "w"), codes.t())


@pytest.mark.parametrize("family,case", [("llama", "awq-g64"),
                                         ("qwen3_moe", "gptq-v1-asym-g32-actorder"),
                                         ("llama", "ct-asym-channel")])
def test_kernel_layout_runs_a_whole_model(float_models, tmp_path, monkeypatch, family, case):
    """The CUDA layout on the CPU (the Triton W4A16 GEMM and the grouped expert GEMMs in the
    interpreter): every linear keeps its codes (act-order parts share their input's order),
    Qwen3-MoE's act-order experts theirs with a group map per expert, and the logits equal the
    dequantized path's to float32 rounding (a code, zero or group in the wrong place moves them
    by as much as the logits themselves)."""
    from pagedserve.quantization import packed
    from tests.quantization.test_fp8_checkpoints import _prompts
    from tests.utils.paged import run_prefill

    w.write_int4(float_models[family], tmp_path / "int4", tmp_path / "ref", CASES[case])
    prompts = _prompts(INT4["vocab_size"])
    exact = run_prefill(load_model(str(tmp_path / "int4"), torch.float32, CPU).model, prompts)
    monkeypatch.setattr(packed, "KERNELS_ON_CPU", True)
    model = load_model(str(tmp_path / "int4"), torch.float32, CPU).model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None and layer.self_attn.o_proj.weight is None
    assert "W4A16 kernel" in layer.self_attn.qkv_proj.quant_method.name
    if family == "qwen3_moe":
        experts = layer.mlp.experts
        assert experts.quant_method.name.endswith("experts -> 4-bit MoE kernel")
        assert all(p.g_idx is not None for p in experts.w4_experts)  # act-order: maps
    for got, want in zip(run_prefill(model, prompts), exact, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_the_engine_serves_an_int4_checkpoint(float_models, tmp_path, make_llm):
    """Through LLM with --quantization auto; a flag on top of the checkpoint's is refused."""
    from pagedserve import SamplingParams
    from tests.quantization.test_fp8_checkpoints import NUM_NEW, _prompts
    from tests.utils.paged import hf_greedy

    w.write_int4(float_models["llama"], tmp_path / "int4", tmp_path / "ref", CASES["awq-g64"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ref", attn_implementation="eager", dtype=torch.float32).eval()
    prompts = _prompts(INT4["vocab_size"])
    llm = make_llm(model=str(tmp_path / "int4"), dtype="float32", device="cpu",
                   kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, NUM_NEW)
                                                        for p in prompts]
    with pytest.raises(ValueError, match=r"already quantized \(awq\); --quantization fp8 "
                                         r"cannot apply"):
        make_llm(model=str(tmp_path / "int4"), dtype="float32", device="cpu",
                 kv_cache_memory="16MiB", quantization="fp8")


@pytest.mark.parametrize("family,case", [("gpt_oss", "mxfp4"), ("qwen3_moe", "awq-g64"),
                                         pytest.param("qwen3_moe", "ct-asym-channel",
                                                      marks=pytest.mark.slow),
                                         pytest.param("qwen3_moe", "ct-asym-g32-actorder",
                                                      marks=pytest.mark.slow)])
def test_moe_kernel_runs_a_whole_model(float_models, tmp_path, monkeypatch, family, case):
    """The CUDA layout of 4-bit experts on the CPU (the grouped expert GEMMs in the
    interpreter): MXFP4 (gpt-oss: clamped SwiGLU, biases) and int4 experts (compressed-tensors'
    group act-order too; GPTQ's in test_kernel_layout_runs_a_whole_model) keep their codes, no
    float experts are allocated, and the logits equal the dequantized path's."""
    from pagedserve.quantization import packed
    from tests.quantization.test_fp8_checkpoints import _prompts
    from tests.utils.paged import run_prefill

    if case == "mxfp4":
        w.write_mxfp4(float_models[family], tmp_path / "int4", tmp_path / "ref")
    else:
        w.write_int4(float_models[family], tmp_path / "int4", tmp_path / "ref", CASES[case])
    prompts = _prompts(INT4["vocab_size"])
    exact = run_prefill(load_model(str(tmp_path / "int4"), torch.float32, CPU).model, prompts)
    monkeypatch.setattr(packed, "KERNELS_ON_CPU", True)
    model = load_model(str(tmp_path / "int4"), torch.float32, CPU).model
    experts = model.model.layers[0].mlp.experts
    assert experts.quant_method.name.endswith("experts -> 4-bit MoE kernel")
    assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
    for got, want in zip(run_prefill(model, prompts), exact, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_vllm_marlin_names_are_the_format_they_run():
    """`--quantization awq_marlin` / `gptq_marlin` (vLLM commands say so): the format's
    check; the command line refused them as no choice."""
    import argparse

    from pagedserve.arg_utils import add_engine_args, engine_config
    from pagedserve.quantization.registry import resolve_quantization

    assert resolve_quantization("awq_marlin", "model_dir", "auto", CPU) == "awq"
    assert resolve_quantization("GPTQ_Marlin", "model_dir", "auto", CPU) == "gptq"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--quantization", "gptq_marlin"])
    assert engine_config(args).model.quantization == "gptq_marlin"


def test_the_checkpoint_format_as_vllm_names_it_in_the_flag(float_models, tmp_path):
    """`--quantization awq` on an AWQ checkpoint (a vLLM habit) loads it; on a checkpoint of
    another format, or none, it is refused naming both."""
    from pagedserve.quantization.registry import resolve_quantization

    w.write_int4(float_models["llama"], tmp_path / "int4", tmp_path / "ref", CASES["awq-g64"])
    assert resolve_quantization("awq", str(tmp_path / "int4"), "float32", CPU) == "awq"
    load_model(str(tmp_path / "int4"), torch.float32, CPU, quantization="awq")
    with pytest.raises(ValueError, match=r"--quantization gptq names the checkpoint's format, "
                                         r"but its quantization_config says awq"):
        load_model(str(tmp_path / "int4"), torch.float32, CPU, quantization="gptq")
    with pytest.raises(ValueError, match=r"--quantization awq names the checkpoint's format, "
                                         r"but it has no quantization_config"):
        load_model(str(float_models["llama"]), torch.float32, CPU, quantization="awq")
    with pytest.raises(ValueError, match=r"--quantization awq names a quantized checkpoint's "
                                         r"format; 'x.gguf' is a GGUF file"):
        resolve_quantization("awq", "x.gguf", "auto", CPU)
