"""Gemma 3 with images against transformers' own Gemma3ForConditionalGeneration (float32, eager
attention): the processor's expansion and bidirectional ranges equal transformers' processor's,
the vision tower and projector equal `get_image_features` through each backend's encoder path,
greedy tokens equal `generate` and top-5 logprobs are within 1e-4 with one and two images per
prompt (image tokens attending both ways, a sliding window smaller than an image), chunked
prefill never splits an image, a backend without bidirectional spans is refused by name, and
two tensor-parallel ranks give transformers' tokens and logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention import get_backend_cls
from pagedserve.models.loader import load_model
from pagedserve.multimodal.encoder_attention import bind_encoder_attention
from tests.multimodal.gemma3_models import (
    BOI_ID,
    EOI_ID,
    IMAGE_TOKEN_ID,
    NEWLINES_ID,
    NUM_IMAGE_TOKENS,
    hf_processor,
    tiny_gemma3,
)
from tests.multimodal.llava_models import image
from tests.utils.paged import check_top_logprobs

CPU = torch.device("cpu")
NUM_NEW = 6
# w0 w1 <start_of_image> w2 ... (ids: see gemma3_models.tiny_tokenizer)
ONE = [2, 6, 7, BOI_ID, 8, 9, 10, 11]
TWO = [2, 6, BOI_ID, 12, 13, BOI_ID, 14, 15, 16, 17, 18]
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    return path, tiny_gemma3(path)


@pytest.fixture(scope="module")
def images():
    return [image(0), image(1, (64, 48)), image(2)]


def _llm(path, **kwargs) -> LLM:
    args = dict(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    args.update(kwargs)
    return LLM(**args)


def _expanded(prompt: list[int]) -> list[int]:
    out = []
    for t in prompt:
        out += ([NEWLINES_ID, BOI_ID, *[IMAGE_TOKEN_ID] * NUM_IMAGE_TOKENS, EOI_ID, NEWLINES_ID]
                if t == BOI_ID else [t])
    return out


def test_processor_matches_transformers(gemma3, images):
    """The token-level expansion equals transformers' Gemma3Processor on the same text, its
    image spans are exactly the tokens transformers marks for bidirectional attention
    (token_type_ids), and the pixels are the same."""
    path, _ = gemma3
    llm = _llm(path)
    ours = llm.engine.mm_processor
    text = "w0 w1 <start_of_image> w2 w3 <start_of_image> w4"
    ids = llm.get_tokenizer()(text)["input_ids"]
    got = ours.process(ids, images[:2])
    ref = hf_processor(path)(text=text, images=[images[:2]], return_tensors="pt")
    assert got.prompt_token_ids == ref["input_ids"][0].tolist()
    bidirectional = np.zeros(len(got.prompt_token_ids), dtype=np.int64)
    for f in got.features:
        bidirectional[f.placeholder.offset:f.placeholder.end] = 1
    np.testing.assert_array_equal(bidirectional, ref["token_type_ids"][0].numpy())
    pixels = torch.stack([f.data["pixel_values"] for f in got.features])
    torch.testing.assert_close(pixels, ref["pixel_values"], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"1 <start_of_image> placeholders but 2 image\(s\)"):
        ours.process(ONE, images[:2])


# FLEX's encoder path has its own tests (tests/attention/test_encoder_attention.py).
@pytest.mark.parametrize("backend", ["CPU", "TRITON", pytest.param("FLEX_ATTENTION",
                                                                   marks=pytest.mark.slow)])
def test_vision_tower_and_projector_equal_transformers(gemma3, images, backend):
    path, hf = gemma3
    cls = get_backend_cls(backend)
    if not cls.is_available()[0]:
        pytest.skip(cls.is_available()[1])
    model = load_model(str(path), torch.float32, CPU).model
    assert bind_encoder_attention(model, cls, CPU, torch.float32, 256) is cls
    pixels = hf_processor(path).image_processor(images=images,
                                                return_tensors="pt")["pixel_values"]
    from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange

    features = [MultiModalFeature("image", str(i), PlaceholderRange(0, NUM_IMAGE_TOKENS),
                                  {"pixel_values": p}) for i, p in enumerate(pixels)]
    with torch.no_grad():
        ours = torch.stack(model.embed_multimodal(features))
        ref = hf.get_image_features(pixel_values=pixels).pooler_output
    assert ours.shape == (len(images), NUM_IMAGE_TOKENS, 64)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # The memory profile's stand-in image has the processor's shape.
    assert model.dummy_image_data()["pixel_values"].shape == pixels[0].shape


_REFERENCES: dict[tuple, tuple[list[int], torch.Tensor]] = {}


def _reference(hf, llm: LLM, prompt: list[int], imgs: list,
               bidirectional: bool = True) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and its log-distributions at each of them (computed once
    per prompt, images and mask: several tests compare with the same)."""
    key = (id(hf), tuple(prompt), tuple(id(im) for im in imgs), bidirectional)
    if key not in _REFERENCES:
        _REFERENCES[key] = _generate(hf, llm, prompt, imgs, bidirectional)
    return _REFERENCES[key]


