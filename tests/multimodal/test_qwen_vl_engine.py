"""Qwen2.5-VL and Qwen3-VL through the engine against transformers' own float32 `generate`:
greedy tokens equal and top-5 logprobs within 1e-4, with one and two images of different
sizes per prompt beside a text-only prompt (M-RoPE prompt rows, then index + delta), prefill
chunks that split image spans, preemption, a prefix-cache hit, and LLM.chat's image parts."""

from __future__ import annotations

import re

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.multimodal.qwen_vl_fixtures import (
    IMAGE,
    image_prompt,
    images,
    save_qwen_tokenizer,
    save_tiny_qwen2_5_vl,
    save_tiny_qwen3_vl,
)
from tests.utils.paged import check_top_logprobs

NUM_NEW = 5


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_engine"))
    save_qwen_tokenizer(path)
    return path, Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager").eval()


def _requests() -> list[dict]:
    ims = images()
    return [
        {"prompt_token_ids": image_prompt([3, 4], [5, 6, 7]),
         "multi_modal_data": {"image": ims[0]}},
        {"prompt_token_ids": image_prompt([8], [9], [10, 11]),
         "multi_modal_data": {"image": [ims[2], ims[1]]}},
        {"prompt_token_ids": [12, 13, 14, 15]},  # text only
    ]


def _llm(path, **kwargs) -> LLM:
    args = dict(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    args.update(kwargs)
    return LLM(**args)


@torch.no_grad()
def _reference(hf, llm: LLM, request: dict) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' expanded prompt, greedy tokens, and log-distributions at each."""
    imgs = request.get("multi_modal_data", {}).get("image", [])
    imgs = imgs if isinstance(imgs, list) else [imgs]
    prompt = llm.engine.mm_processor.process(request["prompt_token_ids"], imgs)
    ids = torch.tensor([prompt.prompt_token_ids])
    extra = {}
    if imgs:
        feats = prompt.features
        extra = dict(pixel_values=torch.cat([f.data["pixel_values"] for f in feats]),
                     image_grid_thw=torch.stack([f.data["image_grid_thw"] for f in feats]))
    hf.generation_config.eos_token_id = None
    out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                      mm_token_type_ids=(ids == IMAGE).int(), max_new_tokens=NUM_NEW,
                      do_sample=False, pad_token_id=0, **extra)
    logits = hf(input_ids=out, mm_token_type_ids=(out == IMAGE).int(), **extra).logits[0]
    n = ids.shape[1]
    return ids[0].tolist(), out[0, n:].tolist(), torch.log_softmax(logits[n - 1:-1], dim=-1)


def _check(hf, llm: LLM, outputs, requests, logprobs: bool = True) -> None:
    for out, req in zip(outputs, requests, strict=True):
        prompt, tokens, ref = _reference(hf, llm, req)
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == tokens
        if not logprobs:
            continue
        check_top_logprobs(out.outputs[0].logprobs, ref)


