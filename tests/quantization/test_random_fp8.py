"""`random:<preset>` with --quantization fp8: the float model's very weights, each quantized per
output row as it is made (so a 70B shape never holds its bf16 weights)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.models.loader import load_random_model
from pagedserve.quantization import fp8_linear
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
    monkeypatch.setattr(fp8_linear, "KERNELS_ON_CPU", True)
    kept = load_random_model("tiny", torch.bfloat16, CPU, quantization="fp8").model
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.fp8_kernel == "scaled_mm"
    assert qkv.weight_scale.shape == (qkv.out_features,)


def test_fp8_activations_make_the_graph_check_log_not_refuse(monkeypatch, caplog):
    """A model whose layers round their inputs to FP8 turns a rounding-sized difference
    between batch sizes into flipped codes: the padded-vs-unpadded check logs it (as for
    routed experts) where a plain model's start-up would refuse its graphs."""
    from pagedserve.engine.cuda_graphs import amplifies_rounding, check_padded_replay

    assert not amplifies_rounding(load_random_model("tiny", torch.float32, CPU).model)
    # On the CPU the weights are dequantized: nothing rounds the activations.
    assert not amplifies_rounding(
        load_random_model("tiny", torch.float32, CPU, quantization="fp8").model)
    monkeypatch.setattr(fp8_linear, "KERNELS_ON_CPU", True)
    assert amplifies_rounding(
        load_random_model("tiny", torch.bfloat16, CPU, quantization="fp8").model)

    with pytest.raises(RuntimeError, match="differ from the unpadded forward by 0.334"):
        check_padded_replay("decode graphs", 0.0, 0.334, 0.05, 0.25, False)
    with caplog.at_level("INFO"):
        check_padded_replay("decode graphs", 0.0, 0.334, 0.05, 0.25, True)
    assert "FP8 activations" in caplog.text
    for bad in (0.06, float("nan")):  # the replay itself stays checked
        with pytest.raises(RuntimeError, match="the replay differs"):
            check_padded_replay("decode graphs", bad, 0.0, 0.05, 0.25, True)


@pytest.mark.gpu
def test_gpu_engine_serves_random_fp8_next_to_bf16(make_llm):
    """The FP8 layouts and fused inputs on CUDA, with CUDA graphs: the kernels named at
    start-up are the ones that run, and the FP8 engine's log-distributions on bf16's greedy
    continuations stay near bf16's on the same weights (a wrong scale moves them by as much as
    they spread)."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 37)]
    scores, continuations = {}, None
    # Both engines live until the test ends; each one's budget is its own fraction of the
    # device (what the other holds is not its peak), small beside the other GPU tests' shards.
    for quantization, fraction in (("none", 0.05), ("fp8", 0.05)):
        llm = make_llm(model="random:tiny", device="cuda", dtype="bfloat16",
                       quantization=quantization, gpu_memory_utilization=fraction)
        if continuations is None:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            continuations = [list(o.outputs[0].token_ids) for o in outs]
        scores[quantization] = llm.score(prompts, continuations)
        if quantization == "fp8":
            layer = llm.engine.runner.model.model.layers[0]
            assert layer.self_attn.qkv_proj.fp8_kernel == "scaled_mm"
            assert layer.input_layernorm.fp8_group == 128  # per token over hidden 128
            assert layer.mlp.fp8_group == 256
    for ref, got in zip(scores["none"], scores["fp8"], strict=True):
        ref = ref - ref.mean(-1, keepdim=True)
        got = got - got.mean(-1, keepdim=True)
        assert float((got - ref).norm() / ref.norm()) < 0.3


def test_random_fp8_experts_are_block_quantized(monkeypatch, tmp_path):
    spec = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                max_position_embeddings=64, tie_word_embeddings=False)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(spec))
    exact = load_random_model(str(path), torch.float32, CPU).model
    fp8 = load_random_model(str(path), torch.float32, CPU, quantization="fp8").model
    want = exact.model.layers[0].mlp.experts.down_proj[2].detach()
    got = fp8.model.layers[0].mlp.experts.down_proj[2]
    torch.testing.assert_close(got, w.quantize(want, "block", (128, 128))[2], rtol=0, atol=0)
    monkeypatch.setattr(fp8_linear, "KERNELS_ON_CPU", True)
    kept = load_random_model(str(path), torch.float32, CPU, quantization="fp8").model
    assert kept.model.layers[0].mlp.experts.fp8_kernel == "triton_block_moe"
