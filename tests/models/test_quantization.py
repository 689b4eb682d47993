"""Weight-only int8 linears on the CPU: the matmul against its float reference, which layers a
model hands over (the tied head included), when `auto` chooses it, and the bundled GGUF served
with it by default."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.quantization import Int8Linear, quantize_linears_, resolve_quantization

CPU = torch.device("cpu")


def test_int8_linear_matches_its_dequantized_weights() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=True)
    q = Int8Linear(linear.weight, linear.bias, torch.bfloat16)
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
                                      num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.quantize_("int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    assert model.lm_head.codes.shape == (64, 32)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert quantize_linears_(module, torch.float32) == 2


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
    assert isinstance(fast.engine.runner.model.lm_head, Int8Linear)
    assert "Paris" in fast.chat(chat, params, use_tqdm=False)[0].outputs[0].text
    exact = make_llm(dtype="float32", kv_cache_memory="64MiB")
    assert exact.engine.runner.dtype == torch.float32
    assert not any(isinstance(m, Int8Linear) for m in exact.engine.runner.model.modules())
