"""FP8 checkpoints on the CPU: each format, written by the tests' own quantizer (fp8_writer),
loads dequantized into float32, and its greedy tokens equal transformers' on the dequantized
weights. Broken or mislabeled checkpoints are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.models import load_model
from pagedserve.quantization import fp8_linear
from pagedserve.quantization.fp8_format import Fp8Scheme, scale_rank_part
from tests.quantization import fp8_writer as w
from tests.utils.paged import generate_greedy, hf_greedy, run_prefill

CPU = torch.device("cpu")
NUM_NEW = 8
PROMPT_LENS = (5, 19)
COMMON = dict(vocab_size=151, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False)
MLA = {**{k: v for k, v in COMMON.items() if k != "head_dim"}, "num_key_value_heads": 4}


def _config(family: str) -> transformers.PretrainedConfig:
    if family == "llama":
        return transformers.LlamaConfig(**COMMON)
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, norm_topk_prob=True,
                                           mlp_only_layers=[1], decoder_sparse_step=1)
    # DeepSeek-V3: kv_a_proj_with_mqa has 24 + 8 = 32 rows, q_b_proj 4 * 24 = 96: partial
    # 128-blocks everywhere, as the real model's 576-row kv_a_proj_with_mqa.
    return transformers.DeepseekV3Config(
        **MLA, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True)


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    """family -> its float checkpoint directory (built once per module)."""
    out = {}
    for i, family in enumerate(("llama", "qwen3", "qwen3_moe", "deepseek_v3")):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(
            _config(family), attn_implementation="eager", dtype=torch.float32)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = path
    return out


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _check_tokens(path: Path, ref: Path, quantization: str | None = None) -> None:
    """Our greedy tokens from `path` (float32) against transformers' on `ref`."""
    ours = load_model(str(path), torch.float32, CPU, quantization=quantization).model
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ref, attn_implementation="eager", dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    mla = hf.config.model_type.startswith("deepseek")
    got, _ = generate_greedy(ours, prompts, NUM_NEW, "CPU_MLA" if mla else "CPU")
    assert got == [hf_greedy(hf, p, NUM_NEW) for p in prompts]


CASES = {
    # DeepSeek's layout: 128x128 blocks, float32 scale_inv, dynamic activations.
    "native-block-f32": (w.native_config((128, 128), ignored=["lm_head"]), torch.float32),
    # Qwen's releases store the block scales in bfloat16.
    "native-block-bf16": (w.native_config((128, 128)), torch.bfloat16),
    # Small blocks so that many blocks and partial edges meet in a tiny model.
    "native-block-24x40": (w.native_config((24, 40)), torch.float32),
    "native-tensor-static": (w.native_config(None, "static"), torch.float32),
    "ct-channel-dynamic": (w.compressed_config("channel", "dynamic"), torch.float32),
    "ct-tensor-static": (w.compressed_config("tensor", "static"), torch.float32),
    "ct-block-weight-only": (w.compressed_config("block", "none", (128, 128)), torch.float32),
}
# (family, case): every family once in the fast set, the rest slow.
FAST = [("llama", "native-block-24x40"), ("qwen3", "ct-channel-dynamic"),
        ("qwen3_moe", "native-block-bf16"), ("deepseek_v3", "native-block-f32"),
        ("llama", "native-tensor-static")]
SLOW = [("qwen3", "ct-tensor-static"), ("qwen3_moe", "ct-block-weight-only"),
        ("deepseek_v3", "native-block-24x40"), ("llama", "native-block-f32"),
        ("qwen3_moe", "ct-channel-dynamic")]


@pytest.mark.parametrize("family,case", [*FAST, *(pytest.param(*c, marks=pytest.mark.slow)
                                                  for c in SLOW)])
def test_fp8_checkpoint_tokens_equal_transformers_on_dequantized_weights(
        float_models, tmp_path, family, case):
    qconfig, scale_dtype = CASES[case]
    w.write_fp8(float_models[family], tmp_path / "fp8", qconfig, tmp_path / "ref", scale_dtype)
    _check_tokens(tmp_path / "fp8", tmp_path / "ref")