def _chat_equals_generate(llm: LLM) -> None:
    """LLM.chat: the template renders each image part as the Qwen placeholder, which the
    processor expands; the same as LLM.generate with those ids and images."""
    import base64
    import io

    ims = images()
    buf = io.BytesIO()
    ims[1].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "w20"}, {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "w21 w22"}, {"type": "image", "image": ims[0]}]}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    # <|im_start|> user w20 <image> w21 w22 <image> <|im_end|> <|im_start|> assistant
    prompt = [3, 5, 20, *image_prompt([], [21, 22], [4, 3, 6])]
    ref = llm.generate({"prompt_token_ids": prompt,
                        "multi_modal_data": {"image": [ims[1], ims[0]]}},
                       params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == ref.prompt_token_ids
    assert chat.outputs[0].token_ids == ref.outputs[0].token_ids


def test_qwen2_5_vl_greedy_and_logprobs_equal_transformers(qwen2_5_vl):
    path, hf = qwen2_5_vl
    llm = _llm(path)
    requests = _requests()
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check(hf, llm, outputs, requests, logprobs=True)
    assert llm.engine.runner.multimodal.num_encoded == 3
    _chat_equals_generate(llm)
    assert llm.engine.check_blocks_free()


def test_qwen2_5_vl_prefill_chunks_split_image_spans(qwen2_5_vl):
    """Steps of 5 tokens: every image span (6 and 12 tokens, 4 for the small one) is cut
    across steps, and prompt positions continue from the chunk's offset."""
    path, hf = qwen2_5_vl
    llm = _llm(path, max_num_batched_tokens=5, max_num_seqs=2)
    requests = _requests()[:2]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check(hf, llm, outputs, requests, logprobs=True)
    assert llm.engine.runner.multimodal.num_encoded == 3
    assert llm.engine.check_blocks_free()


def test_qwen2_5_vl_preemption_and_prefix_cache_hits(qwen2_5_vl):
    """A KV pool too small for both image requests: one is preempted and recomputes its
    prompt and outputs (prompt rows, then index + delta) from the cached encoder rows; then
    the first request again starts from a prefix-cache hit inside its prompt."""
    path, hf = qwen2_5_vl
    # 2 KiB per block of 4 tokens: 10 blocks hold either request (5 and 8 blocks), not both
    llm = _llm(path, kv_cache_memory="20KiB", block_size=4, max_num_batched_tokens=16)
    requests = _requests()[:2]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    _check(hf, llm, outputs, requests)
    assert llm.engine.runner.multimodal.num_encoded == 3
    again = llm.generate(requests[:1], params, use_tqdm=False)
    assert again[0].num_cached_tokens > 0
    _check(hf, llm, again, requests[:1])
    assert llm.engine.check_blocks_free()


def test_qwen3_vl_greedy_and_logprobs_equal_transformers(tmp_path):
    """DeepStack rows ride beside the merger's through the runner into the decoder."""
    from transformers import Qwen3VLForConditionalGeneration

    path = save_tiny_qwen3_vl(tmp_path)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager").eval()
    llm = _llm(path, max_num_batched_tokens=16, max_num_seqs=2)
    requests = _requests()[:2]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check(hf, llm, outputs, requests, logprobs=True)
    assert llm.engine.check_blocks_free()


@pytest.mark.gpu
def test_qwen2_5_vl_decode_graphs_read_the_mrope_buffer(tmp_path):
    """On CUDA the decode steps replay graphs captured reading the M-RoPE position buffer,
    which each step refills (prompt rows, then index + delta): the same tokens as eager
    steps. Heads of 64, decoder and tower, for TRITON (graph-capable, float32)."""
    path = save_tiny_qwen2_5_vl(
        tmp_path, text_overrides=dict(hidden_size=256, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}),
        vision_overrides=dict(hidden_size=128))
    out = {}
    for eager in (True, False):
        llm = LLM(model=str(path), dtype="float32", device="cuda", max_num_seqs=4,
                  attention_backend="TRITON", num_gpu_blocks_override=64,
                  enforce_eager=eager)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out[eager] = [o.outputs[0].token_ids
                      for o in llm.generate(_requests(), params, use_tqdm=False)]
        if not eager:
            assert sum(llm.engine.runner.decode_graphs.replays.values()) > 0
        del llm
    assert out[False] == out[True]


def test_qwen2_5_vl_padded_verify_steps_read_the_mrope_buffer(qwen2_5_vl):
    """n-gram speculation with the runner's graph path on (capture off: padded steps run
    eagerly): three greedy sequences of one image prompt make uniform verify steps of 1+K
    tokens a request, padded to 4 and reading the M-RoPE buffer (delta-shifted rows past the
    image); their tokens equal the engine's without speculation."""
    from pagedserve.engine.cuda_graphs import DecodeGraphs

    path, _ = qwen2_5_vl
    request = _requests()[0]
    params = SamplingParams(temperature=0, n=3, max_tokens=16, ignore_eos=True)
    want = [c.token_ids for c in _llm(path, max_num_seqs=4).generate(
        [request], params, use_tqdm=False)[0].outputs]
    llm = _llm(path, max_num_seqs=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2})
    runner = llm.engine.runner
    inputs = runner.graph_inputs()
    verify = DecodeGraphs(inputs, [2, 4], capture=False, query_len=3)
    runner.decode_graphs = DecodeGraphs(inputs, [1, 2, 4], capture=False, verify=verify)
    got = [c.token_ids for c in llm.generate([request], params, use_tqdm=False)[0].outputs]
    assert got == want
    assert verify.replays[4] > 0, "no uniform verify step was padded"


