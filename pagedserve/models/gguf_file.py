"""A single-file GGUF checkpoint (llama.cpp's format): the Hugging Face config from its metadata
(read from the reader we already hold; transformers' `AutoConfig(gguf_file=)` would parse the file
again, ~4 s), its tensors dequantised to float32 under Hugging Face names, and its tokenizer.

The architectures read and what each needs are in `gguf_arch` (llama, qwen2, qwen3, gemma2,
gemma3, phi3); this module reads the file and undoes the converter's transforms tensor by tensor.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from pagedserve import envs


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` (memory-maps the file and parses its metadata), with its arrays read
    the fast way (`_fast_reader_class`)."""
    try:
        reader_class = _fast_reader_class()
    except ImportError as exc:
        raise ImportError("reading a .gguf file needs the `gguf` package: pip install gguf") \
            from exc
    try:
        return reader_class(path)
    except ValueError as exc:  # gguf's own words: "GGUF magic invalid", a reshape that fails
        if "magic" in str(exc):
            raise ValueError(f"{path} is not a GGUF file (it does not start with GGUF's magic "
                             "bytes)") from None
        raise ValueError(f"cannot read the GGUF file {path}: {exc}; is it complete? (a file "
                         "cut short, e.g. by an interrupted download, reads so)") from None


_FAST_READER: type | None = None


def _fast_reader_class() -> type:
    """gguf's reader with one change: an array field (the tokenizer's ~50k tokens, merges and
    token types) is parsed with one slice per item instead of four numpy calls, 3.7 s -> ~0.2 s
    for SmolLM2 on every load. Its fields and tensors are the plain reader's
    (tests/models/test_gguf_reader.py compares them); byte-swapped files and arrays of arrays
    take the library's own path."""
    global _FAST_READER
    if _FAST_READER is not None:
        return _FAST_READER
    import sys

    import gguf
    from gguf import GGUFValueType

    class FastGGUFReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if (raw_type != GGUFValueType.ARRAY or self.byte_order != "I"
                    or sys.byteorder != "little"):
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            item_type, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
            flat = self.data.view(np.ndarray)
            offs = orig_offs + 12
            parts: list[Any] = [raw_itype, alen]
            if item_type == GGUFValueType.STRING:
                raw = memoryview(flat)
                for _ in range(count):  # length-prefixed: each item's offset needs the last
                    size = int.from_bytes(raw[offs:offs + 8], "little")
                    parts.append(flat[offs:offs + 8].view(np.uint64))
                    parts.append(flat[offs + 8:offs + 8 + size])
                    offs += 8 + size
                data = list(range(3, 2 + 2 * count, 2))
            elif item_type in self.gguf_scalar_to_np:
                dtype = np.dtype(self.gguf_scalar_to_np[item_type])
                values = flat[offs:offs + count * dtype.itemsize].view(dtype)
                parts.extend(values[i:i + 1] for i in range(count))
                offs += count * dtype.itemsize
                data = list(range(2, 2 + count))
            else:
                return super()._get_field_parts(orig_offs, raw_type)
            types = [GGUFValueType.ARRAY] + ([item_type] if count else [])
            return offs - orig_offs, parts, data, types

    _FAST_READER = FastGGUFReader
    return FastGGUFReader


def gguf_config(reader: Any) -> PretrainedConfig:
    """The transformers config the file's metadata describes."""
    from pagedserve.models.gguf_arch import Metadata, config_from_metadata

    return config_from_metadata(Metadata(reader))


def gguf_chat_template(reader: Any) -> str | None:
    field = reader.fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()


def has_tokenizer(reader: Any) -> bool:
    """Whether the file carries a tokenizer (llama.cpp's converters always write one; a
    weights-only export may not)."""
    return "tokenizer.ggml.model" in reader.fields


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


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the rope halves (rows of a q/k weight or bias)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
            .swapaxes(1, 2).reshape(rows, *rest))


def gguf_weights(reader: Any, config: PretrainedConfig, keep_quantized: bool = False
                 ) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, float32 CPU tensor) for every weight, dequantised one at a time, with
    the converter's transforms undone (`gguf_arch`). `keep_quantized`: each linear's weight
    comes undecoded instead, as a `GGUFWeight` of the file's blocks (rows un-permuted: a row
    is whole blocks), for the GGUF method (`quantization/gguf_blocks.py`)."""
    from pagedserve.models.gguf_arch import ARCHITECTURES, CONFIG_TENSORS, Metadata, hf_name
    from pagedserve.quantization.gguf_blocks import GGUFWeight, dequantize_array

    arch = Metadata(reader).arch
    spec = ARCHITECTURES[arch]
    names = spec.tensor_names(arch)
    rope_heads = {".self_attn.q_proj.": config.num_attention_heads,
                  ".self_attn.k_proj.": config.num_key_value_heads} if spec.permute_qk else {}
    for tensor in reader.tensors:
        if tensor.name.rpartition(".")[0] in CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name, names, arch)
        linear = keep_quantized and name.endswith(("_proj.weight", "lm_head.weight"))
        array = tensor.data if linear else dequantize_array(tensor.data, tensor.tensor_type,
                                                            tensor.name)
        for proj, num_heads in rope_heads.items():
            if proj in name:
                array = unpermute_rope_rows(array, num_heads)
        if linear:
            rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
            yield name, GGUFWeight(int(tensor.tensor_type), np.ascontiguousarray(array),
                                   (rows, cols), tensor.name)
            continue
        if spec.norm_shift and tensor.name.endswith("norm.weight"):
            array = array - np.float32(spec.norm_shift)  # stored as shift + w
        # F32/F16 tensors come back as read-only views of the memory map: copy them.
        yield name, torch.from_numpy(np.ascontiguousarray(array) if array.flags.writeable
                                     else np.array(array))
