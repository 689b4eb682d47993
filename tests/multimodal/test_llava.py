"""LLaVA-1.5 with images in prompts against transformers' own LlavaForConditionalGeneration
(float32, eager attention): greedy tokens equal and top-5 logprobs within 1e-4, with one and
two images per prompt, image spans split by chunked prefill (also by a token budget smaller
than one image), preemption, the encoder run once per distinct image, and the prefix cache
keyed by the images."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.multimodal.llava_models import (
    IMAGE_TOKEN_ID,
    NUM_IMAGE_TOKENS,
    image,
    tiny_llava,
)
from tests.utils.paged import check_top_logprobs

NUM_NEW = 6
# USER : w4 <image> w5 w6 ... ASSISTANT :  (ids: see llava_models.tiny_tokenizer)
ONE = [1, 3, 5, 10, IMAGE_TOKEN_ID, 11, 12, 13, 4, 5]
TWO = [1, 3, 5, IMAGE_TOKEN_ID, 20, 21, IMAGE_TOKEN_ID, 22, 23, 24, 25, 26, 27, 4, 5]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    return path, tiny_llava(path)


@pytest.fixture(scope="module")
def images():
    return [image(0), image(1, (64, 48)), image(2)]


def _llm(path, **kwargs) -> LLM:
    args = dict(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    args.update(kwargs)
    return LLM(**args)


def _expanded(prompt: list[int], num_images: int) -> list[int]:
    out = []
    for t in prompt:
        out += [t] * (NUM_IMAGE_TOKENS if t == IMAGE_TOKEN_ID else 1)
    assert out.count(IMAGE_TOKEN_ID) == num_images * NUM_IMAGE_TOKENS
    return out


@torch.no_grad()
def _reference(hf, llm: LLM, prompt: list[int], imgs: list, logprobs: bool = True
               ) -> tuple[list[int], torch.Tensor | None]:
    """transformers' greedy tokens, and its log-distributions at each of them (`logprobs`:
    a second forward over the output, which transformers refuses when a random model has
    generated the image token itself)."""
    pixels = llm.engine.mm_processor.image_processor(images=imgs,
                                                     return_tensors="pt")["pixel_values"]
    ids = torch.tensor([_expanded(prompt, len(imgs))])
    hf.generation_config.eos_token_id = None
    out = hf.generate(ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                      max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
    n = ids.shape[1]
    if not logprobs:
        return out[0, n:].tolist(), None
    logits = hf(input_ids=out, pixel_values=pixels).logits[0].float()
    return out[0, n:].tolist(), torch.log_softmax(logits[n - 1:-1], dim=-1)


def _requests(images):
    return [{"prompt_token_ids": ONE, "multi_modal_data": {"image": images[0]}},
            {"prompt_token_ids": TWO, "multi_modal_data": {"image": [images[1], images[2]]}},
            {"prompt_token_ids": ONE, "multi_modal_data": {"image": [images[2]]}}]


def _check_against_transformers(hf, llm, outputs, requests, logprobs: bool = False) -> None:
    for out, req in zip(outputs, requests, strict=True):
        imgs = req["multi_modal_data"]["image"]
        imgs = imgs if isinstance(imgs, list) else [imgs]
        assert out.prompt_token_ids == _expanded(req["prompt_token_ids"], len(imgs))
        tokens, ref = _reference(hf, llm, req["prompt_token_ids"], imgs, logprobs)
        assert out.outputs[0].token_ids == tokens
        if not logprobs:
            continue
        check_top_logprobs(out.outputs[0].logprobs, ref)


def test_greedy_and_logprobs_equal_transformers(llava, images):
    """One and two images per prompt, the same image in two requests (encoded once)."""
    path, hf = llava
    llm = _llm(path)
    requests = _requests(images)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check_against_transformers(hf, llm, outputs, requests, logprobs=True)
    assert llm.engine.runner.multimodal.num_encoded == 3  # images[2] twice, encoded once
    stats = llm.engine.core_stats()
    assert (stats.mm_images_encoded, stats.mm_encoder_calls) == (3, 1)  # one step, one call
    assert stats.mm_encoder_seconds > 0
    assert llm.engine.images.num_preprocessed == 4 and llm.engine.images.preprocess_seconds > 0
    assert llm.engine.check_blocks_free()


@pytest.mark.parametrize("budget", [4, 12])
def test_chunked_prefill_splits_image_spans(llava, images, budget):
    """Steps of 4 tokens (fewer than one image's 9; with async scheduling) and of 12: spans
    split across steps, each image encoded once, in the step that first reaches it."""
    path, hf = llava
    llm = _llm(path, max_num_batched_tokens=budget, max_num_seqs=2,
               async_scheduling=budget == 4)
    assert llm.engine.async_scheduling == (budget == 4)
    requests = _requests(images)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check_against_transformers(hf, llm, outputs, requests)
    assert llm.engine.runner.multimodal.num_encoded == 3
    assert llm.engine.check_blocks_free()


def test_preemption_reuses_encoder_rows(llava, images):
    """A KV pool too small for both requests: one is preempted and recomputes its prompt,
    images included, from the encoder rows still cached (no encoder runs again)."""
    path, hf = llava
    # 2 KiB per block of 4 tokens: 12 blocks hold either request (6 and 10 blocks), not both
    # (prefix caching off: the recomputation goes through the image spans again)
    llm = _llm(path, kv_cache_memory="24KiB", block_size=4, max_num_batched_tokens=16,
               enable_prefix_caching=False)
    requests = _requests(images)[:2]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    _check_against_transformers(hf, llm, outputs, requests)
    assert llm.engine.runner.multimodal.num_encoded == 3
    assert llm.engine.check_blocks_free()


def test_prefix_cache_is_keyed_by_the_image(llava, images):
    """The same request again hits every full block before its last token; the same text with
    another first image hits only the blocks before that image's span, with another second
    image the blocks before the second span."""
    path, _ = llava
    llm = _llm(path, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # expanded: tokens 0-5 text, 6-14 the first image, 15 text, 16-24 the second, 25-27 text
    prompt = [1, 3, 5, 10, 11, 12, IMAGE_TOKEN_ID, 20, IMAGE_TOKEN_ID, 21, 4, 5]

    def run(*imgs):
        req = {"prompt_token_ids": prompt, "multi_modal_data": {"image": list(imgs)}}
        return llm.generate(req, params, use_tqdm=False)[0]

    first = run(images[0], images[1])
    again = run(images[0], images[1])
    other_first = run(images[2], images[1])
    other_second = run(images[0], images[2])
    n = len(first.prompt_token_ids)
    assert n == 28
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // 4 * 4  # 24
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other_first.num_cached_tokens == 4  # block 1 (tokens 4-7) holds image tokens
    assert other_second.num_cached_tokens == 16  # blocks 0-3: up to the second span
    assert llm.engine.runner.multimodal.num_encoded == 3  # images 0, 1, 2: each once


def test_text_prompt_with_prompt_logprobs_and_n(llava, images):
    """A text prompt holding `<image>`, two samples, prompt logprobs over chunks of 8 (the
    image's positions included) within 1e-4 of transformers'."""
    path, hf = llava
    llm = _llm(path, max_num_batched_tokens=8)
    req = {"prompt": "USER : w4 <image> w5 ASSISTANT :", "multi_modal_data": {"image": images[0]}}
    params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=3, prompt_logprobs=1)
    out = llm.generate(req, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == _expanded([3, 5, 10, IMAGE_TOKEN_ID, 11, 4, 5], 1)
    assert len(out.outputs) == 2
    pixels = llm.engine.mm_processor.image_processor(images=[images[0]],
                                                     return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([out.prompt_token_ids]), pixel_values=pixels).logits
    ref = torch.log_softmax(logits[0].float(), dim=-1)
    for i, token in enumerate(out.prompt_token_ids[1:], start=1):
        assert abs(out.prompt_logprobs[i][token].logprob - ref[i - 1, token].item()) < 1e-4


def test_chat_with_an_image_part(llava, images):
    """LLM.chat: an image_url part (a data: URL) rendered by the model's template from list
    content equals LLM.generate with the same image."""
    import base64
    import io

    path, _ = llava
    llm = _llm(path)
    buf = io.BytesIO()
    images[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "w4"}, {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "w5 w6"}]}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    # The template: "USER : w4 <image> w5 w6  ASSISTANT : "
    prompt = [3, 5, 10, IMAGE_TOKEN_ID, 11, 12, 4, 5]
    ref = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images[0]}},
                       params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == ref.prompt_token_ids
    assert chat.outputs[0].token_ids == ref.outputs[0].token_ids


def test_full_strategy_and_several_feature_layers(tmp_path, images):
    """vision_feature_select_strategy "full" (the class token kept: 10 tokens per image) and
    vision_feature_layer a list (hidden states concatenated)."""
    hf = tiny_llava(tmp_path, strategy="full", feature_layer=[-1, -3], seed=1)
    llm = _llm(tmp_path)
    req = {"prompt_token_ids": TWO, "multi_modal_data": {"image": images[:2]}}
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    out = llm.generate(req, params, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == 2 * (NUM_IMAGE_TOKENS + 1)
    pixels = llm.engine.mm_processor.image_processor(images=images[:2],
                                                     return_tensors="pt")["pixel_values"]
    ids = torch.tensor([out.prompt_token_ids])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                          max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
    llm.close()


def test_checkpoint_names_of_each_layout():
    from pagedserve.models.llava import LlavaForConditionalGeneration

    _our_name = LlavaForConditionalGeneration.checkpoint_name

    ours = {
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight":
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "vision_tower.encoder.layers.0.mlp.fc1.weight":
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "model.vision_tower.vision_model.pre_layrnorm.bias":
            "vision_tower.vision_model.pre_layrnorm.bias",
        "model.language_model.layers.0.mlp.up_proj.weight":
            "language_model.model.layers.0.mlp.up_proj.weight",
        "language_model.model.norm.weight": "language_model.model.norm.weight",
        "lm_head.weight": "language_model.lm_head.weight",
        "language_model.lm_head.weight": "language_model.lm_head.weight",
        "model.multi_modal_projector.linear_1.bias": "multi_modal_projector.linear_1.bias",
    }
    for name, expected in ours.items():
        assert _our_name(name) == expected
    with pytest.raises(ValueError, match="not part of a LLaVA checkpoint"):
        _our_name("image_newline")


def test_checkpoints_we_cannot_run_are_refused_by_name():
    import transformers

    from pagedserve.models.llava import check_config

    def config(**kwargs):
        return transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(
            num_hidden_layers=2), text_config=transformers.LlamaConfig(), **kwargs)

    # transformers' constructor refuses this strategy; a config.json may still hold it
    padded = config()
    object.__setattr__(padded, "vision_feature_select_strategy", "pad")
    with pytest.raises(ValueError, match="vision_feature_select_strategy 'pad'"):
        check_config(padded)
    with pytest.raises(ValueError, match="vision_feature_layer -4 is out of range"):
        check_config(config(vision_feature_layer=-4))
    siglip = transformers.LlavaConfig(vision_config=transformers.SiglipVisionConfig(),
                                      text_config=transformers.LlamaConfig())
    with pytest.raises(ValueError, match="'siglip_vision_model' vision tower"):
        check_config(siglip)


def test_encoder_cache_of_one_image(llava, make_llm):
    """encoder_cache_size of one image: a two-image prompt encodes its second image once the
    first span is done; without prefix caching a repeated request encodes both again (each
    evicted the other); the tokens still equal transformers'."""
    path, hf = llava
    llm = make_llm(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB",
                   encoder_cache_size=NUM_IMAGE_TOKENS, max_num_batched_tokens=32,
                   max_num_seqs=1, enable_prefix_caching=False)
    prompt = [1, 3, IMAGE_TOKEN_ID, 20, IMAGE_TOKEN_ID, 4, 5]
    imgs = [image(0), image(1)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    reqs = [{"prompt_token_ids": prompt, "multi_modal_data": {"image": imgs}}] * 2
    outputs = llm.generate(reqs, params, use_tqdm=False)
    tokens, _ = _reference(hf, llm, prompt, imgs)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens, tokens]
    mm = llm.engine.runner.multimodal
    assert mm.num_encoded == 4
    assert sum(rows.shape[0] for rows in mm.store.values()) <= NUM_IMAGE_TOKENS



@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "TRITON"])
def test_greedy_on_cuda_matches_transformers(tmp_path, images, backend):
    """The CUDA path in float32 (the default backend's or TRITON's decoder attention, the
    tower's encoder attention on the first backend with an encoder path, decode CUDA graphs
    between image steps, chunks splitting spans) against transformers' float32 tokens on the
    CPU; heads of 64."""
    hf = tiny_llava(tmp_path, head_dim=64, seed=3)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", attention_backend=backend,
              gpu_memory_utilization=0.05, max_num_batched_tokens=16)
    requests = _requests(images)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check_against_transformers(hf, llm, outputs, requests)
    assert llm.engine.runner.multimodal.num_encoded == 3
    llm.close()