def test_the_engine_serves_an_fp8_checkpoint(float_models, tmp_path, make_llm):
    """Through LLM: the checkpoint's quantization_config is read with --quantization auto, and
    `fp8` agrees with it."""
    from pagedserve import SamplingParams

    w.write_fp8(float_models["qwen3"], tmp_path / "fp8", CASES["ct-channel-dynamic"][0],
                tmp_path / "ref")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ref", attn_implementation="eager", dtype=torch.float32).eval()
    prompts = _prompts(COMMON["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for flag in ("auto", "fp8"):
        llm = make_llm(model=str(tmp_path / "fp8"), dtype="float32", device="cpu",
                       kv_cache_memory="16MiB", quantization=flag)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, NUM_NEW)
                                                            for p in prompts]
    with pytest.raises(ValueError, match=r"already quantized \(compressed-tensors\); "
                                         r"--quantization int8 cannot apply"):
        make_llm(model=str(tmp_path / "fp8"), dtype="float32", device="cpu",
                 kv_cache_memory="16MiB", quantization="int8")


def test_ignored_layers_stay_float(float_models, tmp_path):
    ignored = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
               "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"]
    qconfig = w.native_config((128, 128), ignored=ignored)
    w.write_fp8(float_models["llama"], tmp_path / "fp8", qconfig, tmp_path / "ref")
    model = load_model(str(tmp_path / "fp8"), torch.float32, CPU).model
    assert "quant_method" not in vars(model.model.layers[0].mlp.down_proj)
    assert "quant_method" not in vars(model.model.layers[1].self_attn.qkv_proj)
    assert model.model.layers[0].self_attn.qkv_proj.fp8_kernel == "dequantized"
    _check_tokens(tmp_path / "fp8", tmp_path / "ref")


def test_online_fp8_of_a_float_checkpoint(float_models, tmp_path):
    """--quantization fp8: per-channel FP8 weights made at load (the head stays float)."""
    src = float_models["qwen3"]
    state = load_file(src / "model.safetensors")
    ref = {}
    for name, t in state.items():
        ref[name] = w.quantize(t, "channel")[2] if w.PROJECTIONS.search(name) else t
    (tmp_path / "ref").mkdir()
    save_file(ref, tmp_path / "ref" / "model.safetensors")
    (tmp_path / "ref" / "config.json").write_text((src / "config.json").read_text())
    _check_tokens(src, tmp_path / "ref", quantization="fp8")


# (case, kernels, bound on the logits' relative change). The interpreter's e4m3 cast rounds
# some values down a binade (see test_fp8_kernels), which the Triton path's bound allows for.
KERNEL_CASES = [("qwen3", "native-block-f32", {"triton_block"}, 0.4),
                ("qwen3", "ct-channel-dynamic", {"scaled_mm"}, 0.2),
                ("qwen3", "ct-tensor-static", {"scaled_mm"}, 0.2),
                ("qwen3_moe", "native-block-bf16", {"triton_block", "triton_block_moe"}, 0.4)]


@pytest.mark.parametrize("family,case,kernels,bound", KERNEL_CASES)
def test_kernel_layouts_run_a_whole_model(float_models, tmp_path, monkeypatch, family, case,
                                          kernels, bound):
    """The CUDA layouts, run on the CPU (`torch._scaled_mm`'s CPU path, the Triton GEMM in the
    interpreter): FP8 activations move these logits by ~10 % of the dequantized path's (two
    layers of large random weights; each kernel's exactness is test_fp8_kernels'), a scale in
    the wrong row or block by as much as the logits themselves."""
    qconfig, scale_dtype = CASES[case]
    w.write_fp8(float_models[family], tmp_path / "fp8", qconfig, tmp_path / "ref", scale_dtype)
    prompts = _prompts(COMMON["vocab_size"])
    exact = run_prefill(load_model(str(tmp_path / "fp8"), torch.float32, CPU).model, prompts)
    monkeypatch.setattr(fp8_linear, "KERNELS_ON_CPU", True)
    model = load_model(str(tmp_path / "fp8"), torch.float32, CPU).model
    assert {getattr(m, "fp8_kernel", None) for m in model.modules()} - {None} == kernels
    # Dynamic activations come quantized from the norm and SiLU-and-mul before each layer
    # (layer 1: dense in both families).
    layer = model.model.layers[1]
    fused = [layer.input_layernorm.fp8_group, layer.post_attention_layernorm.fp8_group,
             layer.mlp.fp8_group]
    static = "static" in case
    assert all((g is None) == static for g in fused)
    for got, want in zip(run_prefill(model, prompts), exact, strict=True):
        assert float((got - want).norm() / want.norm()) < bound


# ---- refusals -------------------------------------------------------------------------------

