"""Qwen3-VL against transformers' own float32 model: the tower's merger and DeepStack rows,
the prompt positions, and the prefill logits with DeepStack and interleaved M-RoPE."""

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
    save_tiny_qwen3_vl,
)


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    from pagedserve.models.loader import build_model, safetensors_weights
    from pagedserve.multimodal.qwen_vl_processing import QwenVLProcessor
    from tests.multimodal.qwen_vl_fixtures import bind_cpu_encoder

    path: Path = save_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))
    reference = Qwen3VLForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager").eval()
    config = AutoConfig.from_pretrained(path)
    ours = bind_cpu_encoder(build_model(config, torch.float32, torch.device("cpu"),
                                        safetensors_weights(path)))
    return reference, ours, QwenVLProcessor(config, None, str(path))


@torch.no_grad()
def test_qwen3_vl_tower_prompt_and_prefill_match_transformers(parts) -> None:
    reference, ours, processor = parts
    ims = images()
    prompt = processor.process(image_prompt([3, 4], [5], [6, 7]), [ims[2], ims[1]])
    feats = prompt.features
    pixels = torch.cat([f.data["pixel_values"] for f in feats])
    grids = torch.stack([f.data["image_grid_thw"] for f in feats])
    expected = reference.model.get_image_features(pixels, grids)
    rows = ours.embed_multimodal(feats)
    width = 64
    for i, got in enumerate(rows):  # the merger's row, then each DeepStack merger's
        torch.testing.assert_close(got[:, :width], expected.pooler_output[i], rtol=0,
                                   atol=1e-5)
        for j, stacked in enumerate(expected.deepstack_features):
            torch.testing.assert_close(got[:, width * (j + 1):width * (j + 2)], stacked[i],
                                       rtol=0, atol=1e-5)

    ids = torch.tensor(prompt.prompt_token_ids)
    pos, delta = reference.model.get_rope_index(ids[None], (ids[None] == IMAGE).int(), grids)
    np.testing.assert_array_equal(prompt.mrope_positions, pos[:, 0].numpy())
    assert prompt.mrope_delta == int(delta)

    logits = reference(input_ids=ids[None], pixel_values=pixels, image_grid_thw=grids,
                       mm_token_type_ids=(ids[None] == IMAGE).int()).logits[0]
    torch.testing.assert_close(prefill_logits(ours, prompt, rows), logits, rtol=0, atol=1e-5)
