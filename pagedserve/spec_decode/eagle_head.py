"""EAGLE draft heads in their published Hugging Face formats, built and loaded from a directory
(config.json and safetensors or pytorch_model.bin weights).

- EAGLE-3 (`yuhuili/EAGLE3-LLaMA3.1-Instruct-8B` style): `fc` maps the concatenation of three
  hidden states tapped from the target (3H -> H); `midlayer` is one Llama decoder layer whose
  attention reads concat(input_layernorm(token embedding), hidden_norm(hidden)), so q/k/v take
  2H; `norm` and `lm_head` give logits over a draft vocabulary, mapped onto the target's by
  `d2t` (target id = draft id + d2t[draft id]; `t2d` is its inverse mask, unused here).
- EAGLE-1: `fc` over concat(token embedding, the target's final hidden state) (2H -> H, with a
  bias where the checkpoint has one), one decoder layer `layers.0` shipped without its input
  norm, no final norm, and the target's lm_head.

Both use the target's token embedding unless the head ships its own. `forward` returns the
layer's output before any final norm: the hidden state fed back for the next draft.

A head trained over an M-RoPE target (Qwen2.5-VL, Qwen3-VL) declares it in its rope settings
(`rope_scaling: {type: mrope, mrope_section}`, or `mrope_section` with `mrope_interleaved`
for Qwen3-VL's layout): its layer then turns by the target's three position rows
(`MRotaryEmbedding`, `uses_mrope`), which the proposer gives it (eagle.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from pagedserve.models.layers import RMSNorm, RotaryEmbedding, rope_parameters
from pagedserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.models.mrope_rotary import MRotaryEmbedding
from pagedserve.models.parallel import QKVParallelLinear

# Checkpoint part -> (our fused parameter, its part), as the decoder families load them.
_FUSED = {".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1),
          ".v_proj.": (".qkv_proj.", 2), ".gate_proj.": (".gate_up_proj.", 0),
          ".up_proj.": (".gate_up_proj.", 1)}


class EagleHead(nn.Module):
    """What the proposer needs of a head: the input it builds from the target's captured hidden
    states (`combine`), one forward, and the greedy target ids of its hidden states (`logits`
    over its own vocabulary, whose argmax `target_ids` maps to the target's: the draft steps'
    CUDA graphs hold the logits and argmax, the mapping runs after them)."""

    # Where its hidden input comes from: "taps" (hidden states before the target's layers
    # `tap_layers`) or "final" (the target's final-normed hidden state).
    reads = "final"
    tap_layers: tuple[int, ...] = ()
    # Its rotary turns by M-RoPE's [3, T] positions (its config's mrope_section), which the
    # proposer builds as the target's (`head_rotary`).
    uses_mrope = False

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size  # of its hidden input and output
        self.layer = LlamaDecoderLayer(config, 0, LlamaForCausalLM)
        self.rotary = RotaryEmbedding(config, self.layer.self_attn.head_dim)
        self.embed_tokens: nn.Module | None = None  # the target's unless the head ships one
        self.target_head: nn.Module | None = None  # (EAGLE-1) the target's compute_logits

    def combine(self, captured: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's own vocabulary of its output hidden states."""
        raise NotImplementedError

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids of the head's vocabulary as the target's. Default: the same vocabulary."""
        return ids

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target_ids(self.logits(hidden).argmax(dim=-1))


class Eagle3Head(EagleHead):
    reads = "taps"

    def __init__(self, config: LlamaConfig, target_hidden: int) -> None:
        super().__init__(config)
        h = config.hidden_size
        attn = self.layer.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * h, attn.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads,
                                          bias=bool(getattr(config, "attention_bias", False)))
        self.layer.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = nn.Linear(h, self.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64))
        # Some heads norm the hidden input before it becomes the residual (vLLM's flag).
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def combine(self, captured: torch.Tensor) -> torch.Tensor:
        return self.fc(captured)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(self.embed_tokens(input_ids)), normed], dim=-1)
        x = layer.self_attn(positions, x, self.rotary)
        x, residual = layer.post_attention_layernorm(x, residual)
        return layer.mlp(x) + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]


class Eagle1Head(EagleHead):
    def __init__(self, config: LlamaConfig, fc_bias: bool) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layer.input_layernorm = None  # EAGLE-1's first layer has none

    def combine(self, captured: torch.Tensor) -> torch.Tensor:
        return captured  # fc needs the token too: applied in forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden], dim=-1))
        residual = x
        x = layer.self_attn(positions, x, self.rotary)
        x, residual = layer.post_attention_layernorm(x, residual)
        return layer.mlp(x) + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target_head(hidden)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory (safetensors files, else pytorch_model*.bin)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"speculative_config: the head {str(path)!r} has no *.safetensors or "
                         "pytorch_model*.bin weights")
    return {k: v for f in files
            for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}


def load_head(method: str, model: str, target: nn.Module, dtype: torch.dtype,
              device: torch.device) -> EagleHead:
    """The head at `model` for `method` ("eagle" or "eagle3") over `target`; refused by name
    where its format or sizes do not fit the target."""
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config: the head {model!r} is not a directory with a "
                         "config.json")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("architectures", None)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    _rename_mrope_type(config)
    # Its rope table covers every position the target serves (heads often ship a shorter
    # max_position_embeddings than their target's; the rotation itself does not depend on it).
    config.max_position_embeddings = max(config.max_position_embeddings,
                                         target.config.max_position_embeddings)
    weights = {k.removeprefix("model."): v for k, v in read_weights(path).items()}
    target_config = target.config
    target_h = target_config.hidden_size
    if method == "eagle3":
        if not any(k.startswith("midlayer.") for k in weights):
            raise ValueError(f"speculative_config: {model!r} is no EAGLE-3 head (no midlayer.* "
                             "weights; an EAGLE-1 head is method 'eagle')")
        head: EagleHead = Eagle3Head(config, getattr(config, "target_hidden_size", None)
                                     or target_h)
        head.tap_layers = _tap_layers(config, target_config.num_hidden_layers, model)
        weights = {k.replace("midlayer.", "layer.", 1): v for k, v in weights.items()}
    else:
        if not any(k.startswith("layers.0.") for k in weights) or "fc.weight" not in weights:
            raise ValueError(f"speculative_config: {model!r} is no EAGLE-1 head (it needs fc "
                             "and layers.0.* weights; an EAGLE-3 head is method 'eagle3')")
        head = Eagle1Head(config, "fc.bias" in weights)
        weights = {k.replace("layers.0.", "layer.", 1): v for k, v in weights.items()}
        head.target_head = target.compute_logits
    _check_sizes(head, config, target_config, weights, model)
    head.rotary = head_rotary(config, head.layer.self_attn.head_dim, target, model)
    head.uses_mrope = isinstance(head.rotary, MRotaryEmbedding)
    embed = weights.pop("embed_tokens.weight", None)
    weights.pop("t2d", None)
    head = head.to(dtype)
    _load(head, weights, model)
    head = head.to(device)
    from pagedserve.models.layers import build_rope_caches

    build_rope_caches(head, device, dtype)
    if embed is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(embed.to(device, dtype), freeze=True)
    else:
        head.embed_tokens = target.model.embed_tokens
    return head.eval()


def _rename_mrope_type(config: LlamaConfig) -> None:
    """Rope type "mrope" (how Qwen2.5-VL heads name it: default frequencies turned by three
    rows) as "default", in place, so the rotary tables are built as the target's."""
    params = rope_parameters(config)
    if params["rope_type"] != "mrope":
        return
    params = {k: v for k, v in params.items() if k != "type"} | {"rope_type": "default"}
    if getattr(config, "rope_parameters", None) is not None:  # transformers 5
        config.rope_parameters = params
    else:
        config.rope_scaling = params