def _broken(float_models, tmp_path, qconfig=None, edit=None, config_edit=None) -> str:
    path = tmp_path / "fp8"
    w.write_fp8(float_models["llama"], path, qconfig or w.native_config((128, 128)),
                tmp_path / "ref")
    if edit:
        state = load_file(path / "model.safetensors")
        edit(state)
        save_file(state, path / "model.safetensors")
    if config_edit:
        config = json.loads((path / "config.json").read_text())
        config_edit(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_kv_cache_scales_are_skipped(float_models, tmp_path):
    """FP8 releases may carry k_scale / v_scale for an FP8 KV cache: not read yet, not an
    error."""
    def add(state):
        state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.1)
        state["model.layers.0.self_attn.v_scale"] = torch.tensor(0.1)

    path = _broken(float_models, tmp_path, edit=add)
    _check_tokens(Path(path), tmp_path / "ref")


REFUSALS = {
    "missing scale": (lambda s: s.pop("model.layers.1.mlp.up_proj.weight_scale_inv"), None,
                      r"lacks 1 tensors.*layers\.1\.mlp\.gate_up_proj\.weight_scale_inv:up"),
    "wrong scale shape": (lambda s: s.update({"model.layers.0.self_attn.o_proj.weight_scale_inv":
                                              torch.ones(2, 1)}), None,
                          r"o_proj\.weight_scale_inv has shape \(2, 1\).*needs \(1, 1\)"),
    "unknown quant_method": (None, lambda q: q.update(quant_method="bitsandbytes"),
                             r"quant_method 'bitsandbytes' is not supported \(supported: fp8, "
                             r"compressed-tensors"),
    "float weights labeled fp8": (
        lambda s: s.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 96)}),
        None, r"down_proj\.weight is torch.float32.*mislabeled"),
    "unsupported scheme": (None, lambda q: q.update(activation_scheme="static"),
                           r"weight_block_size \[128, 128\] with static activations is not "
                           r"supported"),
    "scale of another format": (lambda s: s.update({"model.layers.0.self_attn.o_proj.weight_scale":
                                                    torch.ones(1)}), None,
                                r"o_proj\.weight_scale is not part of FP8 weights block"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_broken_checkpoints_are_refused_by_name(float_models, tmp_path, what):
    edit, config_edit, message = REFUSALS[what]
    path = _broken(float_models, tmp_path, edit=edit, config_edit=config_edit)
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, CPU)


def test_unsupported_compressed_tensors_schemes_are_refused(float_models, tmp_path):
    int4 = w.compressed_config("channel", "dynamic")
    int4["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int")
    with pytest.raises(ValueError, match=r"weights \{num_bits=4, type='int'.*not supported "
                                         r"\(supported: weights: 8-bit float"):
        load_model(_broken(float_models, tmp_path, w.compressed_config("channel", "dynamic"),
                           config_edit=lambda q: q.update(int4)), torch.float32, CPU)
    with pytest.raises(ValueError, match="format 'marlin-24' is not supported"):
        load_model(_broken(float_models, tmp_path / "b", w.compressed_config("channel", "dynamic"),
                           config_edit=lambda q: q.update(format="marlin-24")),
                   torch.float32, CPU)


def test_fp8_weights_without_a_quantization_config_are_refused(float_models, tmp_path):
    path = _broken(float_models, tmp_path, config_edit=lambda q: q.clear())
    config = json.loads((Path(path) / "config.json").read_text())
    config.pop("quantization_config")
    (Path(path) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(weight|weight_scale_inv)' .*no quantization_config"):
        load_model(path, torch.float32, CPU)


def test_a_rank_that_splits_a_block_is_refused():
    scheme = Fp8Scheme("block", "dynamic", (128, 128), "weight_scale_inv")
    scale = torch.ones(4, 2)  # a [512, 256] weight
    assert scale_rank_part(scheme, scale, (0, 256, 256), "w").shape == (2, 2)
    assert scale_rank_part(scheme, scale, (1, 128, 128), "w").shape == (4, 1)
    with pytest.raises(ValueError, match=r"rows 64\.\.128 of the weight, which splits a "
                                         r"128-wide FP8 block"):
        scale_rank_part(scheme, scale, (0, 64, 64), "w")
    # The last rank may end in the weight's partial edge block.
    assert scale_rank_part(scheme, torch.ones(5, 2), (0, 512, 64), "w").shape == (1, 2)


def test_an_unknown_compressed_tensors_format_lists_every_format_taken():
    """pack-quantized (int4 / int8) and int-quantized (int8) are taken too: the refusal of
    another format says so."""
    from pagedserve.quantization.registry import checkpoint_config

    config = {**w.compressed_config("channel", "dynamic"), "format": "nvfp4-pack-quantized"}
    with pytest.raises(ValueError, match=r"format 'nvfp4-pack-quantized' is not supported "
                                         r"\(supported: float-quantized, naive-quantized, "
                                         r"pack-quantized, int-quantized\)"):
        checkpoint_config(config)