@torch.no_grad()
def _generate(hf, llm: LLM, prompt: list[int], imgs: list,
              bidirectional: bool) -> tuple[list[int], torch.Tensor]:
    pixels = llm.engine.mm_processor.image_processor(images=imgs,
                                                     return_tensors="pt")["pixel_values"]
    ids = torch.tensor([_expanded(prompt)])
    types = (ids == IMAGE_TOKEN_ID).long() if bidirectional else None
    hf.generation_config.eos_token_id = None
    out = hf.generate(ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                      token_type_ids=types, max_new_tokens=NUM_NEW, do_sample=False,
                      pad_token_id=0)
    full_types = None if types is None else torch.nn.functional.pad(types, (0, NUM_NEW))
    logits = hf(input_ids=out, pixel_values=pixels, token_type_ids=full_types).logits[0]
    n = ids.shape[1]
    return out[0, n:].tolist(), torch.log_softmax(logits[n - 1:-1].float(), dim=-1)


def _requests(images):
    return [{"prompt_token_ids": ONE, "multi_modal_data": {"image": images[0]}},
            {"prompt_token_ids": TWO, "multi_modal_data": {"image": [images[1], images[2]]}}]


def _check_against_transformers(hf, llm, outputs, requests) -> None:
    for out, req in zip(outputs, requests, strict=True):
        imgs = req["multi_modal_data"]["image"]
        imgs = imgs if isinstance(imgs, list) else [imgs]
        assert out.prompt_token_ids == _expanded(req["prompt_token_ids"])
        tokens, ref = _reference(hf, llm, req["prompt_token_ids"], imgs)
        assert out.outputs[0].token_ids == tokens
        check_top_logprobs(out.outputs[0].logprobs, ref)


def test_greedy_and_logprobs_equal_transformers(gemma3, images):
    """One and two images per prompt, on the CPU's default backend; the bidirectional mask
    matters here (transformers without it gives other log-probabilities)."""
    path, hf = gemma3
    llm = _llm(path)
    assert llm.engine.runner.backend.get_name() == "CPU"
    requests = _requests(images)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check_against_transformers(hf, llm, outputs, requests)
    _, causal = _reference(hf, llm, TWO, images[1:], bidirectional=False)
    _, both_ways = _reference(hf, llm, TWO, images[1:])
    assert (causal - both_ways).abs().max() > 1e-2
    assert llm.engine.check_blocks_free()


# FLEX's mask is checked against the plain-torch mask in tests/attention (and its tower above):
# the whole model through it repeats that, slowly.
@pytest.mark.parametrize("backend", ["TRITON", pytest.param("FLEX_ATTENTION",
                                                            marks=pytest.mark.slow)])
def test_greedy_equals_transformers_on_other_backends(gemma3, images, backend):
    """The Triton kernels (interpreted) and flex's mask_mod, decoder and tower."""
    path, hf = gemma3
    if not get_backend_cls(backend).is_available()[0]:
        pytest.skip(get_backend_cls(backend).is_available()[1])
    llm = _llm(path, attention_backend=backend)
    requests = _requests(images)[1:]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check_against_transformers(hf, llm, outputs, requests)


def test_chunked_prefill_never_splits_an_image(gemma3, images):
    """Steps of 5 tokens: a chunk that would end inside an image's span of 4 stops before
    it (the metadata builder refuses a split span, so a split would fail the step)."""
    path, hf = gemma3
    llm = _llm(path, max_num_batched_tokens=5, max_num_seqs=2)
    requests = _requests(images)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(requests, params, use_tqdm=False)
    _check_against_transformers(hf, llm, outputs, requests)
    assert llm.engine.check_blocks_free()


