"""How a decoder family fills its parameters from a Hugging Face checkpoint: names mapped onto
fused parameters (q/k/v, gate/up) and stacked experts, each tensor copied (or, for a layer with
a quantization method, handed to that method with this rank's rows), and a check that the
checkpoint covered every parameter. `LlamaForCausalLM` and the families built on it take it as
a base; a family names its fused parts in `fused_names`. The inverse, a module's weights under
Hugging Face names (`hf_state_dict`), lets transformers run the very same weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedserve.attention.layer import Attention
from pagedserve.models.layers import build_rope_caches
from pagedserve.models.parallel import rank_part
from pagedserve.quantization.gguf_blocks import GGUFWeight
from pagedserve.quantization.unquantized import FP8_DTYPES

# One expert's tensor in a Hugging Face checkpoint: (layer prefix, expert, projection, tensor:
# its weight, or a quantized checkpoint's codes and scales). Qwen3-MoE names them
# gate/up/down_proj, Mixtral w1 (gate), w3 (up), w2 (down).
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                     r"\.(\w+)$")
_EXPERT_SHARD = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}

# An fp8 KV cache's per-tensor scales under their checkpoint names: FP8 checkpoints' own, and
# compressed-tensors' kv_cache_scheme (the outputs of k_proj / v_proj). Longest suffix first.
_KV_SCALES = {".k_proj.output_scale": "k_scale", ".v_proj.output_scale": "v_scale",
              ".k_scale": "k_scale", ".v_scale": "v_scale"}


def _load_kv_scale(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> None:
    """Hand a KV-cache scale to the attention layer it belongs to. A layer that is not a paged
    Attention (MLA's latent cache) never holds fp8, so its scale goes unused."""
    for suffix, which in _KV_SCALES.items():
        if name.endswith(suffix):
            attn = modules.get(name[:-len(suffix)] + ".attn")
            if isinstance(attn, Attention):
                attn.load_kv_scale(which, tensor)
            return


# Hugging Face parameter -> (our fused parameter, shard id).
_FUSED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", "gate"),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", "up"),
}


class CheckpointLoading:
    """`load_weights` and what it needs; the family provides `fused_names`, `model` and
    `lm_head`."""

    fused_names: dict[str, tuple[str, str]]

    def hf_names(self, prefix: str) -> list[str]:
        """The checkpoint's module names for our module `prefix`: a fused layer's parts
        (quantization configs name the layers to leave alone by these)."""
        parts = []
        for hf, (ours, _) in self.fused_names.items():
            ours = ours.strip(".")
            if prefix.endswith("." + ours):
                parts.append(prefix[:-len(ours)] + hf.strip("."))
        return parts or [prefix]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (possibly fused) parameters, converting dtype
        and device per tensor: a layer with a quantization method loads through it (weights and
        scales, each rank its part). Every parameter must be covered; then the rope cache is
        built on the weights' device in their dtype."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.endswith(tuple(_KV_SCALES)):  # used where the cache is fp8
                _load_kv_scale(modules, name, tensor)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if expert := _EXPERT.match(name):
                prefix, index, proj, leaf = expert.groups()
                shard = _EXPERT_SHARD[proj]
                self.get_submodule(prefix).load_expert(int(index), shard, tensor, leaf)
                loaded.add(f"{prefix}:{index}:{shard}:{leaf}")
                continue
            target, shard = name, None
            for hf_part, (ours, shard_id) in self.fused_names.items():
                if hf_part in name:
                    target, shard = name.replace(hf_part, ours), shard_id
                    break
            owner, _, leaf = target.rpartition(".")
            layer = modules.get(owner)
            if isinstance(tensor, GGUFWeight) and not getattr(
                    getattr(layer, "quant_method", None), "takes_gguf_blocks", False):
                tensor = tensor.dequantize()  # a GGUF weight for a layer of float weights
            if _has_method(layer):
                _check_not_fp8(name, tensor, layer)
                _check_float_leaf(name, leaf, layer)
                rows = self._part_rows(target, shard) if shard else None
                layer.quant_method.load(layer, leaf, tensor, shard, rows)
                # A tensor stored already fused (Phi-3's qkv_proj) fills every part.
                loaded.update([f"{owner}.{leaf}:{shard}"] if shard else
                              [k for k in self._coverage_keys(target)
                               if k.startswith(f"{owner}.{leaf}:")])
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                                 f"{type(self).__name__}{_scale_hint(name)}")
            param = params[target]
            tensor = rank_part(self.get_submodule(owner), tensor, leaf, shard)
            _check_not_fp8(name, tensor, None)
            dst = param.data if shard is None else self._shard(target, param, shard)
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.update([f"{target}:{shard}"] if shard else self._coverage_keys(target))
        missing = [n for n in self._expected_names(params, modules) if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
        emb = self.model.embed_tokens.weight
        build_rope_caches(self, emb.device, emb.dtype)

    def _part_rows(self, target: str, shard: str) -> tuple[int, int]:
        """(start, size) of fused part `shard`'s rows in this rank's parameter `target`."""
        if ".qkv_proj." in target:
            # The attention module that owns it (hybrid models have layers without one).
            attn = self.get_submodule(target.rpartition(".qkv_proj.")[0])
            q, kv = attn.q_size, attn.kv_size
            return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        # gate rows, then up rows, of any gated MLP (dense or shared experts)
        n = self.get_submodule(target.rpartition(".")[0]).out_features // 2
        return {"gate": (0, n), "up": (n, n)}[shard]

    def _shard(self, target: str, param: torch.Tensor, shard: str) -> torch.Tensor:
        return param.data.narrow(0, *self._part_rows(target, shard))

    def _expected_names(self, params: dict[str, torch.Tensor],
                        modules: dict[str, nn.Module] | None = None) -> list[str]:
        modules = modules if modules is not None else dict(self.named_modules())
        keys = []
        for name in params:
            owner = name.rpartition(".")[0]
            if _has_method(modules.get(owner)) and not name.endswith(".weight"):
                continue  # the layer's method lists its tensors, once, under its weight
            keys.extend(self._coverage_keys(name))
        return keys

    def _coverage_keys(self, name: str) -> list[str]:
        """What a complete checkpoint fills of parameter `name`: each fused shard, each expert's
        projection (a checkpoint may hold experts one by one or already stacked), each tensor a
        layer's quantization method loads."""
        owner = name.rpartition(".")[0]
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            prefix, _, stacked = name.rpartition(".")
            moe = self.get_submodule(prefix)
            shards = ("gate", "up") if stacked == "gate_up_proj" else ("down",)
            leaves = moe.quant_method.checkpoint_tensors(moe)
            return [f"{prefix}:{e}:{s}:{leaf}" for e in range(moe.num_experts) for s in shards
                    for leaf in leaves]
        shards: tuple[str | None, ...] = (None,)
        if ".qkv_proj." in name:
            shards = ("q", "k", "v")
        elif ".gate_up_proj." in name:
            shards = ("gate", "up")
        layer = self.get_submodule(owner) if owner else None
        if _has_method(layer):
            return [f"{owner}.{leaf}:{s}" for leaf in layer.quant_method.checkpoint_tensors(layer)
                    for s in shards]
        return [name] if shards == (None,) else [f"{name}:{s}" for s in shards]


def _has_method(layer: nn.Module | None) -> bool:
    """A linear that loads through its quantization method (the float one included)."""
    return hasattr(layer, "quant_method") and not hasattr(layer, "load_expert")


def _check_not_fp8(name: str, tensor: torch.Tensor, layer: nn.Module | None) -> None:
    """An FP8 tensor may only load through an FP8 method: copied into a float parameter, its
    codes would read as weights without their scales."""
    quantized = layer is not None and "quant_method" in vars(layer)
    if getattr(tensor, "dtype", None) in FP8_DTYPES and not quantized:
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, but its layer has "
                         "float weights: the model's config.json has no quantization_config "
                         "for it (or lists the layer as ignored)")


