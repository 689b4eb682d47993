"""A tiny random Gemma 3 with images saved as transformers saves it (config, safetensors, the
Gemma 3 image processor's settings, a word-level tokenizer with Gemma's image tokens and its
"\\n\\n" token), and transformers' own processor over the same files."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

NEWLINES_ID, BOI_ID, EOI_ID, IMAGE_TOKEN_ID = 296, 297, 298, 299
IMAGE_SIZE = 56  # 4 x 4 patches of 14, pooled 2 x 2 to 4 image tokens
NUM_IMAGE_TOKENS = 4
NUM_WORDS = 200
# Smaller than one image's span: the window still cuts inside an image (transformers' mask:
# (causal or same image) and window).
SLIDING_WINDOW = 3
# The words of transformers' pan-and-scan text ("Here is the original image ... and here are
# some crops to help you see better ..."), so the tokenizer gives them ids of their own.
CROPS_WORDS = "Here is the original image and here are some crops to help you see better"
SPECIAL = {"\n\n": NEWLINES_ID, "<start_of_image>": BOI_ID, "<end_of_image>": EOI_ID,
           "<image_soft_token>": IMAGE_TOKEN_ID}


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i + 6 for i in range(NUM_WORDS)})
    for word in CROPS_WORDS.split():
        vocab.setdefault(word, len(vocab) + 2)  # after w199 (205)
    vocab.update(SPECIAL)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", extra_special_tokens={"boi_token": "<start_of_image>",
                                                 "eoi_token": "<end_of_image>",
                                                 "image_token": "<image_soft_token>"})


def tiny_config() -> transformers.Gemma3Config:
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=48, bos_token_id=2,
        eos_token_id=1, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=14)
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=NUM_IMAGE_TOKENS,
        image_token_index=IMAGE_TOKEN_ID, boi_token_index=BOI_ID, eoi_token_index=EOI_ID)


def tiny_gemma3(path: Path, seed: int = 0) -> transformers.Gemma3ForConditionalGeneration:
    """Save a tiny Gemma 3 with images in `path`; return transformers' model of it (float32,
    eager attention)."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name and "vision" in name else 0.0)
                    + 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    transformers.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    model.config._attn_implementation = "eager"
    for sub in (model.config.text_config, model.config.vision_config):
        sub._attn_implementation = "eager"
    return model


def hf_processor(path: Path) -> transformers.Gemma3Processor:
    """transformers' own Gemma3Processor over the saved image processor and tokenizer."""
    return transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        image_seq_length=NUM_IMAGE_TOKENS)
