"""Gemma 3's pan-and-scan against transformers' own Gemma3Processor and
Gemma3ForConditionalGeneration (float32, eager attention): a wide image becomes the original
and its crops, the expanded prompt ids, the pixels and the bidirectional groups equal
transformers' processor's, an image too small to crop gets none, greedy tokens and top-5
logprobs equal transformers' generate; the setting comes from preprocessor_config.json or
mm_processor_kwargs (`--mm-processor-kwargs`), and bad settings are refused by name."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.arg_utils import add_engine_args, engine_config
from pagedserve.config import EngineConfig
from pagedserve.models.gemma3_processing import Gemma3Processor
from pagedserve.models.gemma3_vl import Gemma3ForConditionalGeneration
from pagedserve.multimodal.encoder_cache import check_encoder_budget
from pagedserve.multimodal.processing import ProcessorSettings
from tests.multimodal.gemma3_models import (
    IMAGE_TOKEN_ID,
    NUM_IMAGE_TOKENS,
    hf_processor,
    tiny_gemma3,
)
from tests.multimodal.llava_models import image
from tests.utils.paged import check_top_logprobs

NUM_NEW = 5
# Crops of at least 16 pixels: a 40 x 130 image (ratio 3.25) becomes 3 crops of 44 x 40 (the
# default 256 would crop nothing this small).
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
TEXT = "w0 w1 <start_of_image> w2 w3 <start_of_image> w4"
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_pas")
    return path, tiny_gemma3(path)


@pytest.fixture(scope="module")
def llm(gemma3):
    path, _ = gemma3
    return LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB",
               mm_processor_kwargs=PAN_AND_SCAN)


@pytest.fixture(scope="module")
def images():
    # Wide enough for 3 crops; and one of ratio 1.04, too square to crop.
    return [image(0, (40, 130)), image(1, (50, 52))]


def _groups(types: np.ndarray) -> np.ndarray:
    """transformers' bidirectional groups of token_type_ids: each run of image tokens its
    own group id, -1 elsewhere (modeling_gemma3.get_block_sequence_ids_for_mask)."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    return get_block_sequence_ids_for_mask(torch.from_numpy(types)[None])[0].numpy()


def test_prompt_pixels_and_groups_equal_transformers(gemma3, llm, images):
    """Our token-level expansion of a cropped and an uncropped image equals transformers'
    processor on the same text with the same settings; each crop is its own bidirectional
    group, exactly as transformers' token_type_ids make them."""
    path, _ = gemma3
    ours = llm.engine.mm_processor
    ids = llm.get_tokenizer()(TEXT)["input_ids"]
    got = ours.process(ids, images)
    ref = hf_processor(path)(text=TEXT, images=[images], return_tensors="pt", **PAN_AND_SCAN)
    assert got.prompt_token_ids == ref["input_ids"][0].tolist()
    assert ref["input_ids"][0].tolist().count(IMAGE_TOKEN_ID) == 5 * NUM_IMAGE_TOKENS
    wide, small = got.features
    assert wide.data["pixel_values"].shape == (4, 3, 56, 56)  # the original and 3 crops
    assert small.data["pixel_values"].shape == (3, 56, 56) and small.placeholder.is_embed is None
    torch.testing.assert_close(torch.cat([wide.data["pixel_values"],
                                          small.data["pixel_values"][None]]),
                               ref["pixel_values"], rtol=0, atol=0)
    groups = np.full(len(got.prompt_token_ids), -1)
    for f in got.features:
        for start, end in zip(*f.placeholder.embed_runs, strict=True):
            groups[start:end] = groups.max() + 1
    np.testing.assert_array_equal(groups, _groups(ref["token_type_ids"][0].numpy()))
    # The budgets count the crops: one image may take 1 + 4 squares' rows.
    assert ours.max_image_tokens == 5 * NUM_IMAGE_TOKENS
    assert wide.placeholder.num_embeds == 4 * NUM_IMAGE_TOKENS
    with pytest.raises(ValueError, match="image 0 takes 16 embedding rows, more than the "
                                         "engine's encoder_cache_size of 15"):
        check_encoder_budget(got.features, 15)


@torch.no_grad()
def _transformers_generate(hf, inputs) -> tuple[list[int], torch.Tensor]:
    ids, types = inputs["input_ids"], inputs["token_type_ids"]
    hf.generation_config.eos_token_id = None
    out = hf.generate(ids, pixel_values=inputs["pixel_values"],
                      attention_mask=torch.ones_like(ids), token_type_ids=types,
                      max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
    logits = hf(input_ids=out, pixel_values=inputs["pixel_values"],
                token_type_ids=torch.nn.functional.pad(types, (0, NUM_NEW))).logits[0]
    n = ids.shape[1]
    return out[0, n:].tolist(), torch.log_softmax(logits[n - 1:-1].float(), dim=-1)


@pytest.fixture(scope="module")
def reference(gemma3, images):
    """transformers' processor's inputs for TEXT, its greedy tokens and log-distributions."""
    path, hf = gemma3
    inputs = hf_processor(path)(text=TEXT, images=[images], return_tensors="pt",
                                **PAN_AND_SCAN)
    return (inputs["input_ids"][0].tolist(), *_transformers_generate(hf, inputs))


def _check(llm, images, reference) -> None:
    ids = llm.get_tokenizer()(TEXT)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                       params, use_tqdm=False)[0]
    prompt, tokens, logprobs = reference
    assert out.prompt_token_ids == prompt
    assert out.outputs[0].token_ids == tokens
    check_top_logprobs(out.outputs[0].logprobs, logprobs)
    assert llm.engine.check_blocks_free()


