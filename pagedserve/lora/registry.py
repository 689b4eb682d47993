"""The front's adapters by name (what a request's `model` may name): those of --lora-modules,
and, with --allow-runtime-lora-updating, those loaded and unloaded through the API. Ids are
never reused, so an adapter loaded again under an old name is read again by the engine."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.lora.adapter import check_adapter_dir
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.request import LoRARequest


@dataclass
class ServedAdapter:
    request: LoRARequest
    parent: str | None  # base_model_name given with it, if any


class AdapterRegistry:
    def __init__(self, config: LoRAConfig, base_name: str) -> None:
        self.max_rank = config.max_lora_rank
        self.base_name = base_name  # the served model's name: no adapter may take it
        self.adapters: dict[str, ServedAdapter] = {
            request.lora_name: ServedAdapter(request, parent)
            for request, parent in config.startup_adapters()}
        if base_name in self.adapters:
            raise ValueError(f"--lora-modules: {self._taken(base_name)}")
        self._next_id = len(self.adapters) + 1

    def _taken(self, name: str) -> str:
        # An adapter under the base's name would take every request meant for the base.
        return (f"{name!r} is the served model's own name; give the adapter another name "
                f"(or the model one with --served-model-name)")

    def get(self, name: str) -> LoRARequest | None:
        served = self.adapters.get(name)
        return served.request if served is not None else None

    def load(self, name: str, path: str) -> LoRARequest:
        """Register an adapter after the checks that need no model (ValueError names what is
        wrong); its shapes are checked against the model by the engine on first use."""
        if not name or not path:
            raise ValueError("lora_name and lora_path are both required")
        if name in self.adapters:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        if name == self.base_name:
            raise ValueError(f"lora_name {self._taken(name)}")
        try:
            check_adapter_dir(path, name, self.max_rank)
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self.adapters[name] = ServedAdapter(request, None)
        return request

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