def test_tensor_parallel_and_a_lora_adapter_of_the_decoder(llava, images, tmp_path):
    """Two gloo ranks (the Llama decoder split, the CLIP tower whole on each) give
    transformers' tokens and logprobs; then a PEFT adapter made on transformers' whole LLaVA
    (its decoder at `model.language_model.`) beside the base in one batch gives the
    PeftModel's."""
    import copy

    from peft import LoraConfig, get_peft_model

    from pagedserve.lora import LoRARequest

    path, hf = llava
    requests = _requests(images)[:2]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    llm = _llm(path, tensor_parallel_size=2, max_model_len=128)
    try:
        outputs = llm.generate(requests, params, use_tqdm=False)
        _check_against_transformers(hf, llm, outputs, requests, logprobs=True)
    finally:
        llm.close()
    torch.manual_seed(5)
    peft = get_peft_model(copy.deepcopy(hf), LoraConfig(
        r=8, lora_alpha=32, init_lora_weights=False,
        target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|"
                       r"down_proj)")).eval()
    peft.save_pretrained(tmp_path / "adapter")
    llm = _llm(path, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("decoder", 1, str(tmp_path / "adapter"))
    outputs = llm.generate(requests * 2, params, lora_request=[None, None, lora, lora],
                           use_tqdm=False)
    _check_against_transformers(hf, llm, outputs[:2], requests, logprobs=True)
    _check_against_transformers(peft, llm, outputs[2:], requests, logprobs=True)
    assert [o.outputs[0].token_ids for o in outputs[:2]] != \
        [o.outputs[0].token_ids for o in outputs[2:]]  # the adapter was applied
