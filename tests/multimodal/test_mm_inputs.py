"""Images refused before the engine loop with a message naming the problem, images given as
embeddings, and a request's images across the engine core process's socket."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core_messages import CoreFeature, CoreRequest
from pagedserve.engine.core_process import decoder, encoder
from tests.multimodal.llava_models import IMAGE_SIZE, IMAGE_TOKEN_ID, image, tiny_llava

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    hf = tiny_llava(path)
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    yield llm, hf
    assert not llm.engine.has_unfinished_requests()
    llm.close()


def _req(ids, images):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


@pytest.mark.parametrize(("prompt", "match"), [
    (_req([3, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 4], [image(0)]),
     r"2 <image> placeholders but 1 image\(s\)"),
    (_req([3, 4], [image(0)]), r"0 <image> placeholders but 1 image\(s\)"),
    (_req([3, IMAGE_TOKEN_ID] * 3, [image(0)] * 3), r"3 images, more than the limit of 2"),
    (_req([3, IMAGE_TOKEN_ID], ["not an image"]), r"image 0 must be a PIL.Image.Image"),
    (_req([3, IMAGE_TOKEN_ID], [torch.zeros(4, 7)]), r"embeddings of width 7"),
    ({"prompt_token_ids": [3, 4], "multi_modal_data": {"audio": [b""]}},
     r"modality 'audio' is not supported"),
])
def test_bad_images_are_refused_before_the_engine(llava, prompt, match):
    llm, _ = llava
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, PARAMS, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.core.scheduler.requests


def test_bad_chat_image_parts(llava):
    llm, _ = llava
    bad = [({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            "remote image URLs are not fetched"),
           ({"type": "image_url", "image_url": {"url": "/tmp/a.png"}},
            "local image files are not read"),
           ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            "not an image pillow can read"),
           ({"type": "audio_url", "audio_url": {"url": "data:,"}}, "'audio_url' is not supported")]
    for part, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.chat([{"role": "user", "content": [part]}], PARAMS, use_tqdm=False)


def test_images_to_a_text_model_are_refused(make_llm):
    llm = make_llm(model="random:tiny", dtype="float32", device="cpu", kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="takes no images: it is a text-only model"):
        llm.generate(_req([3, 4], [image(0)]), PARAMS, use_tqdm=False)
    part = {"type": "image_pil", "image_pil": image(0)}
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [part]}], PARAMS, use_tqdm=False)


def test_images_given_as_embeddings(llava):
    """An image as its projector rows (a [tokens, hidden] tensor) gives the tokens its
    pixels give."""
    llm, hf = llava
    img = image(3)
    pixels = llm.engine.mm_processor.image_processor(images=[img],
                                                     return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        rows = hf.get_image_features(pixel_values=pixels)
    rows = rows.pooler_output if hasattr(rows, "pooler_output") else rows
    rows = rows[0] if isinstance(rows, list | tuple) else rows[0]
    ids = [3, 5, IMAGE_TOKEN_ID, 11, 4, 5]
    a, b = llm.generate([_req(ids, [img]), _req(ids, [rows])], PARAMS, use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_features_cross_the_core_socket():
    """A CoreRequest's image tensors (float32 pixels, bfloat16 embeddings) and is_embed mask
    come back from msgpack bytes equal."""
    import numpy as np

    from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange

    pixels = torch.randn(3, 4, 5)
    embeds = torch.randn(6, 8).to(torch.bfloat16)
    mask = np.array([0, 1, 1, 1, 1, 1, 1, 0], dtype=bool)
    features = [MultiModalFeature("image", "ab", PlaceholderRange(2, 3), {"pixel_values": pixels}),
                MultiModalFeature("image", "cd", PlaceholderRange(9, 8, mask),
                                  {"image_embeds": embeds})]
    request = CoreRequest("r", [1, 2, 3], SamplingParams(), 0.0,
                          mm_features=[CoreFeature.of(f) for f in features],
                          mrope_positions=np.arange(9).reshape(3, 3), mrope_delta=-2)
    back = decoder(CoreRequest).decode(encoder().encode(request))
    got = [f.feature() for f in back.mm_features]
    assert torch.equal(got[0].data["pixel_values"], pixels)
    assert got[1].data["image_embeds"].dtype == torch.bfloat16
    assert torch.equal(got[1].data["image_embeds"], embeds)
    assert got[0].placeholder == PlaceholderRange(2, 3)
    assert (got[1].placeholder.is_embed == mask).all() and got[1].placeholder.num_embeds == 6
    assert (back.mrope_positions == request.mrope_positions).all()
    assert back.mrope_delta == -2


def test_memory_profile_runs_the_encoder(llava):
    """The profile before the KV cache is sized runs the encoder over one step's worth of the
    largest images and counts the store: encoder_cache_size rows of the decoder's width."""
    llm, _ = llava
    mm = llm.engine.runner.multimodal
    budget, mm.compute_budget = mm.compute_budget, 20  # two images (default 2048 rows: 227)
    before = mm.num_encoded
    width = llm.engine.core.loaded.hf_config.text_config.hidden_size
    try:
        assert mm.profile() == mm.cache_size * width * 4  # float32
    finally:
        mm.compute_budget = budget
    assert mm.num_encoded == before  # a profile is not an encoder run of a request


def test_an_image_over_the_encoder_budget_is_refused_in_the_front(tmp_path, make_llm):
    path = tmp_path / "m"
    tiny_llava(path)
    llm = make_llm(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB",
                   encoder_cache_size=8)
    with pytest.raises(ValueError, match="9 embedding rows, more than the engine's "
                                         "encoder_cache_size of 8"):
        llm.generate(_req([3, IMAGE_TOKEN_ID], [image(0)]), PARAMS, use_tqdm=False)
    assert not llm.engine.core.scheduler.requests


