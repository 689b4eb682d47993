"""The LoRA flags: several NAME=PATH values after one --lora-modules, JSON values, and the
settings refused with a message naming them."""

from __future__ import annotations

import json

import pytest

from pagedserve.arg_utils import engine_config
from pagedserve.cli import build_parser
from pagedserve.config import EngineConfig
from pagedserve.lora import LoRARequest


def _config(*flags: str) -> EngineConfig:
    return engine_config(build_parser().parse_args(["generate", "--prompt", "hi", *flags]))


def test_flags_become_the_lora_section():
    spec = json.dumps({"name": "sql", "path": "/a/sql", "base_model_name": "base"})
    config = _config("--enable-lora", "--lora-modules", "chat=/a/chat", spec, "--max-loras",
                     "4", "--max-lora-rank", "64", "--max-cpu-loras", "8")
    lora = config.lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (
        True, 4, 64, 8)
    assert lora.startup_adapters() == [(LoRARequest("chat", 1, "/a/chat"), None),
                                       (LoRARequest("sql", 2, "/a/sql"), "base")]


@pytest.mark.parametrize("kwargs, message", [
    (dict(enable_lora=True, lora_modules=["nopath"]), "'nopath' is not NAME=PATH"),
    (dict(enable_lora=True, lora_modules=['{"name": "x"}']), "expected keys name, path"),
    (dict(enable_lora=True, lora_modules=["a=/x", "a=/y"]), "names an adapter twice"),
    (dict(lora_modules=["a=/x"]), "--lora-modules needs --enable-lora"),
    (dict(enable_lora=True, max_loras=0), "max_loras must be >= 1, got 0"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras .2. must be >= "),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(device="cpu", **kwargs)


def test_lora_int_id_zero_is_the_base():
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("a", 0, "/x")
