"""A GGUF kept quantized on the GPU against the same file dequantized to bf16 at load, in the
engine: issue #50's GGUF row (Q4_K_M's layout, the 8B shape, batch-1 decode <= 0.5x).

    python benchmarks/gguf_engine.py [--shape 8b] [--decode-tokens 256] [--json FILE]
    python benchmarks/gguf_engine.py --smoke    # a tiny file on the CPU, Triton interpreter

Writes a Llama GGUF of the shape with random valid blocks (`gguf_blocks.random_blocks`) of
the types llama.cpp's Q4_K_M gives each tensor (`gguf_linear.py`'s rule: Q4_K, with v and down
in Q6_K in the layers it spends more bits on, the head in Q6_K; norms float32), then runs the
engine on it twice: as it loads a GGUF on CUDA by default (every weight dequantized to bf16)
and with `--quantization gguf` (the linears' blocks kept for the Triton GEMMs). For each: the
weight bytes and the batch-1 decode time per token (one 128-token prompt); the kept engine's
teacher-forced KL against the dense one on the dense engine's greedy continuations shows both
read the same weights.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from gguf_linear import SHAPES, more_bits
from quant_engine import decode_seconds_per_token, measured_row, quality

from pagedserve import LLM
from pagedserve.bench import random_prompts
from pagedserve.quantization.gguf_blocks import random_blocks
from pagedserve.quantization.gguf_types import Q4_K, Q6_K

HEADS = {"8b": (32, 8), "smoke": (2, 1)}  # attention heads, KV heads


def write_random_q4_k_m(path: Path, shape: str, seed: int = 0) -> None:
    """A Llama GGUF of `shape` (gguf_linear.SHAPES) with random Q4_K_M-layout blocks."""
    import gguf
    import numpy as np

    layers, hidden, q_rows, kv_rows, inter, vocab = SHAPES[shape]
    heads, kv_heads = HEADS[shape]
    g = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)

    def blocks(name: str, qtype: int, rows: int, cols: int) -> None:
        data = random_blocks(qtype, rows, cols, g).numpy()
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(qtype))

    ones = np.ones(hidden, dtype=np.float32)
    blocks("token_embd.weight", Q4_K, vocab, hidden)
    for i in range(layers):
        wide = Q6_K if more_bits(i, layers) else Q4_K
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        blocks(f"blk.{i}.attn_q.weight", Q4_K, q_rows, hidden)
        blocks(f"blk.{i}.attn_k.weight", Q4_K, kv_rows, hidden)
        blocks(f"blk.{i}.attn_v.weight", wide, kv_rows, hidden)
        blocks(f"blk.{i}.attn_output.weight", Q4_K, hidden, q_rows)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        blocks(f"blk.{i}.ffn_gate.weight", Q4_K, inter, hidden)
        blocks(f"blk.{i}.ffn_up.weight", Q4_K, inter, hidden)
        blocks(f"blk.{i}.ffn_down.weight", wide, hidden, inter)
    writer.add_tensor("output_norm.weight", ones)
    blocks("output.weight", Q6_K, vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run(path: Path, quantization: str | None, args: argparse.Namespace,
        continuation: dict) -> dict:
    llm = LLM(model=str(path), dtype=args.dtype, quantization=quantization,
              max_model_len=1024, device=args.device)
    row: dict = {"engine": quantization or "dense"}

    def measure(vocab: int) -> None:
        row["kl"], row["top1"] = quality(llm, random_prompts(4, 32, vocab, seed=3), 16,
                                         continuation)
        row["decode_s_per_token"] = decode_seconds_per_token(llm, vocab, args.decode_tokens)

    return measured_row(llm, row, measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b", choices=list(HEADS))
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny shape on the CPU (the kept blocks in Triton's interpreter)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.device, args.dtype, args.decode_tokens = "smoke", "cpu", "float32", 8
    elif not torch.cuda.is_available():
        raise SystemExit("gguf_engine.py compares the CUDA paths: run it on a GPU (or --smoke)")
    else:
        args.device, args.dtype = "cuda", "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"random-{args.shape}-q4_k_m.gguf"
        write_random_q4_k_m(path, args.shape)
        print(f"# {path.name}: {path.stat().st_size / 1e9:.2f} GB")
        continuation: dict = {}
        rows = [run(path, None, args, continuation), run(path, "gguf", args, continuation)]
    if len(rows) == 2:
        for key in ("weight_gb", "decode_s_per_token"):
            print(f"{key:20} dense {rows[0][key]:.4g}  gguf {rows[1][key]:.4g}  "
                  f"gguf/dense {rows[1][key] / rows[0][key]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
