"""LoRA adapters over a vision-language model's decoder (CPU, float32): a PEFT adapter made
on transformers' whole Qwen2.5-VL (its modules under `model.language_model.`) applies to the
decoder's layers; one batch mixing the base and the adapter, each with images, gives the
greedy tokens and top-5 logprobs of transformers' model and of the PeftModel. An adapter of
the vision tower is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.lora import LoRARequest
from tests.multimodal.qwen_vl_fixtures import (
    IMAGE,
    image_prompt,
    images,
    save_qwen_tokenizer,
    save_tiny_qwen2_5_vl,
)
from tests.utils.paged import check_top_logprobs

NEW = 4
DECODER = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def _adapter(base, path, target_modules, seed=1):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=target_modules,
                        init_lora_weights=False)
    peft = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # factors large enough to move the logits
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)
    peft.save_pretrained(path)
    return peft.eval()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    root = tmp_path_factory.mktemp("vlm_lora")
    path = save_tiny_qwen2_5_vl(root / "base")
    save_qwen_tokenizer(path)
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager").eval()
    return root, path, base, _adapter(base, root / "decoder", DECODER)


@torch.no_grad()
def _reference(model, llm, request):
    prompt = llm.engine.mm_processor.process(request["prompt_token_ids"],
                                             request["multi_modal_data"]["image"])
    feats = prompt.features
    extra = dict(pixel_values=torch.cat([f.data["pixel_values"] for f in feats]),
                 image_grid_thw=torch.stack([f.data["image_grid_thw"] for f in feats]))
    ids = torch.tensor([prompt.prompt_token_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         mm_token_type_ids=(ids == IMAGE).int(), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
    logits = model(input_ids=out, mm_token_type_ids=(out == IMAGE).int(), **extra).logits[0]
    n = ids.shape[1]
    return out[0, n:].tolist(), torch.log_softmax(logits[n - 1:-1], dim=-1)


def test_adapter_over_the_decoder_of_a_vision_language_model(vlm):
    root, path, base, peft = vlm
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB",
              enable_lora=True, max_lora_rank=8, max_loras=1, enable_prefix_caching=True)
    ims = images()
    requests = [{"prompt_token_ids": image_prompt([3, 4], [5, 6]),
                 "multi_modal_data": {"image": [ims[0]]}},
                {"prompt_token_ids": image_prompt([8], [9], [10]),
                 "multi_modal_data": {"image": [ims[2], ims[1]]}}]
    lora = LoRARequest("decoder", 1, str(root / "decoder"))
    batch = requests + requests  # the base, then the adapter, over the same prompts
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(batch, params, lora_request=[None, None, lora, lora],
                           use_tqdm=False)
    differs = False
    for i, (out, req) in enumerate(zip(outputs, batch, strict=True)):
        tokens, ref = _reference(base if i < 2 else peft, llm, req)
        assert out.outputs[0].token_ids == tokens
        check_top_logprobs(out.outputs[0].logprobs, ref)
        if i >= 2:
            differs |= out.outputs[0].token_ids != outputs[i - 2].outputs[0].token_ids
    assert differs  # the adapter changed the text: it was applied
    assert llm.engine.check_blocks_free()


def test_an_adapter_of_the_vision_tower_is_refused(vlm, tmp_path):
    root, path, base, _ = vlm
    _adapter(base, tmp_path / "tower", r".*visual.*\.qkv")
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB",
              enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="adapters of vision towers are not supported"):
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=1),
                     lora_request=LoRARequest("tower", 1, str(tmp_path / "tower")),
                     use_tqdm=False)
