"""A tiny random LLaVA-1.5 saved as transformers saves it (config, safetensors, the CLIP image
processor's settings, a word-level tokenizer with `<image>` and a chat template), and images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

IMAGE_TOKEN_ID = 299
IMAGE_SIZE = 42  # 3 x 3 patches of 14: 9 image tokens under the "default" strategy
NUM_IMAGE_TOKENS = 9
NUM_WORDS = 200
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }} : "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT : {% endif %}")


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "USER": 3, "ASSISTANT": 4, ":": 5}
    vocab.update({f"w{i}": i + 6 for i in range(NUM_WORDS)})
    vocab["<image>"] = IMAGE_TOKEN_ID
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<image>", special=True)])
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                               bos_token="<s>", eos_token="</s>")
    out.chat_template = CHAT_TEMPLATE
    return out


def tiny_llava(path: Path, strategy: str = "default", feature_layer: int | list[int] = -2,
               seed: int = 0, head_dim: int = 16) -> transformers.LlavaForConditionalGeneration:
    """Save a tiny LLaVA-1.5 in `path` and return transformers' model of it (float32).
    `head_dim`: of the decoder's 4 heads and the tower's 2 (GPU kernels want 64)."""
    text = transformers.LlamaConfig(
        vocab_size=300, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=2, bos_token_id=1)
    vision = transformers.CLIPVisionConfig(
        hidden_size=2 * head_dim, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=14, projection_dim=32)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
        vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
        image_seq_length=NUM_IMAGE_TOKENS, projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    model.config._attn_implementation = "eager"
    for sub in (model.config.text_config, model.config.vision_config):
        sub._attn_implementation = "eager"
    return model


def image(seed: int, size: tuple[int, int] = (50, 60)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
