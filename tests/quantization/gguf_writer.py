"""GGUF blocks written by the tests: the `gguf` package's quantizer for Q8_0 / Q4_0 / Q4_1, and
hand-made Q4_K / Q5_K / Q6_K super-blocks (a plain min/max quantizer, not llama.cpp's search:
the bytes only need to be valid, and `gguf.quants.dequantize` is the judge of what they mean).
Plus a tiny Llama GGUF with a chosen block type per tensor, written as llama.cpp's converter
writes it (q/k rows interleaved per head)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

QK_K = 256


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """float16 little-endian bytes of [n] values -> [n, 2]."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [n, 8] -> the 12 packed bytes [n, 12]."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _k_codes(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's codes [n, 8, 32] (0..levels) and fields (d, dmin, 12 scale bytes) of
    super-blocks x [n, 256]: each sub-block's range over its min (<= 0) in 6-bit steps of
    d and dmin."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63)
    mn = np.clip(np.round(-lo / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63)
    step = d[:, None] * sc
    q = np.round((sub + (dmin[:, None] * mn)[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)
    head = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales(sc, mn)], axis=1)
    return q, head


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [n, 8, 32] -> 128 bytes: byte 32c + l = sub-block 2c's l | sub-block 2c+1's << 4."""
    low = q & 0xF
    return (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    q, head = _k_codes(x, 15)
    return np.concatenate([head, _nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    q, head = _k_codes(x, 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # [n, 8, 32]: bit s of qh[l]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    return np.concatenate([head, qh, _nibbles(q)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Sixteen int8 scales (one per 16 values) in steps of d; codes - 32 in -32..31."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), -128, 127)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.round(sub / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 128)  # halves
    ql = np.zeros((q.shape[0], 2, 64), dtype=np.uint8)
    qh = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for r in range(4):  # quarters of 32 values in each half
        part = q[:, :, 32 * r:32 * r + 32]
        ql[:, :, 32 * (r % 2):32 * (r % 2) + 32] |= (part & 0xF) << (4 * (r // 2))
        qh |= (part >> 4) << (2 * r)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


_HAND_MADE = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}


def quantize(weight: np.ndarray, qtype: T) -> np.ndarray:
    """Blocks [rows, bytes per row] of a float32 [rows, cols] weight."""
    if qtype not in _HAND_MADE:
        return gguf.quants.quantize(weight, qtype)
    rows = weight.shape[0]
    return _HAND_MADE[qtype](weight.reshape(-1, QK_K)).reshape(rows, -1)


def rope_interleave(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's llama converter's q/k row order (what the loader un-permutes)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_llama_gguf(path: Path, model: torch.nn.Module, types: dict[str, T],
                     tokenizer: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """A llama GGUF of transformers' `model`; `types`: block type per Hugging Face module
    suffix ("q_proj", "down_proj", ...), or for one layer's ("1.o_proj": layer 1's, before
    "o_proj"); other tensors float32. `tokenizer` writes the tokenizer's keys (none without
    it)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    if tokenizer is not None:
        tokenizer(writer)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        array = tensor.detach().float().numpy()
        module = name.split(".")[-2]
        if module in heads:
            array = rope_interleave(array, heads[module])
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        qtype = types.get(f"{layer}.{module}", types.get(module))
        if qtype is None:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
        else:
            writer.add_tensor(gguf_name, quantize(np.ascontiguousarray(array), qtype),
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
