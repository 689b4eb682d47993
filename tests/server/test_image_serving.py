"""Images through `pagedserve serve` end to end: a tiny random LLaVA-1.5 saved as transformers
saves it, served in a subprocess, driven by the official `openai` and `anthropic` clients with
base64 PNG images (streamed and not). Expected outputs come from the offline engine in this
process (`LLM.chat` / `LLM.generate`, greedy), whose tokens are checked against transformers'
own LlavaForConditionalGeneration greedy `generate` here too; never from the server."""

from __future__ import annotations

import asyncio
import base64
import io

import anthropic
import httpx
import openai
import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.multimodal.llava_models import IMAGE_TOKEN_ID, NUM_IMAGE_TOKENS, image, tiny_llava
from tests.utils.server import ServerProcess

MODEL = "llava"
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def png_b64(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def image_url(img) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(img)}}


IMAGES = [image(0), image(1, (64, 48))]
ONE = [{"role": "user", "content": [{"type": "text", "text": "w4"}, image_url(IMAGES[0]),
                                    {"type": "text", "text": "w5 w6"}]}]
TWO = [{"role": "system", "content": "w30 w31"},
       {"role": "user", "content": [image_url(IMAGES[0]), {"type": "text", "text": "w7"},
                                    image_url(IMAGES[1]), {"type": "text", "text": "w8 w9"}]}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    return path, tiny_llava(path)


@pytest.fixture(scope="module")
def server(request, llava, tmp_path_factory):
    path, _ = llava
    srv = ServerProcess([str(path), "--device", "cpu", "--dtype", "float32",
                         "--kv-cache-memory", "8MiB", "--served-model-name", MODEL,
                         "--enable-mm-embeds"],
                        tmp_path_factory.mktemp("llava_server") / "server.log", wait=False)
    srv.healthy_after(lambda: request.getfixturevalue("offline"))  # loads while it starts
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(llava):
    path, _ = llava
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    yield llm
    llm.close()


@torch.no_grad()
def transformers_greedy(hf, llm: LLM, prompt_ids: list[int], imgs: list) -> list[int]:
    pixels = llm.engine.mm_processor.image_processor(images=imgs,
                                                     return_tensors="pt")["pixel_values"]
    ids = torch.tensor([prompt_ids])
    hf.generation_config.eos_token_id = None
    out = hf.generate(ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                      max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_openai_client_with_base64_images(llava, server, offline) -> None:
    """Whole and streamed answers, one and two images, equal LLM.chat's, whose tokens equal
    transformers' greedy ones; the prompt is counted with each image's tokens."""
    _, hf = llava
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for messages, imgs in ((ONE, IMAGES[:1]), (TWO, IMAGES)):
        ref = offline.chat(messages, GREEDY, use_tqdm=False)[0]
        assert ref.outputs[0].token_ids == transformers_greedy(hf, offline,
                                                               ref.prompt_token_ids, imgs)
        whole = client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=NEW, temperature=0,
            extra_body={"ignore_eos": True})
        assert whole.choices[0].message.content == ref.outputs[0].text
        assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert whole.usage.completion_tokens == NEW
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=NEW, temperature=0,
            extra_body={"ignore_eos": True}, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == ref.outputs[0].text
    # The answer depends on the image: the equalities above could not hold with it ignored.
    other = [{**ONE[0], "content": [ONE[0]["content"][0], image_url(image(7)),
                                    ONE[0]["content"][2]]}]
    assert offline.chat(other, GREEDY, use_tqdm=False)[0].outputs[0].text != \
        offline.chat(ONE, GREEDY, use_tqdm=False)[0].outputs[0].text
    tokens = httpx.post(server.url + "/tokenize", json={"messages": ONE}, timeout=60).json()
    assert tokens["tokens"] == offline.chat(ONE, GREEDY, use_tqdm=False)[0].prompt_token_ids


def test_concurrent_image_requests(server, offline) -> None:
    """Four requests with different images at once (the media pool decodes them side by
    side, the engine batches them): each answer is LLM.chat's for its own image."""
    conversations = [[{"role": "user", "content": [{"type": "text", "text": f"w{10 + k}"},
                                                   image_url(image(20 + k))]}]
                     for k in range(4)]
    refs = offline.chat(conversations, GREEDY, use_tqdm=False)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def ask_all() -> list[str]:
        replies = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=c, max_completion_tokens=NEW, temperature=0,
            extra_body={"ignore_eos": True}) for c in conversations))
        await client.close()
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(ask_all()) == [r.outputs[0].text for r in refs]