def _async_tokens(path: str, req: dict, core_process: bool) -> list[int]:
    import asyncio

    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine

    async def run() -> list[int]:
        engine = AsyncLLM(LLMEngine.from_kwargs(model=path, dtype="float32",
                                                kv_cache_memory="4MiB",
                                                engine_core_process=core_process))
        try:
            final = None
            async for out in engine.generate(req["prompt_token_ids"], PARAMS, "r",
                                             multi_modal_data=req["multi_modal_data"]):
                final = out
            stats = await engine.call_utility("stats")
            assert (stats.mm_images_encoded, stats.mm_encoder_calls) == (2, 1)
            return final.outputs[0].token_ids
        finally:
            await asyncio.to_thread(engine.shutdown)

    return asyncio.run(run())


@pytest.mark.parametrize("core_process", [
    False, pytest.param(True, marks=pytest.mark.slow)])  # (test_features_cross_the_core_socket)
def test_async_llm_generate_with_images(llava, core_process):
    """AsyncLLM.generate(multi_modal_data=), also with the engine core in its own process
    (the image's tensors cross the socket): the tokens are LLM.generate's."""
    llm, _ = llava
    req = _req([3, 5, IMAGE_TOKEN_ID, 11, IMAGE_TOKEN_ID, 4, 5], [image(4), image(5)])
    expected = llm.generate(req, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert _async_tokens(llm.engine.config.model.model, req, core_process) == expected


def test_a_prompt_processed_already(llava):
    """add_request takes process_prompt's result (what a server makes on a worker pool): the
    same tokens as the raw images, and the same limit."""
    from pagedserve.multimodal.front import process_prompt

    llm, _ = llava
    engine = llm.engine
    ids = [3, 5, IMAGE_TOKEN_ID, 11, 4, 5]
    mm = process_prompt(engine.mm_processor, ids, {"image": image(6)}, engine.mm_limits)
    engine.add_request("pre", ids, PARAMS, multi_modal_data=mm)
    done = llm.wait_for(["pre"], use_tqdm=False)[0]
    ref = llm.generate(_req(ids, [image(6)]), PARAMS, use_tqdm=False)[0]
    assert done.prompt_token_ids == ref.prompt_token_ids
    assert done.outputs[0].token_ids == ref.outputs[0].token_ids
    three = process_prompt(engine.mm_processor, [3, IMAGE_TOKEN_ID] * 3, {"image": [image(6)] * 3})
    with pytest.raises(ValueError, match="3 images, more than the limit of 2"):
        engine.add_request("three", [3], PARAMS, multi_modal_data=three)


def test_a_template_of_string_content_gets_the_placeholders_before_the_text():
    """A chat template that renders content as a string (no image parts of its own): each
    image's placeholder goes before its message's text."""
    from pagedserve.multimodal.chat import chat_images, render_with_images
    from tests.multimodal.llava_models import tiny_tokenizer

    tok = tiny_tokenizer()
    template = "{% for m in messages %}{{ m['role'] | upper }} : {{ m['content'] }} {% endfor %}"
    messages, imgs = chat_images([{"role": "user", "content": [
        {"type": "text", "text": "w1"}, {"type": "image_pil", "image_pil": image(0)},
        {"type": "image_pil", "image_pil": image(1)}]}])
    assert len(imgs) == 2
    ids = render_with_images(tok, messages, 2, "<image>", False, template)
    assert ids == tok.encode("USER : <image>\n<image>\nw1 ", add_special_tokens=False)
    assert ids.count(IMAGE_TOKEN_ID) == 2


def test_n_sequences_send_an_image_once(llava):
    """A request of n sequences crosses the core's socket with each image's tensors once (the
    later sequences name the first one's), and every sequence still reads the image."""
    llm, _ = llava
    client = llm.engine.client
    sent = []
    add = client.add_requests

    def capture(requests):
        sent.append(encoder().encode(requests))
        add(requests)

    client.add_requests = capture
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=3)
        [out] = llm.generate([_req([3, IMAGE_TOKEN_ID, 4], [image(0)])], params)
        [one] = llm.generate([_req([3, IMAGE_TOKEN_ID, 4], [image(0)])], PARAMS)
    finally:
        client.add_requests = add
    pixels = 3 * IMAGE_SIZE * IMAGE_SIZE * 4  # tiny_llava's image, float32
    assert pixels < len(sent[1]) < len(sent[0]) < 2 * pixels
    assert [o.token_ids for o in out.outputs] == [one.outputs[0].token_ids] * 3


def test_a_group_of_sequences_crosses_the_core_socket():
    """The core process's side of n > 1: the later sequences' features, sent without tensors,
    read the first sequence's once decoded."""
    from pagedserve.engine.core_messages import sequence_features, share_feature_data
    from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange

    pixels = torch.randn(3, 4, 5)
    feature = MultiModalFeature("image", "ab", PlaceholderRange(1, 3), {"pixel_values": pixels})
    group = [CoreRequest(f"r#{i}", [1, 2, 3, 4], SamplingParams(), 0.0, mm_features=features)
             for i, features in enumerate(sequence_features([feature, feature], 3))]
    back = decoder(list[CoreRequest]).decode(encoder().encode(group))
    assert all(f.data is None for r in back[1:] for f in r.mm_features)
    share_feature_data(back)
    for request in back:
        assert [torch.equal(f.feature().data["pixel_values"], pixels)
                for f in request.mm_features] == [True, True]
