"""Qwen2.5-VL's parts against transformers' own float32 model: the vision tower (windowed and
full-attention layers, merger), the processor's expansion and M-RoPE positions against
`get_rope_index`, the decoder's prefill logits with M-RoPE, and the runner's step positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.multimodal.qwen_vl_fixtures import (
    IMAGE,
    image_prompt,
    images,
    prefill_logits,
    save_tiny_qwen2_5_vl,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(model_dir: Path):
    from transformers import AutoConfig

    from pagedserve.models.loader import build_model, safetensors_weights
    from tests.multimodal.qwen_vl_fixtures import bind_cpu_encoder

    # As the loader builds it: on the meta device, then filled.
    return bind_cpu_encoder(build_model(AutoConfig.from_pretrained(model_dir), torch.float32,
                                        torch.device("cpu"), safetensors_weights(model_dir)))


@pytest.fixture(scope="module")
def processor(model_dir: Path):
    from transformers import AutoConfig

    from pagedserve.multimodal.qwen_vl_processing import QwenVLProcessor

    return QwenVLProcessor(AutoConfig.from_pretrained(model_dir), None, str(model_dir))


def _grids(features) -> torch.Tensor:
    return torch.stack([f.data["image_grid_thw"] for f in features])


def _rope_index(reference, ids: list[int], grids: torch.Tensor | None):
    input_ids = torch.tensor([ids])
    return reference.model.get_rope_index(input_ids, (input_ids == IMAGE).int(), grids)


@torch.no_grad()
def test_vision_tower_matches_transformers(reference, ours, processor) -> None:
    """Three images of different sizes in one call (several windows in the largest)."""
    prompt = processor.process(image_prompt([5], [6], [7], [8]), images())
    feats = prompt.features
    pixels = torch.cat([f.data["pixel_values"] for f in feats])
    expected = reference.model.get_image_features(pixels, _grids(feats)).pooler_output
    got = ours.embed_multimodal(feats)
    assert [g.shape[0] for g in got] == [6, 4, 12]
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5)


@torch.no_grad()
def test_every_block_attends_under_the_latest_plan(ours, processor, monkeypatch) -> None:
    """Window, full, window blocks: the metadata is built again at each switch, and each
    block runs under the last one built (a backend may keep a single plan per builder)."""
    binding = ours.visual.blocks[0].attn.attn.binding
    built, fresh = [], []
    build, run = binding.metadata, binding.impl.forward_encoder

    def metadata(lengths):
        built.append(build(lengths))
        return built[-1]

    def forward_encoder(q, k, v, md):
        fresh.append(md is built[-1])
        return run(q, k, v, md)

    monkeypatch.setattr(binding, "metadata", metadata)
    monkeypatch.setattr(binding.impl, "forward_encoder", forward_encoder)
    ours.embed_multimodal(processor.process(image_prompt([1], [2]), images()[2:]).features)
    assert len(built) == 3 and fresh == [True] * 3
    assert [md.num_reqs for md in built] == [4, 1, 4]  # 4 windows, 1 image, 4 windows


def test_triton_keeps_a_tower_of_any_head_size(model_dir) -> None:
    """The tower's heads (16 here; Qwen3-VL's and SigLIP's 72) are not among TRITON's paged
    kernels' sizes, but its encoder path pads the head: the tower stays on TRITON. (A decoder
    backend that cannot run the tower at all: tests/multimodal/test_mm_runner.py.)"""
    from transformers import AutoConfig

    from pagedserve.attention.registry import get_backend_cls
    from pagedserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from pagedserve.multimodal.encoder_attention import bind_encoder_attention

    model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(model_dir))
    triton = get_backend_cls("TRITON")
    layer = model.visual.blocks[0].attn.attn.layer_config(torch.float32)
    assert layer.head_size not in triton.supported_head_sizes
    assert not triton.validate_configuration(layer, 16, torch.device("cpu"))
    assert bind_encoder_attention(model, triton, torch.device("cpu"), torch.float32,
                                  4096) is triton


@torch.no_grad()
def test_memory_profile_runs_the_largest_image(ours) -> None:
    """The profile's image: max_pixels 112 x 84 allow 12 merged tokens, a 3 x 4 grid."""
    from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange
    from pagedserve.multimodal.runner import MultiModalRunner

    rows = ours.max_tokens_per_image(ours.hf_config)
    data = ours.dummy_image_data()
    assert rows == 12 and data["image_grid_thw"].tolist() == [1, 6, 8]
    feature = MultiModalFeature("image", "p", PlaceholderRange(0, rows), data)
    assert ours.embed_multimodal([feature])[0].shape == (rows, 64)
    mm = MultiModalRunner(ours, torch.device("cpu"), torch.float32, budgets=(24, 24))
    assert mm.profile() == 24 * 64 * 4  # the store's rows, float32


