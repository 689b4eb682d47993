"""A single-file GGUF checkpoint (llama.cpp's format): the Hugging Face config from its metadata
(read from the reader we already hold; transformers' `AutoConfig(gguf_file=)` would parse the file
again, ~4 s), its tensors dequantised to float32 under Hugging Face names, and its tokenizer.

Only the `llama` architecture is read (Llama, SmolLM2 and llama.cpp's Mistral conversions).
llama.cpp's converter interleaves the two rope halves of every q/k head; `gguf_weights` undoes
that so the rotate-half rope of transformers (and of our model) applies unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, PretrainedConfig

from pagedserve import envs

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# GGUF tensor name -> Hugging Face name; {} is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` (memory-maps the file; parses the metadata, ~2 s for SmolLM2)."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("reading a .gguf file needs the `gguf` package: pip install gguf") \
            from exc
    return gguf.GGUFReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: Any) -> PretrainedConfig:
    """The transformers config the file's metadata describes."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF bakes its rope scaling into `rope_freqs` (Llama 3.1 style); "
                         "load the Hugging Face checkpoint instead")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    head_dim = _field(reader, f"{arch}.attention.key_length") or \
        _field(reader, f"{arch}.rope.dimension_count") or hidden // heads
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope = {**rope, "rope_type": "linear",
                "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def gguf_chat_template(reader: Any) -> str | None:
    return _field(reader, "tokenizer.chat_template")


def tokenizer_cache_dir() -> Path | None:
    """Where converted GGUF tokenizers are kept: $PAGEDSERVE_CACHE_DIR (empty: no cache), else
    $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve."""
    if envs.PAGEDSERVE_CACHE_DIR == "":
        return None
    return envs.cache_root() / "gguf-tokenizers"


def gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer for the GGUF file. Converting the vocab and merges takes ~3 s, so
    the result is saved (save_pretrained, ~0.1 s to reload) in the user's cache, keyed by the
    file's name, size and mtime; any problem with the cache falls back to converting."""
    from transformers import AutoTokenizer

    cache_root = tokenizer_cache_dir()
    stat = path.stat()
    entry = None
    if cache_root is not None:
        entry = cache_root / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        if (entry / "tokenizer_config.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(entry))
            except Exception:  # a damaged entry: rebuild it below
                shutil.rmtree(entry, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if entry is not None:
        _save_to_cache(tokenizer, entry)
    return tokenizer


def _save_to_cache(tokenizer: Any, entry: Path) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=entry.parent)
    except OSError:
        return  # an unwritable cache only costs the conversion next time
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, entry)  # atomic: a concurrent reader sees all or nothing
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def hf_name(gguf_name: str) -> str:
    match = _LAYER_RE.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in _LAYER_NAMES:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _GLOBAL_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[stem]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the rope halves (rows of a q/k weight or bias)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
            .swapaxes(1, 2).reshape(rows, *rest))


def gguf_weights(reader: Any, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 CPU tensor) for every tensor, dequantised one at a time."""
    from gguf.quants import dequantize

    heads = {"self_attn.q_proj": config.num_attention_heads,
             "self_attn.k_proj": config.num_key_value_heads}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type)
        for proj, num_heads in heads.items():
            if f".{proj}." in name:
                array = unpermute_rope_rows(array, num_heads)
        # F32/F16 tensors come back as read-only views of the memory map: copy them.
        yield name, torch.from_numpy(np.ascontiguousarray(array) if array.flags.writeable
                                     else np.array(array))
