"""`random:<config file>` with a GPTQ quantization_config: the float model's very weights,
each projection packed as a GPTQ checkpoint holds it and loaded through the GPTQ method (the
4-bit rows of the engine's benchmarks at a real shape without a checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.models.loader import load_random_model
from tests.quantization import int4_writer as w

CPU = torch.device("cpu")


def gptq_spec(tmp_path, group_size: int = 32, bits: int = 4, **extra) -> str:
    path = tmp_path / f"tiny-gptq-{bits}-{group_size}.json"
    path.write_text(json.dumps({"base": "tiny", "quantization_config": {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": True,
        "desc_act": False, **extra}}))
    return str(path)


@pytest.mark.parametrize(("bits", "v1"), [(4, True), (8, False)])
def test_random_gptq_weights_are_the_float_models_quantized(tmp_path, bits, v1):
    exact = load_random_model("tiny", torch.float32, CPU).model
    extra = {} if v1 else {"checkpoint_format": "gptq_v2"}
    packed = load_random_model(gptq_spec(tmp_path, bits=bits, **extra), torch.float32,
                               CPU).model
    for get in (lambda m: m.model.layers[1].mlp.gate_up_proj,
                lambda m: m.model.layers[0].self_attn.qkv_proj,
                lambda m: m.model.layers[0].self_attn.o_proj):
        want = get(exact).weight.detach()
        # The tests' own quantizer (written apart from the engine's packer), per output row.
        deq = w.quantize(want, 32, sym=True, bits=bits)["deq"]
        torch.testing.assert_close(get(packed).weight, deq, rtol=0, atol=0)
    torch.testing.assert_close(packed.lm_head.weight, exact.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(packed.model.embed_tokens.weight,
                               exact.model.embed_tokens.weight, rtol=0, atol=0)


def test_random_gptq_engine_equals_transformers_on_the_codes_values(tmp_path):
    """The engine over the packed random model scores as transformers' eager Llama whose
    weights are the codes' values, drawn and quantized apart (float32 on the CPU, where GPTQ
    dequantizes at load)."""
    from transformers import LlamaForCausalLM

    from pagedserve.models.random_models import random_full_weights, random_model_config

    config = random_model_config("tiny")
    config._attn_implementation = "eager"
    state = {name: (w.quantize(t, 32, sym=True)["deq"] if w.PROJECTIONS.search(name) else t)
             for name, t in random_full_weights(config, torch.float32, CPU, 0)}
    assert_scores_as_transformers(gptq_spec(tmp_path), LlamaForCausalLM(config), state, 12,
                                  2e-5)


def assert_scores_as_transformers(spec: str, reference: torch.nn.Module, state: dict,
                                  prompt_len: int, atol: float) -> None:
    """The engine over `random:spec` scores a continuation as transformers' eager `reference`
    with the weights `state` (float32, CPU)."""
    from pagedserve import LLM

    reference.eval().load_state_dict(state)
    prompt, continuation = list(range(5, 5 + prompt_len)), [40, 7, 300, 2, 99]
    with torch.no_grad():
        want = reference(torch.tensor([prompt + continuation])).logits[0].log_softmax(-1)
    with LLM(model=f"random:{spec}", device="cpu", dtype="float32") as llm:
        got = llm.score([prompt], [continuation])[0]
    torch.testing.assert_close(got, want[len(prompt) - 1:-1], rtol=0, atol=atol)


@pytest.mark.parametrize(("config", "match"), [
    ({"sym": False}, "symmetric"),
    ({"desc_act": True}, "desc_act false"),
    ({"bits": 3}, "bits 3"),
    ({"quant_method": "awq"}, "quant_method 'awq' is not made"),
])
def test_what_random_gptq_cannot_make_is_refused(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        load_random_model(gptq_spec(tmp_path, **config), torch.float32, CPU)


TINY_GPT_OSS = {
    "model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 12,
    "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.5,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False}}


def test_mxfp4_packer_equals_the_tests_own():
    from pagedserve.quantization.random_packed import mxfp4_tensors

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 128, generator=g) * torch.logspace(-3, 1, 6)[:, None]
    rows[0, :32] = 0.0  # an all-zero block
    rows[1, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0])  # ties, the max
    blocks, scales = mxfp4_tensors(rows)
    want_blocks, want_scales, _ = w.mxfp4(rows)
    assert torch.equal(blocks, want_blocks) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_random_gpt_oss_engine_equals_transformers(tmp_path, mxfp4):
    """A random gpt-oss (its weights under transformers' names: experts transposed, gate and
    up interleaved, router and sinks renamed) scores as transformers' eager model on the same
    values; with an MXFP4 quantization_config, on the experts' codes' values (the tests' own
    quantizer)."""
    from transformers import GptOssForCausalLM

    from pagedserve.models.random_models import random_full_weights, random_model_config

    spec = tmp_path / "gpt-oss.json"
    fields = {**TINY_GPT_OSS, **({"quantization_config": {"quant_method": "mxfp4"}}
                                 if mxfp4 else {})}
    spec.write_text(json.dumps(fields))
    config = random_model_config(str(tmp_path / "gpt-oss.json"))
    config.quantization_config = None
    config._attn_implementation = "eager"
    state = dict(random_full_weights(config, torch.float32, CPU, 0))
    if mxfp4:
        for name, t in state.items():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                state[name] = w.mxfp4(t.transpose(1, 2))[2].transpose(1, 2)
    assert_scores_as_transformers(str(spec), GptOssForCausalLM(config), state, 25, 5e-5)