def head_rotary(config: LlamaConfig, head_dim: int, target: nn.Module,
                model: str) -> RotaryEmbedding:
    """The head's rotary embedding: M-RoPE where its rope settings give an `mrope_section`
    (over a target that places tokens by M-RoPE: a head's three rows must be the target's),
    else the ordinary one."""
    params = rope_parameters(config)
    section = params.get("mrope_section")
    if section is None:
        return RotaryEmbedding(config, head_dim)
    if not getattr(target, "uses_mrope", False):
        raise ValueError(f"speculative_config: the head {model!r} turns by M-RoPE positions "
                         f"(mrope_section {section}); the target {type(target).__name__} "
                         "places its tokens by one position row")
    try:
        return MRotaryEmbedding(config, head_dim, bool(params.get("mrope_interleaved")))
    except ValueError as exc:  # a section that does not cover the head's rotary dims
        raise ValueError(f"speculative_config: the head {model!r}: {exc}") from None


def _tap_layers(config: LlamaConfig, num_layers: int, model: str) -> tuple[int, ...]:
    """The target layers whose input the head reads: its config's
    `eagle_aux_hidden_state_layer_ids` (top level or under `eagle_config`), else EAGLE's
    default (2, L // 2, L - 3)."""
    eagle_config = getattr(config, "eagle_config", None) or {}
    ids = (getattr(config, "eagle_aux_hidden_state_layer_ids", None)
           or eagle_config.get("eagle_aux_hidden_state_layer_ids"))
    ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(ids) != 3 or any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"speculative_config: the head {model!r} taps the target's layers "
                         f"{list(ids)}; the target has {num_layers} layers (three layer ids in "
                         f"0..{num_layers - 1} are needed)")
    return ids


