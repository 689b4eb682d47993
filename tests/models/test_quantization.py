"""Weight-only int8 linears on the CPU: the matmul against its float reference, which layers a
model hands over (the tied head included), when `auto` chooses it, and the bundled GGUF served
with it by default."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.models.checkpoint_loading import hf_state_dict
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loader import build_model
from pagedserve.quantization.int8_cpu import INT8, int8_linear
from pagedserve.quantization.registry import resolve_quantization

CPU = torch.device("cpu")


def test_int8_linear_matches_its_dequantized_weights() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=True)
    q = int8_linear(linear.weight.data, linear.bias.data)
    x = torch.randn(5, 96)
    dequantized = q.codes.float() * q.scale.float()[:, None]
    want = x.bfloat16().float() @ dequantized.T + q.bias.float()
    got = q(x).float()
    assert got.shape == (5, 40)
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    # int8 codes of the weights themselves: within half a step of the scale the kernel reads.
    step = q.scale.float()[:, None]
    assert ((dequantized - linear.weight).abs() <= step / 2 + 1e-7).all()
    assert q.codes.abs().max() <= 127
    assert q(x.reshape(1, 5, 96)).shape == (1, 5, 40)


def test_a_model_hands_every_linear_over_with_its_tied_head() -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, tie_word_embeddings=True,
                                      architectures=["LlamaForCausalLM"])
    float_model = LlamaForCausalLM(config)
    weights = hf_state_dict(float_model)
    model = build_model(config, torch.float32, CPU, iter(weights.items()), "int8")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 4 + 1 and all(m.quant_method is INT8 for m in linears)
    assert all(m.weight is None for m in linears)  # the codes replace the float weight
    assert model.lm_head.codes.shape == (64, 32)
    hidden = torch.randn(3, 32)
    want = hidden @ float_model.model.embed_tokens.weight.detach().T
    tolerance = 0.02 * float(want.abs().max())
    torch.testing.assert_close(model.lm_head(hidden), want, rtol=0, atol=tolerance)


def test_auto_chooses_int8_for_a_gguf_on_the_cpu_only_when_the_dtype_is_left_free() -> None:
    cuda = torch.device("cuda")
    assert resolve_quantization("auto", None, "auto", CPU) == "int8"  # the bundled GGUF
    assert resolve_quantization("auto", "m.gguf", "auto", CPU) == "int8"
    assert resolve_quantization("auto", "m.gguf", "float32", CPU) is None
    assert resolve_quantization("auto", "model_dir", "auto", CPU) is None
    assert resolve_quantization("auto", "m.gguf", "auto", cuda) is None
    assert resolve_quantization("none", None, "auto", CPU) is None
    assert resolve_quantization("int8", "model_dir", "float32", CPU) == "int8"
    with pytest.raises(ValueError, match="CPU's weight-only path"):
        resolve_quantization("int8", None, "auto", cuda)
    with pytest.raises(ValueError, match="'int4' is not one of"):
        resolve_quantization("int4", None, "auto", CPU)


def test_bundled_model_runs_int8_by_default_and_float32_on_request(make_llm) -> None:
    from pagedserve import SamplingParams

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=12)
    fast = make_llm(kv_cache_memory="64MiB")
    assert fast.engine.runner.dtype == torch.float32  # activations; the products in bf16
    assert fast.engine.runner.model.lm_head.quant_method is INT8
    assert "Paris" in fast.chat(chat, params, use_tqdm=False)[0].outputs[0].text
    exact = make_llm(dtype="float32", kv_cache_memory="64MiB")
    assert exact.engine.runner.dtype == torch.float32
    assert not any(getattr(m, "quant_method", None) is INT8
               for m in exact.engine.runner.model.modules())
