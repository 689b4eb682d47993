"""A multimodal checkpoint on text prompts: Gemma 3's ConditionalGeneration layout
(`language_model.*` beside a vision tower and projector) runs as the whole model
(models/gemma3_vl.py), and greedy tokens equal transformers' multimodal model on text; the
`TEXT_DECODERS` route (a checkpoint served as its text decoder alone, for families whose vision
side is not implemented) keeps only the decoder's weights under the text model's names."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.models import load_model, registry
from tests.utils.paged import hf_greedy


def _gemma3_multimodal(path) -> torch.nn.Module:
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=12, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=299,
                                       boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def test_gemma3_multimodal_checkpoint_serves_text(tmp_path, make_llm):
    """Without a tokenizer or an image processor the checkpoint still serves text prompts;
    images are refused by name."""
    hf = _gemma3_multimodal(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"), None)
    assert type(loaded.model).__name__ == "Gemma3ForConditionalGeneration"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 296, (n,), generator=g).tolist() for n in (5, 30)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = make_llm(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    image = torch.zeros(4, 64)  # embeddings: no pixels to process either
    with pytest.raises(ValueError, match="cannot take images: it lacks a tokenizer"):
        llm.generate({"prompt_token_ids": [5, 297, 6], "multi_modal_data": {"image": image}},
                     params, use_tqdm=False)


def test_text_decoder_names_of_either_transformers_layout(monkeypatch):
    """`language_model.model.*` (older saves) and `model.language_model.*` + `lm_head.*`
    (newer) both become the text model's names; the vision tower is dropped (Gemma 3's layout,
    as registered before its vision side was implemented)."""
    from pagedserve.models.loader import text_decoder

    monkeypatch.setitem(registry.TEXT_DECODERS, "Gemma3ForConditionalGeneration", (
        "Gemma3ForCausalLM", {"language_model.": "", "model.language_model.": "model.",
                              "lm_head.": "lm_head."}))
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(num_hidden_layers=1),
        vision_config=transformers.SiglipVisionConfig(num_hidden_layers=1),
        architectures=["Gemma3ForConditionalGeneration"])
    names = ["language_model.model.norm.weight", "model.language_model.layers.0.mlp.w",
             "lm_head.weight", "vision_tower.x", "model.vision_tower.y",
             "model.multi_modal_projector.z"]
    text, weights = text_decoder(config, ((n, torch.zeros(1)) for n in names))
    assert text.architectures == ["Gemma3ForCausalLM"]
    assert [n for n, _ in weights] == ["model.norm.weight", "model.layers.0.mlp.w",
                                      "lm_head.weight"]
