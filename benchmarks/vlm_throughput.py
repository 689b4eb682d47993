"""A vision-language model in the engine against transformers' `generate`, same inputs, one run:

    python benchmarks/vlm_throughput.py [--shape qwen2.5-vl-7b] [--num-requests 256]
        [--image-size 448] [--text-tokens 64] [--output-len 128] [--hf-batch 64] [--json FILE]
    python benchmarks/vlm_throughput.py --smoke     # a tiny shape on the CPU

A random-weight Qwen2.5-VL of the shape is made by transformers (bf16 on the GPU) and saved;
every request is --text-tokens random text ids around one random --image-size square image
(`<|vision_start|><|image_pad|><|vision_end|>`, expanded by the image processor: 256 tokens at
448x448). Printed:
- preprocessing: the image processor's time per image (the engine runs the same processor);
- the vision encoder alone: time per image through transformers' tower and through the
  engine's (`embed_multimodal`, batches of --encoder-batch images);
- transformers' `generate` (sdpa, batches of --hf-batch, left-padded, exactly --output-len
  new tokens each) and the engine's `LLM.generate` over all requests: output tok/s and the
  ratio (the issue asks >= 5x).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    # Qwen2.5-VL-7B-Instruct's config.
    "qwen2.5-vl-7b": dict(
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  max_position_embeddings=32768, rms_norm_eps=1e-6),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                    out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31])),
    "tiny": dict(
        text=dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6),
        vision=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                    out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1])),
}
# Special ids placed at the top of the vocabulary (a random model has no tokenizer).
EOS, IMAGE, VIDEO, START, END = 1, 5, 6, 7, 8


def make_model(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec = SHAPES[shape]
    text = dict(spec["text"], bos_token_id=EOS, eos_token_id=EOS,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                 "mrope_section": [16, 24, 24] if shape != "tiny"
                                 else [2, 3, 3]})
    config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(spec["vision"]),
                              image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def make_requests(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list]:
    import PIL.Image

    rng = np.random.default_rng(0)
    prompts, images = [], []
    for _ in range(args.num_requests):
        text = rng.integers(100, vocab, args.text_tokens).tolist()
        half = args.text_tokens // 2
        prompts.append(text[:half] + [START, IMAGE, END] + text[half:])
        pixels = rng.integers(0, 255, (args.image_size, args.image_size, 3), dtype=np.uint8)
        images.append(PIL.Image.fromarray(pixels))
    return prompts, images


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_generate(model, processed: list, args: argparse.Namespace) -> tuple[float, int]:
    """transformers' static batched generate over every request, left-padded: seconds and
    output tokens."""
    device = args.device
    model.generation_config.eos_token_id = None  # every request makes exactly output_len
    model.generation_config.pad_token_id = 0
    total, tokens = 0.0, 0
    for start in range(0, len(processed), args.hf_batch):
        batch = processed[start:start + args.hf_batch]
        width = max(len(p.prompt_token_ids) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p.prompt_token_ids):] = torch.tensor(p.prompt_token_ids)
            mask[i, width - len(p.prompt_token_ids):] = 1
        feats = [f for p in batch for f in p.features]
        pixels = torch.cat([f.data["pixel_values"] for f in feats]).to(device, model.dtype)
        grid = torch.stack([f.data["image_grid_thw"] for f in feats]).to(device)

        def run(ids=ids, mask=mask, pixels=pixels, grid=grid):
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 pixel_values=pixels, image_grid_thw=grid,
                                 max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False)
            return out

        total += timed(run, device)
        tokens += len(batch) * args.output_len
    return total, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-vl-7b", choices=list(SHAPES))
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--encoder-batch", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shape, CPU, few requests")
    p.add_argument("--json")
    args = p.parse_args()
    if args.smoke:
        args.shape, args.device, args.dtype = "tiny", "cpu", "float32"
        args.num_requests, args.image_size, args.output_len, args.hf_batch = 4, 56, 4, 2
        args.encoder_batch = 2
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from pagedserve import LLM, SamplingParams

    dtype = getattr(torch, args.dtype)
    row: dict = {"shape": args.shape, "requests": args.num_requests,
                 "image": args.image_size, "text_tokens": args.text_tokens,
                 "output_len": args.output_len, "device": torch.cuda.get_device_name()
                 if args.device == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        model = make_model(args.shape, args.device, dtype)
        model.save_pretrained(path)
        Qwen2VLImageProcessorPil().save_pretrained(path)
        vocab = model.config.text_config.vocab_size
        prompts, images = make_requests(args, vocab)
        # Preprocessing per image: the processor the engine uses, on one thread here.
        processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        t0 = time.perf_counter()
        for image in images[:32]:
            processor(images=[image], return_tensors="pt")
        row["preprocess_ms_per_image"] = (time.perf_counter() - t0) / min(32, len(images)) * 1e3
        # The engine's expansion of the same prompts (for transformers' inputs too).
        with LLM(model=str(path), dtype=args.dtype, device=args.device,
                 max_model_len=1024) as llm:
            mm = llm.engine.mm_processor
            processed = [mm.process(prompt, [image])
                         for prompt, image in zip(prompts, images, strict=True)]
            row["tokens_per_image"] = processed[0].features[0].placeholder.num_embeds
            feats = [p.features[0] for p in processed[:args.encoder_batch * 2]]
            runner_model = llm.engine.runner.model
            with torch.inference_mode():
                runner_model.embed_multimodal(feats[:args.encoder_batch])  # warm
                seconds = timed(lambda: runner_model.embed_multimodal(feats), args.device)
            row["engine_encoder_ms_per_image"] = seconds / len(feats) * 1e3
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            requests = [{"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}
                        for prompt, image in zip(prompts, images, strict=True)]
            llm.generate(requests[:4], params, use_tqdm=False)  # warm
            t0 = time.perf_counter()
            outs = llm.generate(requests, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            row["engine_out_tok_s"] = made / seconds
            row["engine_s"] = seconds
        if not args.skip_hf:
            with torch.inference_mode():
                pixels = torch.cat([f.data["pixel_values"] for f in feats]).to(args.device, dtype)
                grid = torch.stack([f.data["image_grid_thw"] for f in feats]).to(args.device)
                model.model.visual(pixels[:len(pixels) // 2], grid_thw=grid[:len(grid) // 2])
                seconds = timed(lambda: model.model.visual(pixels, grid_thw=grid), args.device)
            row["hf_encoder_ms_per_image"] = seconds / len(feats) * 1e3
            seconds, made = hf_generate(model, processed, args)
            row["hf_out_tok_s"] = made / seconds
            row["ratio"] = row["engine_out_tok_s"] / row["hf_out_tok_s"]
    print(json.dumps(row))
    print(f"\n{args.shape}, {args.num_requests} requests x ({args.image_size}px image = "
          f"{row['tokens_per_image']} tokens + {args.text_tokens} text) -> {args.output_len}, "
          f"{row['device']}")
    print(f"preprocess {row['preprocess_ms_per_image']:.2f} ms/image; encoder: engine "
          f"{row['engine_encoder_ms_per_image']:.2f} ms/image"
          + (f", transformers {row['hf_encoder_ms_per_image']:.2f}" if "hf_out_tok_s" in row
             else ""))
    print(f"engine {row['engine_out_tok_s']:,.0f} out tok/s"
          + (f"; transformers generate {row['hf_out_tok_s']:,.0f}; ratio {row['ratio']:.2f}x"
             if "ratio" in row else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