def test_an_image_longer_than_a_step_is_refused(gemma3, images):
    path, _ = gemma3
    llm = _llm(path, max_num_batched_tokens=3)
    with pytest.raises(ValueError, match="spans 4 tokens.*max_num_batched_tokens 3"):
        llm.generate(_requests(images)[0], SamplingParams(max_tokens=1), use_tqdm=False)


def test_backend_without_bidirectional_spans_is_refused(gemma3):
    path, _ = gemma3
    if not get_backend_cls("ROCM").is_available()[0]:
        pytest.skip(get_backend_cls("ROCM").is_available()[1])
    with pytest.raises(ValueError, match="ROCM cannot run this model: all 3 layers: "
                                         "bidirectional image spans"):
        _llm(path, attention_backend="ROCM")


def test_prefix_cache_hit_ending_inside_an_image(gemma3, images):
    """The same request again, blocks of 4: its cache hit (8 tokens) ends inside the image's
    span (positions 6-9), so the step that finishes the span reads the first half's keys from
    the cache (computed, in the first run, with the whole image visible) and its own tokens
    see to the span's end. Both runs equal transformers."""
    path, hf = gemma3
    llm = _llm(path, block_size=4)
    prompt = [2, 6, 7, 8, BOI_ID]  # -> 2 6 7 8 \n\n <boi> <img> x 4 <eoi> \n\n
    request = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images[0]}}
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    first = llm.generate(request, params, use_tqdm=False)
    again = llm.generate(request, params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 8
    _check_against_transformers(hf, llm, first + again, [request, request])


def test_checkpoint_names_of_each_transformers_layout():
    """Published checkpoints (4.50: `vision_tower.vision_model.*`), 4.52+ (`model.*` beside
    `lm_head.*`) and transformers 5's saves (the tower without `vision_model.`) map to the
    same parameters; the tower's unused pooling head is skipped; anything else is refused."""
    from pagedserve.models.gemma3_vl import Gemma3ForConditionalGeneration

    _our_name = Gemma3ForConditionalGeneration.checkpoint_name

    tower = "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    for name in ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
                 "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
                 "vision_tower.encoder.layers.0.mlp.fc1.weight"):
        assert _our_name(name) == tower
    for name in ("language_model.model.norm.weight", "model.language_model.norm.weight"):
        assert _our_name(name) == "language_model.model.norm.weight"
    assert _our_name("lm_head.weight") == "language_model.lm_head.weight"
    assert _our_name("model.multi_modal_projector.mm_soft_emb_norm.weight") == \
        "multi_modal_projector.mm_soft_emb_norm.weight"
    assert _our_name("vision_tower.head.probe") is None
    assert _our_name("model.vision_tower.vision_model.head.mlp.fc1.bias") is None
    with pytest.raises(ValueError, match="not part of a Gemma 3 checkpoint"):
        _our_name("text_model.embeddings.weight")


def test_image_embeddings_in_place_of_pixels(gemma3, images):
    """An image given as its projector rows (transformers' get_image_features) runs as the
    image itself: the same span, the same greedy tokens and logprobs."""
    path, hf = gemma3
    llm = _llm(path)
    pixels = llm.engine.mm_processor.image_processor(images=images[:1],
                                                     return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        rows = hf.get_image_features(pixel_values=pixels).pooler_output[0]
    request = {"prompt_token_ids": ONE, "multi_modal_data": {"image": rows}}
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(request, params, use_tqdm=False)
    _check_against_transformers(hf, llm, outputs, [_requests(images)[0]])


def test_two_tensor_parallel_ranks_equal_transformers(gemma3, images):
    """Two gloo ranks: the decoder split (a KV head per rank in each of the sliding and global
    layers' cache groups, the tied head over half the vocabulary each), the tower whole on
    each rank, the image spans both ways on both; transformers' tokens and logprobs."""
    path, hf = gemma3
    llm = _llm(path, tensor_parallel_size=2, max_model_len=128)
    try:
        assert llm.engine.runner.world_size == 2
        requests = _requests(images)
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
        outputs = llm.generate(requests, params, use_tqdm=False)
        _check_against_transformers(hf, llm, outputs, requests)
        assert llm.engine.check_blocks_free()
    finally:
        llm.close()
