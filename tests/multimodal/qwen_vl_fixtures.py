"""A tiny random Qwen2.5-VL saved as transformers saves it, with a preprocessor config whose
min/max pixels keep images at a few merged tokens, and images of several sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import torch

IMAGE, VIDEO, START, END = 190, 191, 192, 193  # token ids of the tiny config
VOCAB = 200


def save_tiny_qwen2_5_vl(path: Path, text_overrides: dict | None = None,
                         vision_overrides: dict | None = None) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]})
    text.update(text_overrides or {})
    # window_size 56 px = 2x2 merge blocks per window; block 1 attends the whole image.
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    vision.update(vision_overrides or {})
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the init's, so images move the logits
        for name, p in model.named_parameters():
            if "visual" in name and p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    # 28x28 to 112x84 pixels: 1 to 12 merged tokens an image.
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 84).save_pretrained(path)
    return path


def save_flat_qwen2_5_vl(path: Path) -> Path:
    """The published checkpoints' form: a flat 4.x-style config (text fields at the top,
    rope_scaling type mrope) with the head tied to the embedding (Qwen2.5-VL-3B's)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig.from_dict({
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": True, "image_token_id": IMAGE, "video_token_id": VIDEO,
        "vision_start_token_id": START, "vision_end_token_id": END,
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 48,
                          "num_heads": 2, "out_hidden_size": 64, "window_size": 56,
                          "fullatt_block_indexes": [1], "hidden_act": "silu"}})
    torch.manual_seed(1)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(path)
    return path


# Qwen2-VL's chat template, in short: an image part renders as the image placeholder.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def save_qwen_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary (w<i> for id i) with Qwen's special
    tokens at the config's ids, and the chat template above."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    special = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "<|im_start|>", 4: "<|im_end|>",
               5: "user", 6: "assistant", IMAGE: "<|image_pad|>", VIDEO: "<|video_pad|>",
               START: "<|vision_start|>", END: "<|vision_end|>"}
    vocab = {special.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for i, t in special.items() if i > 2
                            and t.startswith("<")])
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                               bos_token="<s>", eos_token="</s>")
    out.chat_template = CHAT_TEMPLATE
    out.save_pretrained(path)


def bind_cpu_encoder(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower's attention bound to the CPU backend, as the runner binds it."""
    from pagedserve.attention.registry import get_backend_cls
    from pagedserve.multimodal.encoder_attention import bind_encoder_attention

    bind_encoder_attention(model, get_backend_cls("CPU"), torch.device("cpu"),
                           torch.float32, 4096)
    return model


def images() -> list[PIL.Image.Image]:
    """Three random RGB images of different sizes (6, 4 and 12 merged tokens)."""
    rng = np.random.default_rng(0)
    return [PIL.Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
            for h, w in ((60, 90), (56, 56), (84, 112))]


def image_prompt(text_before: list[int], *texts_after: list[int]) -> list[int]:
    """Text, then for each further text an image placeholder followed by it."""
    ids = list(text_before)
    for text in texts_after:
        ids += [START, IMAGE, END, *text]
    return ids


def save_tiny_qwen3_vl(path: Path) -> Path:
    """Qwen3-VL: 16-pixel patches, a 6x6 learned position table, DeepStack after blocks 0
    and 1 of 3, interleaved M-RoPE."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    config = Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=36,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32,
                             max_pixels=128 * 96).save_pretrained(path)
    return path


@torch.no_grad()
def prefill_logits(ours: torch.nn.Module, prompt, rows: list[torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """The decoder over a whole prompt (image rows, the encoder's unless given, written over
    the placeholders' token embeddings; [3, T] positions) through the paged CPU backend:
    every position's logits."""
    from pagedserve.attention.forward_context import set_forward_context
    from tests.utils.paged import PagedHarness

    ids = torch.tensor(prompt.prompt_token_ids)
    n = len(ids)
    embeds = ours.embed_input_ids(ids)
    if rows is None:
        rows = ours.embed_multimodal(prompt.features)
    for feature, image_rows in zip(prompt.features, rows, strict=True):
        embeds[feature.placeholder.offset:feature.placeholder.end] = image_rows
    harness = PagedHarness(ours, [n])
    common = harness.common_builder.build(np.array([0]), np.array([0], np.int32),
                                          np.array([n], np.int32), 1,
                                          harness.block_table.table)
    metadata = {cfg: b.build(common) for cfg, b in harness.builders.items()}
    with set_forward_context(metadata, harness.kv_caches):
        hidden = ours(ids, torch.from_numpy(prompt.mrope_positions), embeds)
    return ours.compute_logits(hidden)