def test_anthropic_and_responses_clients_and_image_embeds(server, offline) -> None:
    ref = offline.chat(ONE, SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)[0]
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    reply = client.messages.create(model=MODEL, max_tokens=NEW, extra_body={"temperature": 0},
                                   messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "w4"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": png_b64(IMAGES[0])}},
            {"type": "text", "text": "w5 w6"}]}])
    assert "".join(b.text for b in reply.content) == ref.outputs[0].text
    usage = reply.usage  # the prompt was served before: part of it is a prefix-cache hit
    assert usage.input_tokens + usage.cache_read_input_tokens == len(ref.prompt_token_ids)
    counted = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": png_b64(IMAGES[0])}}]}])
    assert counted.input_tokens == len(offline.chat(
        [{"role": "user", "content": [image_url(IMAGES[0])]}], GREEDY,
        use_tqdm=False)[0].prompt_token_ids)
    openai_client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    response = openai_client.responses.create(
        model=MODEL, max_output_tokens=NEW, temperature=0, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "w4"},
            {"type": "input_image", "image_url": ONE[0]["content"][1]["image_url"]["url"]},
            {"type": "input_text", "text": "w5 w6"}]}])
    assert response.output_text == ref.outputs[0].text
    # The next turn's prompt holds the stored conversation, its image included.
    follow = openai_client.responses.create(model=MODEL, max_output_tokens=NEW, temperature=0,
                                            previous_response_id=response.id, input="w9")
    history = ONE + [{"role": "assistant", "content": response.output_text},
                     {"role": "user", "content": "w9"}]
    expect = offline.chat(history, SamplingParams(temperature=0, max_tokens=NEW),
                          use_tqdm=False)[0]
    assert follow.output_text == expect.outputs[0].text
    assert follow.usage.input_tokens == len(expect.prompt_token_ids)
    # vLLM's image_embeds: the rows stand in for the encoder's output.
    rows = torch.randn(NUM_IMAGE_TOKENS, 64, generator=torch.Generator().manual_seed(3))
    buf = io.BytesIO()
    torch.save(rows, buf)
    embeds = {"type": "image_embeds", "image_embeds": base64.b64encode(buf.getvalue()).decode()}
    messages = [{"role": "user", "content": [{"type": "text", "text": "w4"}, embeds]}]
    ids = offline.chat([{"role": "user", "content": [
        {"type": "text", "text": "w4"}, image_url(IMAGES[0])]}], GREEDY,
        use_tqdm=False)[0].prompt_token_ids
    start = ids.index(IMAGE_TOKEN_ID)  # the expanded span back to one placeholder
    prompt = ids[:start + 1] + ids[start + NUM_IMAGE_TOKENS:]
    expect = offline.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": rows}},
                              GREEDY, use_tqdm=False)[0]
    got = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=NEW, temperature=0,
        extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == expect.outputs[0].text


def test_refusals_leave_the_server_serving(server, offline) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    three = [{"role": "user", "content": [image_url(IMAGES[0])] * 3}]
    bad = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]
    buf = io.BytesIO()
    torch.save(torch.zeros(NUM_IMAGE_TOKENS, 32), buf)
    narrow = [{"role": "user", "content": [
        {"type": "image_embeds", "image_embeds": base64.b64encode(buf.getvalue()).decode()}]}]
    grid = io.BytesIO()
    torch.save(torch.tensor([1, 2, 2]), grid)
    buf.seek(0)
    torch.save(torch.zeros(NUM_IMAGE_TOKENS, 64), buf)
    gridded = [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": {
        "image_embeds": base64.b64encode(buf.getvalue()).decode(),
        "image_grid_thw": base64.b64encode(grid.getvalue()).decode()}}]}]
    for messages, words in ((three, "more than the 2 per prompt"), (bad, "not an image"),
                            (narrow, "32 wide, this model's image embeddings are 64 wide"),
                            (gridded, "without image_grid_thw")):
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    ref = offline.chat(ONE, GREEDY, use_tqdm=False)[0]
    # A photo-sized image (a body over the 4 MiB a text model's server takes) is served.
    photo = image(4, (1200, 1200))
    big = [{**ONE[0], "content": [ONE[0]["content"][0], image_url(photo), ONE[0]["content"][2]]}]
    assert len(big[0]["content"][1]["image_url"]["url"]) > 4 << 20
    served = client.chat.completions.create(model=MODEL, messages=big, max_completion_tokens=NEW,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert served.choices[0].message.content == \
        offline.chat(big, GREEDY, use_tqdm=False)[0].outputs[0].text
    again = client.chat.completions.create(model=MODEL, messages=ONE, max_completion_tokens=NEW,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == ref.outputs[0].text