def _check_sizes(head: EagleHead, config: LlamaConfig, target_config: object,
                 weights: dict[str, torch.Tensor], model: str) -> None:
    fc = weights.get("fc.weight")
    if fc is not None and tuple(fc.shape) != tuple(head.fc.weight.shape):
        raise ValueError(f"speculative_config: the head {model!r} has fc of shape "
                         f"{tuple(fc.shape)}; over a target of hidden size "
                         f"{target_config.hidden_size} it needs {tuple(head.fc.weight.shape)}")
    target_vocab = target_config.vocab_size
    embed = weights.get("embed_tokens.weight")
    if embed is None and config.hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config: the head {model!r} has hidden size "
                         f"{config.hidden_size} and no embedding of its own; the target's "
                         f"embedding has {target_config.hidden_size}")
    if embed is not None and tuple(embed.shape) != (target_vocab, config.hidden_size):
        raise ValueError(f"speculative_config: the head {model!r} has an embedding of shape "
                         f"{tuple(embed.shape)}; it needs ({target_vocab}, {config.hidden_size})")
    if isinstance(head, Eagle1Head) and config.hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config: the EAGLE-1 head {model!r} has hidden size "
                         f"{config.hidden_size}, the target {target_config.hidden_size}")
    if isinstance(head, Eagle3Head):
        d2t = weights.get("d2t")
        if d2t is None and head.draft_vocab != target_vocab:
            raise ValueError(f"speculative_config: the head {model!r} has a draft vocabulary "
                             f"of {head.draft_vocab} tokens and no d2t map onto the target's "
                             f"{target_vocab}")
        if d2t is not None:
            ids = torch.arange(len(d2t)) + d2t.long()
            if len(d2t) != head.draft_vocab or ids.min() < 0 or ids.max() >= target_vocab:
                raise ValueError(f"speculative_config: the head {model!r}'s d2t maps its "
                                 f"{len(d2t)} draft tokens outside the target's vocabulary "
                                 f"of {target_vocab}")


def _load(head: EagleHead, weights: dict[str, torch.Tensor], model: str) -> None:
    """Checkpoint tensors into the head's parameters (q/k/v and gate/up into their fused
    rows); every parameter must be covered and every tensor used."""
    params = dict(head.named_parameters())
    params.update({n: b for n, b in head.named_buffers() if n == "d2t"})
    filled: dict[str, int] = {}
    for name, tensor in _fused_parts(head, weights):
        target, rows = name
        if target not in params:
            raise ValueError(f"speculative_config: the head {model!r} has a tensor "
                             f"{target!r} that no part of its format takes")
        dst = params[target].data
        if rows is not None:
            dst = dst.narrow(0, *rows)
        if dst.shape != tensor.shape:
            raise ValueError(f"speculative_config: the head {model!r}'s tensor {target!r} has "
                             f"shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor.to(dst.dtype))
        filled[target] = filled.get(target, 0) + (tensor.shape[0] if rows else dst.shape[0])
    missing = [n for n, p in params.items()
               if filled.get(n, 0) != (p.shape[0] if p.dim() else 1) and n != "d2t"]
    if missing:
        raise ValueError(f"speculative_config: the head {model!r} lacks {missing[:5]}")


def _fused_parts(head: EagleHead, weights: dict[str, torch.Tensor]
                 ) -> Iterator[tuple[tuple[str, tuple[int, int] | None], torch.Tensor]]:
    qkv, gate_up = head.layer.self_attn.qkv_proj, head.layer.mlp.gate_up_proj
    # This rank's rows of each part (all of them at one rank).
    sizes = {".qkv_proj.": (qkv.q_size, qkv.kv_size, qkv.kv_size),
             ".gate_up_proj.": (gate_up.out_features // 2,) * 2}
    for name, tensor in weights.items():
        if "rotary_emb" in name:
            continue
        for part, (ours, index) in _FUSED.items():
            if part in name:
                split = sizes[ours]
                rows = (sum(split[:index]), split[index])
                fused = name.replace(part, ours)
                shard = "qkv"[index] if ours == ".qkv_proj." else None
                yield (fused, rows), _rank_part(head, fused, tensor, shard)
                break
        else:
            yield (name, None), _rank_part(head, name, tensor, None)


def _rank_part(head: EagleHead, name: str, tensor: torch.Tensor, shard: str | None
               ) -> torch.Tensor:
    """This rank's part of a checkpoint tensor: under tensor parallelism the head's decoder
    layer is split like the target's (its attention heads and MLP rows); fc, norms and its
    lm_head stay whole on every rank."""
    module_name, _, param = name.rpartition(".")
    part = getattr(dict(head.named_modules()).get(module_name), "rank_part", None)
    return part(tensor, param, shard) if part is not None else tensor  # (a parallel layer's)