def test_greedy_and_logprobs_equal_transformers(llm, images, reference):
    """A prompt with a cropped and an uncropped image: greedy tokens equal, top-5 logprobs
    within 1e-4 of transformers' generate on its processor's inputs."""
    _check(llm, images, reference)


def test_chunked_prefill_keeps_an_image_and_its_crops_in_one_step(gemma3, images, reference):
    """Steps of 40 tokens: the cropped image's span (positions 9-46: its 4 squares and the
    text between) does not fit the first chunk, which stops before it; the next holds it
    whole. Equal to transformers still; each image encoded once."""
    path, _ = gemma3
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB",
              mm_processor_kwargs=PAN_AND_SCAN, max_num_batched_tokens=40)
    _check(llm, images, reference)
    assert llm.engine.runner.multimodal.num_encoded == 2


def test_setting_from_preprocessor_config(gemma3, tmp_path, images):
    """do_pan_and_scan in preprocessor_config.json turns it on (its nulls take transformers'
    processor defaults: crops of 256 pixels, so none here); mm_processor_kwargs override it."""
    path, _ = gemma3
    settings = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**settings, "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}))
    config = transformers.AutoConfig.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXT)["input_ids"]
    from_file = Gemma3Processor(config, tokenizer, str(tmp_path)).process(ids, images)
    ref = hf_processor(path)(text=TEXT, images=[images], **PAN_AND_SCAN)
    assert from_file.prompt_token_ids == ref["input_ids"][0]
    off = Gemma3Processor(config, tokenizer, str(tmp_path), {"do_pan_and_scan": False})
    assert off.process(ids, images).prompt_token_ids == hf_processor(path)(
        text=TEXT, images=[images])["input_ids"][0]
    # The defaults' 256-pixel crops: this image is too small to crop.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**settings, "do_pan_and_scan": True, "pan_and_scan_min_crop_size": None}))
    default = Gemma3Processor(config, tokenizer, str(tmp_path))
    assert default.pan_and_scan.min_crop_size == 256
    assert [f.data["pixel_values"].dim() for f in default.process(ids, images).features] == [3, 3]
    # The budgets' largest image: the original and 4 crops.
    file_settings = ProcessorSettings(str(tmp_path))
    assert Gemma3ForConditionalGeneration.max_tokens_per_image(config, file_settings) == \
        5 * NUM_IMAGE_TOKENS


def test_flag_and_refusals(gemma3):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args(
        ["--mm-processor-kwargs", '{"do_pan_and_scan": true, "pan_and_scan_max_num_crops": 2}']))
    assert config.model.mm_processor_kwargs == {"do_pan_and_scan": True,
                                                "pan_and_scan_max_num_crops": 2}
    with pytest.raises(ValueError, match="mm_processor_kwargs is not valid JSON"):
        EngineConfig.from_kwargs(mm_processor_kwargs='{"do_pan_and_scan": tru')
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineConfig.from_kwargs(mm_processor_kwargs="[1]")
    path, _ = gemma3
    config = transformers.AutoConfig.from_pretrained(path)
    for kwargs, words in (({"do_pan_and_scan": "yes"}, "do_pan_and_scan must be true or false"),
                          ({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 0},
                           "pan_and_scan_max_num_crops must be an integer >= 1, got 0"),
                          ({"do_pan_and_scan": True, "pan_and_scan_min_ratio_to_activate": -1},
                           "pan_and_scan_min_ratio_to_activate must be a number > 0"),
                          ({"max_pixels": 4}, "'max_pixels' is not a setting")):
        with pytest.raises(ValueError, match=words):
            Gemma3Processor(config, None, str(path), kwargs)
    with pytest.raises(ValueError, match="takes no images"):
        LLM(model="random:tiny", dtype="float32", device="cpu", kv_cache_memory="4MiB",
            mm_processor_kwargs={"do_pan_and_scan": True})


def test_setting_from_a_home_relative_model_path(gemma3, tmp_path, monkeypatch):
    """A model given as `~/...`: the engine's budgets (ProcessorSettings.of the config, as
    written) read the same preprocessor_config.json as the front's processor (whose path is
    expanded), so both size an image as the original and its crops."""
    import shutil

    from pagedserve.multimodal.front import make_processor

    path, _ = gemma3
    home = tmp_path / "home"
    shutil.copytree(path, home / "g3")
    settings = json.loads((path / "preprocessor_config.json").read_text())
    (home / "g3" / "preprocessor_config.json").write_text(json.dumps(
        {**settings, "do_pan_and_scan": True}))
    monkeypatch.setenv("HOME", str(home))
    model_config = EngineConfig.from_kwargs(model="~/g3").model
    config = transformers.AutoConfig.from_pretrained(home / "g3")
    engine_rows = Gemma3ForConditionalGeneration.max_tokens_per_image(
        config, ProcessorSettings.of(model_config))
    front = make_processor(model_config.model, transformers.AutoTokenizer.from_pretrained(
        home / "g3"))
    assert engine_rows == front.max_image_tokens == 5 * NUM_IMAGE_TOKENS