@pytest.mark.parametrize("texts,which", [
    ([[3, 4, 5]], []),  # no image
    ([[], [9, 10]], [0]),  # an image first
    ([[3], [4, 5], [6]], [2, 1]),  # two, the larger first
    ([[3, 4], [], [7, 8, 9]], [1, 0]),  # two images with nothing between their spans
])
def test_positions_match_get_rope_index(reference, processor, texts, which) -> None:
    ims = images()
    prompt = processor.process(image_prompt(*texts), [ims[i] for i in which])
    ids = prompt.prompt_token_ids
    assert sum(i == IMAGE for i in ids) == sum([6, 4, 12][i] for i in which)
    grids = _grids(prompt.features) if which else None
    if grids is None:  # transformers' text positions
        expected, delta = np.tile(np.arange(len(ids)), (3, 1)), 0
    else:
        pos, deltas = _rope_index(reference, ids, grids)
        expected, delta = pos[:, 0].numpy(), int(deltas)
    assert prompt.mrope_positions.dtype == np.int64
    np.testing.assert_array_equal(prompt.mrope_positions, expected)
    assert prompt.mrope_delta == delta
    for feature in prompt.features:  # each span is the image's pads
        span = ids[feature.placeholder.offset:feature.placeholder.end]
        assert span == [IMAGE] * feature.placeholder.length


def test_processor_refuses_mismatches(processor) -> None:
    with pytest.raises(ValueError, match="2 image placeholders .* for 1 images"):
        processor.process(image_prompt([1], [2], [3]), images()[:1])
    with pytest.raises(ValueError, match="precomputed embeddings with their patch grid"):
        processor.process(image_prompt([1], [2]), [torch.zeros(4, 64)])


def test_step_positions_prefill_chunks_and_decodes(reference, processor) -> None:
    """The runner's [3, T]: a prompt in two chunks that split an image's span, then decode
    tokens at index + delta; beside it a text-only request at its plain positions."""
    from pagedserve.multimodal.mrope import MRopeStepPositions

    prompt = processor.process(image_prompt([3], [4, 5], [6]), images()[:2])
    n = len(prompt.prompt_token_ids)
    req = type("R", (), dict(request_id="a", mrope_positions=prompt.mrope_positions,
                             mrope_delta=prompt.mrope_delta))()
    text = type("R", (), dict(request_id="b", mrope_positions=None, mrope_delta=0))()
    step = MRopeStepPositions(64, torch.device("cpu"))

    def run(requests, computed, scheduled):
        computed, scheduled = np.array(computed), np.array(scheduled)
        qsl = np.concatenate([[0], np.cumsum(scheduled)])
        positions = np.concatenate([np.arange(c, c + s)
                                    for c, s in zip(computed, scheduled, strict=True)])
        return step.build(requests, computed, scheduled, qsl, positions).numpy().copy()

    cut = prompt.features[0].placeholder.offset + 2  # inside the first image
    first = run([req, text], [0, 7], [cut, 1])
    np.testing.assert_array_equal(first[:, :cut], prompt.mrope_positions[:, :cut])
    np.testing.assert_array_equal(first[:, cut], [7, 7, 7])
    rest = run([req], [cut], [n - cut + 2])  # the prompt's end and two tokens past it
    np.testing.assert_array_equal(rest[:, :n - cut], prompt.mrope_positions[:, cut:])
    past = np.arange(n, n + 2) + prompt.mrope_delta
    np.testing.assert_array_equal(rest[:, n - cut:], np.tile(past, (3, 1)))
    # transformers continues generation at the text positions + rope_deltas
    _, deltas = _rope_index(reference, prompt.prompt_token_ids, _grids(prompt.features))
    assert past[0] == n + int(deltas)
    np.testing.assert_array_equal(run([text, req], [8, n + 3], [1, 1]),
                                  [[8, n + 3 + prompt.mrope_delta]] * 3)


@torch.no_grad()
def _reference_logits(reference, prompt) -> torch.Tensor:
    ids = torch.tensor([prompt.prompt_token_ids])
    pixels = torch.cat([f.data["pixel_values"] for f in prompt.features])
    return reference(input_ids=ids, pixel_values=pixels, image_grid_thw=_grids(prompt.features),
                     mm_token_type_ids=(ids == IMAGE).int()).logits[0]


@pytest.mark.slow  # the engine tests' logprobs cover it; this pins the decoder alone
def test_prefill_logits_match_transformers(reference, ours, processor) -> None:
    ims = images()
    prompt = processor.process(image_prompt([3, 4], [5], [6, 7]), [ims[2], ims[1]])
    torch.testing.assert_close(prefill_logits(ours, prompt),
                               _reference_logits(reference, prompt), rtol=0, atol=1e-5)


def test_flat_config_with_tied_head(tmp_path) -> None:
    """A published-style checkpoint: flat config, tie_word_embeddings at its top only, no
    lm_head tensor, transformers' default image processor (no preprocessor_config.json)."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from pagedserve.models.loader import build_model, safetensors_weights
    from pagedserve.multimodal.qwen_vl_processing import QwenVLProcessor
    from tests.multimodal.qwen_vl_fixtures import bind_cpu_encoder, save_flat_qwen2_5_vl

    path = save_flat_qwen2_5_vl(tmp_path)
    config = AutoConfig.from_pretrained(path)
    ours = bind_cpu_encoder(build_model(config, torch.float32, torch.device("cpu"),
                                        safetensors_weights(path)))
    assert ours.lm_head is None
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager").eval()
    prompt = QwenVLProcessor(config, None, str(path)).process(image_prompt([3], [4, 5]),
                                                              images()[1:2])
    torch.testing.assert_close(prefill_logits(ours, prompt),
                               _reference_logits(reference, prompt), rtol=0, atol=1e-5)