@torch.no_grad()
def _hf_image_embeds(hf, llm: LLM, image) -> dict:
    """transformers' own tower output for one image (merger rows, DeepStack's beside them for
    Qwen3-VL) with its grid: vLLM's embeddings form of a Qwen-VL image."""
    data = llm.engine.mm_processor.process(image_prompt([3], [4]), [image]).features[0].data
    grid = data["image_grid_thw"].reshape(1, 3)
    out = hf.model.get_image_features(data["pixel_values"], grid)
    rows = out.pooler_output if hasattr(out, "pooler_output") else out[0]
    rows = torch.cat(list(rows)) if isinstance(rows, list | tuple) else rows
    stacked = getattr(out, "deepstack_features", None) or []  # each split per image
    if stacked:
        rows = torch.cat([rows, *(torch.cat(list(s)) for s in stacked)], dim=-1)
    return {"image_embeds": rows, "image_grid_thw": data["image_grid_thw"]}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_image_embeds_with_their_grid(family, qwen2_5_vl, tmp_path):
    """vLLM's {"image_embeds", "image_grid_thw"} form: transformers' tower output for each
    image stands in for it, beside a pixel image in the same prompt, and the tokens equal
    transformers' generate on the pixels. The grid places the tokens (the M-RoPE rows); bare
    embeddings, a grid that does not match the rows and rows of the wrong width are refused
    by name."""
    if family == "qwen2_5_vl":
        path, hf = qwen2_5_vl
    else:
        from transformers import Qwen3VLForConditionalGeneration

        path = save_tiny_qwen3_vl(tmp_path)
        hf = Qwen3VLForConditionalGeneration.from_pretrained(
            path, attn_implementation="eager").eval()
    llm = _llm(path)
    ims = images()
    embeds = _hf_image_embeds(hf, llm, ims[2])
    request = {"prompt_token_ids": image_prompt([8], [9], [10, 11]),
               "multi_modal_data": {"image": [embeds, ims[1]]}}
    pixels = {**request, "multi_modal_data": {"image": [ims[2], ims[1]]}}
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    out = llm.generate([request], params, use_tqdm=False)
    _check(hf, llm, out, [pixels], logprobs=True)
    assert llm.engine.runner.multimodal.num_encoded == 2  # each item once
    rows, grid = embeds["image_embeds"], embeds["image_grid_thw"]
    bad = [(rows, "precomputed embeddings with their patch grid"),
           ({"image_embeds": rows, "image_grid_thw": grid * torch.tensor([1, 2, 1])},
            "takes ["),
           ({"image_embeds": rows[:, :-1], "image_grid_thw": grid}, "takes ["),
           ({"image_embeds": rows, "image_grid_thw": [1, 2]}, "image_grid_thw must be"),
           ({"image_embeds": rows, "grid": grid}, "takes image_embeds and image_grid_thw")]
    for item, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate({**request, "multi_modal_data": {"image": [item, ims[1]]}}, params,
                         use_tqdm=False)
    assert llm.engine.check_blocks_free()


@pytest.mark.slow  # test_llava.py runs the same step message at TP=2 in the default suite
def test_qwen2_5_vl_under_two_tensor_parallel_ranks(qwen2_5_vl):
    """Two gloo ranks: the decoder split, the tower whole on each rank, the images, the
    step's encoder schedule and the M-RoPE rows on both; transformers' tokens and logprobs."""
    path, hf = qwen2_5_vl
    llm = _llm(path, tensor_parallel_size=2, max_model_len=128)
    try:
        requests = _requests()
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
        outputs = llm.generate(requests, params, use_tqdm=False)
        _check(hf, llm, outputs, requests, logprobs=True)
    finally:
        llm.close()
