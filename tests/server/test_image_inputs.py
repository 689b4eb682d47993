"""Images in requests, what the server refuses and how: each bad image (not base64, not an
image, truncated, too many pixels), too many images, a remote URL, a path outside
--allowed-local-media-path and an image sent to a text-only model is a 400 in the API's own
shape, before the engine sees the request, and the server serves the next request. Decoding
and processing run on the media pool's threads. The app runs in this process over a tiny
text-only model; a recording processor stands in for a vision-language model's where the
refusal comes before the processor (the real processor's path: test_image_serving.py)."""

from __future__ import annotations

import base64
import io
import random
import threading

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.multimodal.inputs import MultiModalPrompt
from pagedserve.multimodal.media import (
    MediaError,
    decode_embeds,
    decode_image,
    load,
    parse_image_embeds,
    parse_image_url,
)
from pagedserve.server.api import build_app
from pagedserve.server_config import ServerConfig
from tests.utils.paged import tiny_chat_model


def png(width: int = 8, height: int = 6, mode: str = "RGB", color: tuple = (10, 200, 30)
        ) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def noise_png(size: int = 64) -> bytes:
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (size, size, 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def saved(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


# ---- decoding, without a server ---------------------------------------------------------------


def test_data_url_decodes_to_rgb_over_white() -> None:
    image = load(parse_image_url(data_url(png(5, 4, "RGBA", (9, 9, 9, 0))), None))
    assert image.mode == "RGB" and image.size == (5, 4)
    assert image.getpixel((0, 0)) == (255, 255, 255)  # transparent: white, as transformers
    assert load(parse_image_url(data_url(png()), None)).getpixel((1, 1)) == (10, 200, 30)


@pytest.mark.parametrize("raw,words", [
    (b"", "empty"),
    (b"GIF89a but not really", "not an image"),
    (noise_png()[:600], "truncated"),
    (png(10_000, 10_000, "L", 0), "10000x10000 = 100000000 pixels"),
])
def test_bad_image_bytes(raw: bytes, words: str) -> None:
    with pytest.raises(MediaError, match=words):
        decode_image(raw)


def test_corrupted_images_are_only_ever_media_errors() -> None:
    """Random bytes changed in, or cut off, images of pillow's formats: a MediaError each time
    (the server's 400), never another exception (a 500)."""
    rng = random.Random(0)
    pixels = torch.randint(0, 256, (16, 16, 3), generator=torch.Generator().manual_seed(1),
                           dtype=torch.uint8).numpy()
    seeds = []
    for fmt in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP", "ICO", "PPM", "TGA"):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, fmt)
        seeds.append(buf.getvalue())
    for _ in range(600):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        if rng.random() < 0.3:
            raw = raw[:rng.randrange(1, len(raw))]
        try:
            decode_image(bytes(raw), 1 << 20)
        except MediaError:
            pass


@pytest.mark.parametrize("url,words", [
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("http://127.0.0.1/cat.png", "remote image URLs are not fetched"),
    ("ftp://example.com/cat.png", "scheme 'ftp'"),
    ("data:image/png,abc", "not base64"),
    ("data:text/html;base64,PGI+", "not an image type"),
    ("file://server/share/cat.png", "names host"),
    ("cat.png", "not absolute"),
])
def test_refused_references(url: str, words: str, tmp_path) -> None:
    with pytest.raises(MediaError, match=words):
        parse_image_url(url, tmp_path)


def test_local_files_only_inside_the_allowed_directory(tmp_path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    assert load(parse_image_url(f"file://{allowed}/ok.png", allowed)).size == (8, 6)
    assert load(parse_image_url(str(allowed / "ok.png"), str(allowed))).size == (8, 6)
    for path in (tmp_path / "secret.png", allowed / "escape.png", allowed / ".." / "secret.png"):
        with pytest.raises(MediaError, match="outside the allowed directory"):
            parse_image_url(str(path), allowed)
    with pytest.raises(MediaError, match="without --allowed-local-media-path"):
        parse_image_url(str(allowed / "ok.png"), None)
    with pytest.raises(MediaError, match="does not exist"):
        parse_image_url(str(allowed / "missing.png"), allowed)
    (allowed / "huge.bin").write_bytes(b"\0" * (4 * 100 + (1 << 20) + 1))
    with pytest.raises(MediaError, match="more than an image of at most 100 pixels takes"):
        load(parse_image_url(str(allowed / "huge.bin"), allowed), max_pixels=100)


def test_image_embeds_as_vllm_sends_them() -> None:
    rows = torch.randn(5, 16)
    torch.testing.assert_close(load(parse_image_embeds(saved(rows))), rows, rtol=0, atol=0)
    torch.testing.assert_close(decode_embeds(base64.b64decode(saved(rows[None]))), rows)
    for bad, words in [(saved(torch.arange(6).view(2, 3)), "floating point"),
                       (saved(torch.randn(2, 3, 4)), r"shape \[2, 3, 4\]"),
                       (saved(torch.tensor([[float("nan")]])), "NaN"),
                       (base64.b64encode(b"not a pickle").decode(), "torch.save")]:
        with pytest.raises(MediaError, match=words):
            load(parse_image_embeds(bad))


def test_image_embeds_with_a_grid() -> None:
    """The Qwen-VL family's form: {"image_embeds", "image_grid_thw"}, each base64 of a saved
    tensor; the grid is one image's (t, h, w) positive integers."""
    from pagedserve.server.chat_media import MediaSettings, _source
    from pagedserve.server.protocol import ContentPart

    rows, grid = torch.randn(4, 16), torch.tensor([[1, 4, 4]])
    part = ContentPart(type="image_embeds", image_embeds={"image_embeds": saved(rows),
                                                          "image_grid_thw": saved(grid)})
    got = load(_source(part, "m", MediaSettings(enable_mm_embeds=True)))
    assert torch.equal(got["image_embeds"], rows)
    assert got["image_grid_thw"].tolist() == [1, 4, 4]
    assert got["image_grid_thw"].dtype == torch.int64
    for bad, words in [(torch.tensor([1.0, 4.0, 4.0]), "positive integers"),
                       (torch.tensor([1, 4]), r"shape \[2\]"),
                       (torch.tensor([1, 0, 4]), "positive integers")]:
        with pytest.raises(MediaError, match=words):
            load(parse_image_embeds(saved(rows), saved(bad)))


# ---- the server's refusals ----------------------------------------------------------------------


class RecordingProcessor:
    """Stands in for a vision-language model's processor: records the thread and the images it
    was given, and refuses (ValueError, as a processor whose placeholders do not match)."""

    image_placeholder = "<image>"
    hf_config = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []

    def process(self, prompt_token_ids: list[int], images: list) -> MultiModalPrompt:
        self.calls.append((threading.current_thread().name, images))
        raise ValueError("the prompt has 0 image placeholders (<image>) for 1 image")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, engine, allowed directory) over the tiny text-only model, images at most 2."""
    root = tmp_path_factory.mktemp("images")
    model = tiny_chat_model(root / "model")
    allowed = root / "media"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(png(12, 10))
    (root / "secret.png").write_bytes(png())
    engine = LLMEngine.from_kwargs(model=str(model), device="cpu", dtype="float32",
                                   kv_cache_memory="32MiB", limit_mm_per_prompt="image=2")
    config = ServerConfig(served_model_name="tiny", allowed_local_media_path=str(allowed),
                          max_image_pixels=100 * 100)
    with TestClient(build_app(AsyncLLM(engine), config)) as client:
        yield client, engine, root


def chat(client: TestClient, *parts: dict) -> dict:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                      *parts]}], "max_tokens": 2}
    return client.post("/v1/chat/completions", json=body)


def assert_openai_400(reply, words: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error


def assert_served(client: TestClient) -> None:
    reply = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_text_only_model_refuses_images_in_every_api(served) -> None:
    client, _, _ = served
    reply = chat(client, image_part(data_url(png())))
    assert_openai_400(reply, "tiny takes text only")
    assert reply.json()["error"]["param"] == "messages.0.content.1"
    anthropic = client.post("/v1/messages", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png()).decode()}}]}]})
    assert anthropic.status_code == 400
    assert anthropic.json()["type"] == "error"
    assert "takes text only" in anthropic.json()["error"]["message"]
    responses = client.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"},
        {"type": "input_image", "image_url": data_url(png())}]}]})
    assert_openai_400(responses, "takes text only")
    assert responses.json()["error"]["param"] == "input.0.content.1"
    assert_served(client)


# Templates as vision-language models write them: one prints string content and typed parts
# (Qwen2-VL's way), one typed parts only (llava-hf's way: a plain string renders as nothing).
BOTH_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}")
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() + ': ' }}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] + ' ' }}"
    "{% endfor %}{% endfor %}")


@pytest.fixture
def vision(served, monkeypatch):
    """The served engine with a recording processor and a template that places images: the
    server treats it as a model that takes images."""
    client, engine, root = served
    processor = RecordingProcessor()
    monkeypatch.setattr(engine, "mm_processor", processor, raising=False)
    monkeypatch.setattr(engine, "chat_template", BOTH_TEMPLATE)
    monkeypatch.setattr(client.app.state.server, "reads_parts", None)
    return client, processor, root


def test_string_content_becomes_a_text_part_for_templates_that_read_parts_only(served) -> None:
    from pagedserve.server.chat_media import as_parts, template_reads_parts

    tokenizer = served[1].tokenizer
    assert template_reads_parts(tokenizer, PARTS_TEMPLATE)
    assert not template_reads_parts(tokenizer, BOTH_TEMPLATE)
    # A template that indexes into the parts fails on a string: it reads parts too.
    assert template_reads_parts(tokenizer, "{{ messages[0]['content'][0]['text'] }}")
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    rendered = tokenizer.apply_chat_template(as_parts(messages), chat_template=PARTS_TEMPLATE,
                                             tokenize=False)
    assert rendered == "SYSTEM: be brief USER: <image>\nhi "


def test_bad_images_are_400s_before_the_engine(vision) -> None:
    client, processor, root = vision
    cases = [
        (image_part("https://example.com/cat.png"), "remote image URLs are not fetched"),
        (image_part("data:image/png;base64,%%%not-base64"), "not valid base64"),
        (image_part(data_url(b"plain text, not pixels")), "not an image pillow can read"),
        (image_part(data_url(noise_png()[:600])), "truncated"),
        (image_part(data_url(png(200, 100, "L", 0))), "more than this server's limit of 10000"),
        (image_part(str(root / "secret.png")), "outside the allowed directory"),
        (image_part(f"file://{root}/media/../secret.png"), "outside the allowed directory"),
        ({"type": "image_embeds", "image_embeds": saved(torch.randn(3, 4))},
         "--enable-mm-embeds"),
        ({"type": "input_audio", "input_audio": {}}, "input_audio"),
        ({"type": "text"}, "a text part needs text"),
        ({"type": "image_url"}, "needs image_url.url"),
    ]
    for part, words in cases:
        assert_openai_400(chat(client, part), words)
    assert processor.calls == []  # every refusal came before the processor
    three = [image_part(data_url(png()))] * 3
    assert_openai_400(chat(client, *three), "3 images, more than the 2 per prompt")
    assert_served(client)


def test_images_are_decoded_and_processed_on_the_media_pool(vision) -> None:
    client, processor, root = vision
    reply = chat(client, image_part(data_url(png(7, 5))),
                 image_part(f"file://{root}/media/ok.png"))
    assert_openai_400(reply, "0 image placeholders")  # the processor's ValueError, as a 400
    [(thread, images)] = processor.calls
    assert thread.startswith("pagedserve-media")
    assert [(im.mode, im.size) for im in images] == [("RGB", (7, 5)), ("RGB", (12, 10))]


def test_anthropic_and_responses_image_refusals_in_their_shapes(vision) -> None:
    client, processor, _ = vision
    reply = client.post("/v1/messages", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert reply.status_code == 400
    assert reply.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": reply.json()["error"]["message"]}}
    assert "remote image URLs are not fetched" in reply.json()["error"]["message"]
    bad = client.post("/v1/messages", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(b"nope").decode()}}]}]})
    assert bad.status_code == 400 and "not an image" in bad.json()["error"]["message"]
    responses = client.post("/v1/responses", json={
        "instructions": "be brief", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://example.com/a.png"}]}]})
    assert_openai_400(responses, "input.0.content.0: remote image URLs are not fetched")
    assert responses.json()["error"]["param"] == "input.0.content.0"
    assert processor.calls == []
    assert_served(client)
