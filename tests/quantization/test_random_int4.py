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

    from pagedserve import LLM
    from pagedserve.models.random_models import random_full_weights, random_model_config

    config = random_model_config("tiny")
    config._attn_implementation = "eager"
    state = {name: (w.quantize(t, 32, sym=True)["deq"] if w.PROJECTIONS.search(name) else t)
             for name, t in random_full_weights(config, torch.float32, CPU, 0)}
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict(state)
    prompt, continuation = list(range(5, 17)), [40, 7, 300, 2, 99]
    with torch.no_grad():
        want = reference(torch.tensor([prompt + continuation])).logits[0].log_softmax(-1)
    with LLM(model=f"random:{gptq_spec(tmp_path)}", device="cpu", dtype="float32") as llm:
        got = llm.score([prompt], [continuation])[0]
    torch.testing.assert_close(got, want[len(prompt) - 1:-1], rtol=0, atol=2e-5)


@pytest.mark.parametrize(("config", "match"), [
    ({"sym": False}, "symmetric"),
    ({"desc_act": True}, "desc_act false"),
    ({"bits": 3}, "bits=3"),  # the GPTQ method's own refusal
    ({"quant_method": "awq"}, "quant_method 'awq' is not made"),
])
def test_what_random_gptq_cannot_make_is_refused(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        load_random_model(gptq_spec(tmp_path, **config), torch.float32, CPU)