def _check_float_leaf(name: str, leaf: str, layer: nn.Module) -> None:
    """A linear of float weights takes its weight and bias only: a 4-bit checkpoint's qweight,
    scales, ... arriving here lack the quantization_config that says how to read them."""
    if "quant_method" not in vars(layer) and not isinstance(getattr(layer, leaf, None),
                                                           torch.Tensor):
        raise ValueError(f"checkpoint tensor {name!r} has no parameter in a linear of float "
                         f"weights{_scale_hint(name)}")


QUANTIZED_LEAVES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_zero_point",
                    "weight_g_idx", "weight_shape")


def _scale_hint(name: str) -> str:
    if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
        return (": a quantization scale, but the model's config.json has no "
                "quantization_config for it (or lists the layer as ignored)")
    if name.rpartition(".")[2] in QUANTIZED_LEAVES:
        return (": a quantized checkpoint's tensor, but the model's config.json has no "
                "quantization_config for it (or lists the layer as ignored)")
    return ""


def hf_parts(module: nn.Module, name: str, tensor: torch.Tensor
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameter `name` of a Llama-family module as Hugging Face tensors (a fused q/k/v or
    gate/up split back into its parts; views); a family with other fused layouts splits its
    own (`hf_parts` on the module)."""
    own = getattr(module, "hf_parts", None)
    if own is not None:
        yield from own(name, tensor)
        return
    yield from llama_hf_parts(module, name, tensor)


def llama_hf_parts(module: nn.Module, name: str, tensor: torch.Tensor
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`hf_parts` of the Llama layout: the fused q/k/v and gate/up split into their parts."""
    split = {".self_attn.qkv_proj.": ("q", "k", "v"), ".mlp.gate_up_proj.": ("gate", "up")}
    hf_name = {shard: hf.split(".")[-2] for hf, (_, shard) in _FUSED.items()}
    for fused, shards in split.items():
        if fused in name:
            for shard in shards:
                yield (name.replace(fused.split(".")[-2], hf_name[shard]),
                       module._shard(name, tensor, shard))
            return
    yield name, tensor


def hf_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """A Llama-family module's weights under Hugging Face names (the fused q/k/v and gate/up
    rows split back out; views, no copies), so transformers can run the very same weights."""
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        out.update(hf_parts(module, name, param.data))
    if getattr(module, "lm_head", None) is None and "lm_head.weight" not in out:
        out["lm_head.weight"] = module.model.embed_tokens.weight.data  # tied
    return out
