"""What each GGUF architecture is in Hugging Face terms: the transformers config its metadata
describes, the Hugging Face name of each of its tensors, and what llama.cpp's converter did to the
tensors that loading has to undo. GGUF keys and tensor names come from the `gguf` package's own
constants; the Hugging Face names are those the transformers model classes (and ours) load.

llama.cpp's conventions this relies on:
- only its `llama` converter interleaves the two rope halves of each q/k head (`permute_qk`);
- its Gemma converters store every RMSNorm weight as 1 + w (Gemma scales by 1 + w at run time);
- Phi-3 keeps the fused `attn_qkv` and an `ffn_up` holding the gate rows, then the up rows (the
  Hugging Face layout of `qkv_proj` and `gate_up_proj`), and stores its long-context rope factors
  as the tensors `rope_factors_long/short`;
- what the metadata leaves out, llama.cpp's runtime fixes per architecture: Gemma 2 alternates
  sliding and global layers, Gemma 3 makes every sixth layer global with a rope base of 10000 on
  the sliding ones, and Gemma scales queries by 1/sqrt(head_dim) except in its 27B models.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
from gguf import MODEL_TENSOR, Keys
from transformers import AutoConfig, PretrainedConfig

T = MODEL_TENSOR
_LAYER = "model.layers.{bid}."

# GGUF tensor kind -> Hugging Face name (without .weight/.bias). Gemma's pre-feed-forward norm and
# everyone else's post-attention norm share the GGUF name `ffn_norm`; an architecture's tensor list
# (gguf.MODEL_TENSORS) says which of the two kinds it has.
_HF_NAMES: dict[MODEL_TENSOR, str] = {
    T.TOKEN_EMBD: "model.embed_tokens",
    T.OUTPUT_NORM: "model.norm",
    T.OUTPUT: "lm_head",
    T.ATTN_NORM: _LAYER + "input_layernorm",
    T.ATTN_Q: _LAYER + "self_attn.q_proj",
    T.ATTN_K: _LAYER + "self_attn.k_proj",
    T.ATTN_V: _LAYER + "self_attn.v_proj",
    T.ATTN_QKV: _LAYER + "self_attn.qkv_proj",
    T.ATTN_OUT: _LAYER + "self_attn.o_proj",
    T.ATTN_Q_NORM: _LAYER + "self_attn.q_norm",
    T.ATTN_K_NORM: _LAYER + "self_attn.k_norm",
    T.FFN_NORM: _LAYER + "post_attention_layernorm",
    T.ATTN_POST_NORM: _LAYER + "post_attention_layernorm",
    T.FFN_PRE_NORM: _LAYER + "pre_feedforward_layernorm",
    T.FFN_POST_NORM: _LAYER + "post_feedforward_layernorm",
    T.FFN_GATE: _LAYER + "mlp.gate_proj",
    T.FFN_UP: _LAYER + "mlp.up_proj",
    T.FFN_DOWN: _LAYER + "mlp.down_proj",
}
# Tensors that are settings, not weights: read into the config, never loaded as parameters.
CONFIG_TENSORS = frozenset({gguf.TENSOR_NAMES[T.ROPE_FACTORS_LONG],
                            gguf.TENSOR_NAMES[T.ROPE_FACTORS_SHORT]})
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")

# The architectures whose largest size llama.cpp recognises by its layer count and gives a query
# scale of 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class Metadata:
    """A GGUF reader's key/value fields and tensors, with `{arch}` in keys filled in."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        arch = reader.fields.get(Keys.General.ARCHITECTURE)
        self.arch = "" if arch is None else str(arch.contents())
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field_ = self.reader.fields.get(key.format(arch=self.arch))
        if field_ is None:
            return default
        value = field_.contents()
        if field_.types == [gguf.GGUFValueType.FLOAT32]:
            # The shortest decimal that reads back as the same float32: the value the model's
            # config.json gave (1e-06, not 9.99999997e-07).
            return float(str(np.float32(value)))
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"the GGUF file lacks the metadata key {key.format(arch=self.arch)!r}")
        return value

    def tensor_values(self, name: str) -> list[float] | None:
        """A small float tensor's values (rope factors), or None when the file has none."""
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        from gguf.quants import dequantize

        return [float(x) for x in np.asarray(dequantize(tensor.data, tensor.tensor_type)).ravel()]


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture maps onto a transformers config and model class."""

    architecture: str  # the Hugging Face class, config.architectures[0]
    model_type: str  # transformers' config type
    config_fields: Callable[[Metadata, dict[str, Any]], dict[str, Any]]
    names: dict[MODEL_TENSOR, str] = field(default_factory=dict)  # overrides of _HF_NAMES
    permute_qk: bool = False
    norm_shift: float = 0.0

    def tensor_names(self, arch: str) -> dict[str, str]:
        """GGUF name template ('blk.{bid}.attn_q') -> Hugging Face name template."""
        kinds = gguf.MODEL_TENSORS[_model_arch(arch)]
        table = {**_HF_NAMES, **self.names}
        return {gguf.TENSOR_NAMES[k]: table[k] for k in kinds if k in table}


def _model_arch(arch: str) -> gguf.MODEL_ARCH:
    return next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def hf_name(gguf_name: str, names: dict[str, str], arch: str) -> str:
    """The Hugging Face name of the GGUF tensor `gguf_name` (e.g. 'blk.3.attn_q.bias')."""
    stem, _, kind = gguf_name.rpartition(".")
    block = _BLOCK_RE.fullmatch(stem)
    template = f"blk.{{bid}}.{block.group(2)}" if block else stem
    if kind not in ("weight", "bias") or template not in names:
        raise ValueError(f"unknown tensor {gguf_name!r} in a GGUF of architecture {arch!r}")
    return names[template].format(bid=block.group(1) if block else "") + f".{kind}"


def config_from_metadata(meta: Metadata) -> PretrainedConfig:
    """The transformers config of the file's architecture."""
    spec = ARCHITECTURES.get(meta.arch)
    if spec is None:
        raise ValueError(f"GGUF architecture {meta.arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    if gguf.TENSOR_NAMES[T.ROPE_FREQS] + ".weight" in meta.tensors:
        raise ValueError("this GGUF bakes its rope scaling into `rope_freqs` (Llama 3.1 style); "
                         "load the Hugging Face checkpoint instead")
    common = _common_fields(meta)
    fields = {**common, **spec.config_fields(meta, common)}
    return AutoConfig.for_model(spec.model_type, architectures=[spec.architecture], **fields)


def _common_fields(meta: Metadata) -> dict[str, Any]:
    heads = int(meta.require(Keys.Attention.HEAD_COUNT))
    hidden = int(meta.require(Keys.LLM.EMBEDDING_LENGTH))
    return dict(
        vocab_size=_vocab_size(meta),
        hidden_size=hidden,
        intermediate_size=int(meta.require(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=int(meta.require(Keys.LLM.BLOCK_COUNT)),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=int(meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads),
        max_position_embeddings=int(meta.require(Keys.LLM.CONTEXT_LENGTH)),
        rms_norm_eps=float(meta.require(Keys.Attention.LAYERNORM_RMS_EPS)),
        rope_parameters=_rope(meta),
        tie_word_embeddings=gguf.TENSOR_NAMES[T.OUTPUT] + ".weight" not in meta.tensors,
        bos_token_id=meta.get(Keys.Tokenizer.BOS_ID),
        eos_token_id=_eos_token_ids(meta),
        pad_token_id=meta.get(Keys.Tokenizer.PAD_ID),
    )


def _vocab_size(meta: Metadata) -> int:
    """The embedding's rows: Gemma 3's converter drops the rows past its token list, and some files
    list more tokens than the model has rows, so neither the list nor a key is the model's size."""
    embedding = meta.tensors.get(gguf.TENSOR_NAMES[T.TOKEN_EMBD] + ".weight")
    if embedding is not None:
        return int(embedding.shape[-1])  # GGUF shapes run innermost first: (hidden, vocab)
    return int(meta.get(Keys.LLM.VOCAB_SIZE) or len(meta.require(Keys.Tokenizer.LIST)))


def _eos_token_ids(meta: Metadata) -> int | list[int] | None:
    """End of sequence, then end of turn and end of message when the file names them: llama.cpp
    stops on all three, and chat models (Gemma's <end_of_turn>) end their answers with the
    latter."""
    ids: list[int] = []
    for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
        value = meta.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids[0] if len(ids) == 1 else (ids or None)


def _rope(meta: Metadata) -> dict[str, Any]:
    """transformers' rope_parameters for the file's base and scaling (none, linear or YaRN)."""
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(meta.get(Keys.Rope.FREQ_BASE, 10000.0))}
    scaling = meta.get(Keys.Rope.SCALING_TYPE)
    long_factors = gguf.TENSOR_NAMES[T.ROPE_FACTORS_LONG] + ".weight"
    if scaling in (None, "none") or (scaling == "longrope" and long_factors in meta.tensors):
        return rope  # longrope: the architecture reads the factor tensors (Phi-3)
    factor = float(meta.require(Keys.Rope.SCALING_FACTOR))
    if scaling == "linear":
        return {**rope, "rope_type": "linear", "factor": factor}
    if scaling == "yarn":
        original = int(meta.require(Keys.Rope.SCALING_ORIG_CTX_LEN))
        return {**rope, "rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": original}
    raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")


# --- per-architecture config fields ---------------------------------------------------------

def _llama_fields(meta: Metadata, common: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's llama converter may give a non-default head size only as the rope dimension.
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or meta.get(Keys.Rope.DIMENSION_COUNT)
    return {"head_dim": int(head_dim or common["head_dim"])}


def _no_fields(meta: Metadata, common: dict[str, Any]) -> dict[str, Any]:
    return {}


def _gemma_query_scalar(meta: Metadata, common: dict[str, Any]) -> int | float:
    """What Gemma divides the query by (the square of): 1/scale when the file says, else
    llama.cpp's rule."""
    scale = meta.get(Keys.Attention.SCALE)
    if scale:
        scalar = 1.0 / float(scale) ** 2
        return round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-5) else scalar
    if common["num_hidden_layers"] == _GEMMA_27B_LAYERS[meta.arch]:
        return common["hidden_size"] // common["num_attention_heads"]
    return common["head_dim"]


def _gemma_layer_types(meta: Metadata, layers: int, default_every: int) -> list[str]:
    """Sliding or full attention per layer: the file's pattern (a period, or a flag per layer)
    when it has one, else every `default_every`-th layer is full."""
    pattern = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN, default_every)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _softcap(meta: Metadata, key: str) -> float | None:
    value = meta.get(key)
    return None if value is None else float(value)


def _gemma2_fields(meta: Metadata, common: dict[str, Any]) -> dict[str, Any]:
    return dict(
        query_pre_attn_scalar=_gemma_query_scalar(meta, common),
        sliding_window=int(meta.require(Keys.Attention.SLIDING_WINDOW)),
        layer_types=_gemma_layer_types(meta, common["num_hidden_layers"], 2),
        attn_logit_softcapping=_softcap(meta, Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
        final_logit_softcapping=_softcap(meta, Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
    )


def _gemma3_fields(meta: Metadata, common: dict[str, Any]) -> dict[str, Any]:
    # Global layers take the file's base and scaling; sliding ones llama.cpp's fixed 10000 unless
    # the file gives a base of their own.
    local = {"rope_type": "default",
             "rope_theta": float(meta.get(Keys.Rope.FREQ_BASE_SWA, 10000.0))}
    return {**_gemma2_fields(meta, common),
            "layer_types": _gemma_layer_types(meta, common["num_hidden_layers"], 6),
            "rope_parameters": {"full_attention": common["rope_parameters"],
                                "sliding_attention": local}}


def _phi3_fields(meta: Metadata, common: dict[str, Any]) -> dict[str, Any]:
    rope = dict(common["rope_parameters"])
    rotary = meta.get(Keys.Rope.DIMENSION_COUNT)
    if rotary:
        rope["partial_rotary_factor"] = int(rotary) / common["head_dim"]
    original = meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN) or common["max_position_embeddings"]
    long_factor = meta.tensor_values(gguf.TENSOR_NAMES[T.ROPE_FACTORS_LONG] + ".weight")
    if long_factor is not None:
        rope = {**rope, "rope_type": "longrope", "long_factor": long_factor,
                "short_factor": meta.tensor_values(
                    gguf.TENSOR_NAMES[T.ROPE_FACTORS_SHORT] + ".weight") or long_factor,
                "original_max_position_embeddings": int(original)}
        attn_factor = meta.get(Keys.Rope.SCALING_ATTN_FACTOR)
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    window = meta.get(Keys.Attention.SLIDING_WINDOW)
    return dict(rope_parameters=rope, original_max_position_embeddings=int(original),
                sliding_window=int(window) if window else None)  # 0: none (Phi-4)


ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", _llama_fields, permute_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", _no_fields),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", _no_fields),
    "gemma2": GGUFArch("Gemma2ForCausalLM", "gemma2", _gemma2_fields, norm_shift=1.0),
    "gemma3": GGUFArch("Gemma3ForCausalLM", "gemma3_text", _gemma3_fields, norm_shift=1.0),
    "phi3": GGUFArch("Phi3ForCausalLM", "phi3", _phi3_fields,
                     names={T.FFN_UP: _LAYER + "mlp.gate_up_proj"}),
}
