"""The LoRA settings (their fields are the `--enable-lora`, `--lora-modules`, ... flags), and
`--lora-modules` parsed into requests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedserve.lora.request import LoRARequest


def _setting(default: Any, help_text: str, **metadata: Any) -> Any:
    return field(default=default, metadata={"help": help_text, **metadata})


@dataclass
class LoRAConfig:
    enable_lora: bool = _setting(False, "serve LoRA adapters over the base model")
    lora_modules: list[str] | None = _setting(
        None, "adapters to load at start-up: NAME=PATH values after one flag, or JSON objects "
              '{"name": ..., "path": ..., "base_model_name": ...}', metavar="NAME=PATH")
    max_loras: int = _setting(1, "most distinct adapters in one step (device slots)")
    max_lora_rank: int = _setting(16, "largest adapter rank (the slots' width)")
    max_cpu_loras: int | None = _setting(
        None, "adapters kept in host memory, least recently used out (default: max_loras)")

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        self.startup_adapters()  # malformed values fail at start-up

    def startup_adapters(self) -> list[tuple[LoRARequest, str | None]]:
        """--lora-modules as (request, base_model_name) with ids 1, 2, ... in order."""
        out = []
        for i, value in enumerate(self.lora_modules or [], start=1):
            name, path, parent = parse_module(value)
            out.append((LoRARequest(name, i, path), parent))
        names = [r.lora_name for r, _ in out]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")
        return out


def parse_module(value: str) -> tuple[str, str, str | None]:
    """NAME=PATH or a JSON object with name, path and optional base_model_name."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON: {e}") from None
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown or "name" not in spec or "path" not in spec:
            raise ValueError(f"--lora-modules {value!r}: expected keys name, path and "
                             f"optionally base_model_name")
        return str(spec["name"]), str(spec["path"]), spec.get("base_model_name")
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r} is not NAME=PATH")
    return name, path, None
