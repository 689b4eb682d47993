"""What FP8 (or 4-bit GPTQ) rounding alone does to a random-weight model's next-token
distributions, emulated in float32 on the CPU: the reference for `quant_engine.py`'s
KL(bf16 || quantized) and top-1 agreement on the same `random:` shape, which the GPU measures
through the engine's kernels.

    python benchmarks/fp8_random_kl.py [--shape llama3-8b] [--layers 32] [--tokens 64]
        [--quantized fp8|gptq4]

A Llama-family decoder of the preset's shape, its weights drawn as `random:` draws them
(normal, std 0.02; norms 1), layer by layer so that no more than one layer's weights are held.
One random sequence runs three ways in lockstep, each layer's weights shared:
- float32 throughout (the reference);
- bf16: every projection's input, weight and output rounded to bf16, the residual stream in
  bf16 (the bf16 engine's numerics, up to its kernels' summation order);
- FP8 as `--quantization fp8` runs a `random:` model: each projection's weight in e4m3 with
  one scale per output row, its input in e4m3 with one scale per token (dynamic), the product
  in float32 times both scales, the output in bf16; embeddings, norms and the head in bf16;
  or, with `--quantized gptq4`, each projection's weight as the random GPTQ checkpoint packs it
  (`random_packed.quantize_symmetric`: 4-bit symmetric codes, groups of 128, float16 scales)
  with bf16 inputs and outputs.
Printed: KL(float32 || bf16), KL(bf16 || fp8) in nats per position and the top-1 agreement of
each pair, and how flat the reference's logits are (their spread, the top-1 margin, the
entropy): near-flat logits turn any rounding into a different argmax and a large KL.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from pagedserve.models.random_models import RANDOM_INIT_STD, RANDOM_PRESETS
from pagedserve.quantization.random_packed import quantize_symmetric

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of x rounded to e4m3 under one scale (its amax over the format's max)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x / scale).to(FP8).float() * scale


def gptq4(w: torch.Tensor) -> torch.Tensor:
    """w as the random GPTQ int4 checkpoint (groups of 128) dequantizes it."""
    codes, scales = quantize_symmetric(w, 4, 128)
    n, k = w.shape
    return ((codes.view(n, k // 128, 128) - 8) * scales.float()[..., None]).view(n, k)


def linear(x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "fp32":
        return x @ w.T
    if mode == "bf16":
        return bf16(bf16(x) @ bf16(w).T)
    if mode == "gptq4":
        return bf16(bf16(x) @ bf16(gptq4(bf16(w))).T)
    return bf16(fp8_rows(bf16(x)) @ fp8_rows(bf16(w)).T)  # FP8 codes of the bf16 model's


def rms_norm(x: torch.Tensor, eps: float, mode: str) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if mode == "fp32" else bf16(y)


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary over the last dim (halves rotated, as Llama), x [heads, T, D]."""
    t, d = x.shape[1], x.shape[2]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def layer(h: torch.Tensor, w: dict[str, torch.Tensor], cfg: dict, mode: str) -> torch.Tensor:
    t, heads, kv = h.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    x = rms_norm(h, cfg["rms_norm_eps"], mode)
    q = linear(x, w["q"], mode).view(t, heads, d).transpose(0, 1)
    k = linear(x, w["k"], mode).view(t, kv, d).transpose(0, 1)
    v = linear(x, w["v"], mode).view(t, kv, d).transpose(0, 1)
    q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"])
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    mask = torch.full((t, t), float("-inf")).triu(1)
    att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + mask, -1) @ v
    att = att.transpose(0, 1).reshape(t, heads * d)
    if mode != "fp32":
        att = bf16(att)
    h = h + linear(att, w["o"], mode)
    if mode != "fp32":
        h = bf16(h)
    x = rms_norm(h, cfg["rms_norm_eps"], mode)
    gate, up = linear(x, w["gate"], mode), linear(x, w["up"], mode)
    act = F.silu(gate) * up
    h = h + linear(act if mode == "fp32" else bf16(act), w["down"], mode)
    return h if mode == "fp32" else bf16(h)


def draw(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, RANDOM_INIT_STD, generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(RANDOM_PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantized", default="fp8", choices=("fp8", "gptq4"))
    args = parser.parse_args()
    cfg = dict(RANDOM_PRESETS[args.shape])
    if cfg.get("model_type", "llama") not in ("llama", "mistral", "qwen2", "qwen3"):
        raise SystemExit(f"--shape {args.shape}: a dense Llama-family preset is needed")
    layers = args.layers or cfg["num_hidden_layers"]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg["vocab_size"], (args.tokens,), generator=gen)
    embed = draw((cfg["vocab_size"], hidden), gen)
    h32 = embed[ids]
    del embed
    quant = args.quantized
    states = {"fp32": h32, "bf16": bf16(h32), quant: bf16(h32)}
    for i in range(layers):
        w = {"q": draw((heads * d, hidden), gen), "k": draw((kv * d, hidden), gen),
             "v": draw((kv * d, hidden), gen), "o": draw((hidden, heads * d), gen),
             "gate": draw((inter, hidden), gen), "up": draw((inter, hidden), gen),
             "down": draw((hidden, inter), gen)}
        states = {mode: layer(h, w, cfg, mode) for mode, h in states.items()}
        if (i + 1) % 8 == 0 or i + 1 == layers:
            rel = ((states[quant] - states["bf16"]).norm() / states["bf16"].norm()).item()
            print(f"after layer {i + 1}: |{quant} - bf16| / |bf16| of the residual {rel:.4f}")
    head = draw((cfg["vocab_size"], hidden), gen)
    logits = {}
    for mode, h in states.items():
        x = rms_norm(h, cfg["rms_norm_eps"], mode)
        logits[mode] = x @ head.T if mode == "fp32" else bf16(bf16(x) @ bf16(head).T)
    ref = logits["fp32"]
    top2 = ref.topk(2, dim=-1).values
    logp = ref.log_softmax(-1)
    print(f"reference logits: std {ref.std(-1).mean():.3f}, top-1 margin over top-2 "
          f"{(top2[:, 0] - top2[:, 1]).mean():.4f} (mean), entropy "
          f"{-(logp.exp() * logp).sum(-1).mean():.2f} nats (uniform: "
          f"{math.log(cfg['vocab_size']):.2f})")
    for p, q in (("fp32", "bf16"), ("bf16", quant)):
        lp, lq = logits[p].log_softmax(-1), logits[q].log_softmax(-1)
        kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
        agree = (logits[p].argmax(-1) == logits[q].argmax(-1)).float().mean().item()
        print(f"KL({p} || {q}) {kl:.4f} nats a position, top-1 agreement {agree:.1%} "
              f"({args.shape}, {layers} layers, {args.tokens} positions)")


if __name__ == "__main__":
    main()
