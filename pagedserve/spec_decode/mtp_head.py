"""DeepSeek-V3's multi-token-prediction layer as a draft head, loaded from the target's own
checkpoint: layer index `num_hidden_layers` (the decoder skips it) holds `enorm`, `hnorm`,
`eh_proj` (2H -> H over concat(enorm(token embedding), hnorm(the target's final hidden
state))), a decoder layer of the target's kind (latent attention and experts), and
`shared_head.norm` / `shared_head.head` for its logits. As vLLM serves it, the embedding at
position 0 is zeroed (no token before it) and later drafts feed back the layer's output
before `shared_head.norm`. The decoder layer, its norm and head are built as a one-layer model
of the target's family, so they load through the family's own names, fused parts, experts and
quantization methods; under tensor parallelism it splits as the target does (latent
attention by heads, experts inside FusedMoE), while enorm, hnorm and eh_proj are whole on every
rank.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.distributed.parallel_state import tp_world_size
from pagedserve.models.layers import RMSNorm
from pagedserve.spec_decode.eagle_head import EagleHead

# V2's layers are V3's (a V2 checkpoint given a V3-style layer serves too).
_MTP_FAMILIES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


class MtpHead(EagleHead):
    reads = "final"

    def __init__(self, stack: nn.Module, hidden_size: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.stack = stack  # the one-layer model: layers.0, norm (shared_head.norm), lm_head
        self.hidden_size = hidden_size
        self.layer = stack.model.layers[0]
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)

    def combine(self, captured: torch.Tensor) -> torch.Tensor:
        return captured

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        embeds = self.stack.model.embed_tokens(input_ids)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = self.layer(positions, x, None, self.stack.model.rotary_emb)
        return out + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stack.compute_logits(self.stack.model.norm(hidden))


def load_mtp_head(target_path: str | None, target: nn.Module, dtype: torch.dtype,
                  device: torch.device) -> EagleHead:
    from pagedserve.models.loader import build_model
    from pagedserve.models.random_models import RANDOM_PREFIX

    config = target.config
    arch = type(target).__name__
    if arch == "Qwen3NextForCausalLM":  # its own block and names (qwen3_next_mtp.py)
        from pagedserve.spec_decode import qwen3_next_mtp

        if target_path is not None and target_path.startswith(RANDOM_PREFIX):
            return qwen3_next_mtp.random_head(config, dtype, device)
        own = _read_prefixed(_checkpoint_dir(target_path), "mtp.")
        return qwen3_next_mtp.load_qwen3_next_mtp(own, target, dtype, device)
    if arch not in _MTP_FAMILIES:
        raise ValueError(f"speculative_config: method 'mtp' is implemented for "
                         f"{', '.join(_MTP_FAMILIES + ('Qwen3NextForCausalLM',))}; the target "
                         f"is {arch}")
    if target_path is not None and target_path.startswith(RANDOM_PREFIX):
        return _random_head(config, dtype, device)
    if not getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError("speculative_config: method 'mtp': the target's config has no "
                         "num_nextn_predict_layers (its checkpoint carries no MTP layer)")
    prefix = f"model.layers.{config.num_hidden_layers}."
    own = _read_prefixed(_checkpoint_dir(target_path), prefix)
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                 "shared_head.norm.weight", "shared_head.head.weight"):
        if name not in own:
            raise ValueError(f"speculative_config: method 'mtp': the target's checkpoint lacks "
                             f"{prefix}{name}")
    stack_config = _stack_config(config)
    embed = own.pop("embed_tokens.weight", None)
    if embed is None and tp_world_size() > 1:  # this rank holds its rows only: the whole
        on_disk = _read_prefixed(_checkpoint_dir(target_path),  # one is the target's on disk
                                 "model.embed_tokens.")
        if "weight" not in on_disk:
            raise ValueError(f"speculative_config: method 'mtp': the target's checkpoint lacks "
                             f"{prefix}embed_tokens.weight and model.embed_tokens.weight")
        embed = on_disk["weight"]
    elif embed is None:
        embed = target.model.embed_tokens.weight.detach().cpu()
    stack = build_model(stack_config, dtype, device, _stack_weights(own, embed))
    head = MtpHead(stack, config.hidden_size, config.rms_norm_eps)
    with torch.no_grad():
        for name in ("enorm", "hnorm", "eh_proj"):
            getattr(head, name).weight = nn.Parameter(own[f"{name}.weight"].to(dtype),
                                                      requires_grad=False)
    return head.to(device).eval()


def _checkpoint_dir(target_path: str | None) -> Path:
    path = Path(target_path) if target_path else None
    if path is None or not path.is_dir():
        raise ValueError("speculative_config: method 'mtp' loads its layer from the target's "
                         f"checkpoint directory; {target_path!r} is none")
    return path


def _stack_config(config: PretrainedConfig) -> PretrainedConfig:
    """The one-layer model's config: its MLP dense or experts as layer `num_hidden_layers`
    of the target would have it."""
    stack_config = copy.deepcopy(config)
    stack_config.num_hidden_layers = 1
    stack_config.first_k_dense_replace = int(
        config.num_hidden_layers < config.first_k_dense_replace)
    stack_config.num_nextn_predict_layers = 0
    return stack_config


def _random_head(config: PretrainedConfig, dtype: torch.dtype, device: torch.device
                 ) -> MtpHead:
    """A random-weight MTP layer over a `random:` target, to time the path under synthetic
    acceptance (as `random:` targets are drawn: norms 1, the rest normal)."""
    from pagedserve.models.layers import build_rope_caches
    from pagedserve.models.random_models import init_random_weights
    from pagedserve.models.registry import get_model_cls

    stack_config = _stack_config(config)
    with torch.device("meta"):
        head = MtpHead(get_model_cls(stack_config)(stack_config), config.hidden_size,
                       config.rms_norm_eps)
    head = head.to(dtype).to_empty(device=device)
    init_random_weights(head, seed=1)
    build_rope_caches(head, device, dtype)
    return head.eval()


def _stack_weights(own: dict[str, torch.Tensor], embed: torch.Tensor
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The MTP layer's tensors under the one-layer model's names."""
    yield "model.embed_tokens.weight", embed
    for name, tensor in own.items():
        if re.match(r"(enorm|hnorm|eh_proj)\.", name):
            continue
        if name == "shared_head.norm.weight":
            yield "model.norm.weight", tensor
        elif name == "shared_head.head.weight":
            yield "lm_head.weight", tensor
        else:
            yield "model.layers.0." + name, tensor


def _read_prefixed(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under `prefix` (prefix dropped), reading only those."""
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.startswith(prefix):
                    out[key[len(prefix):]] = f.get_tensor(key)
    return out
