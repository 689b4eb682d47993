"""Command-line flags generated from the config dataclasses (`config.setting` metadata), and
the engine built from them. Shared by `generate`, `serve` and `bench`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any

from pagedserve.config import EngineConfig, presets, section_classes
from pagedserve.server_config import ServerConfig

logger = logging.getLogger(__name__)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "(default" in help_text:
            return help_text
        return super()._get_help_string(action)


def add_config_flags(group: Any, config_cls: type, skip: tuple[str, ...] = (),
                     dest_prefix: str = "") -> None:
    """One `--kebab-case` flag per field of `config_cls` that has help text, its value in
    `args.<dest_prefix><field>`. Flags default to None, so a setting left out keeps the YAML
    preset's value or the dataclass default (which the help shows)."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        if "help" not in meta or meta.get("flag", True) is False or f.name in skip:
            continue
        kwargs: dict[str, Any] = {"dest": dest_prefix + f.name, "default": None}
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = meta["help"] or ""
        if default is not None and "(default" not in help_text:
            help_text += f" (default: {default})"
        kwargs["help"] = argparse.SUPPRESS if meta.get("hidden") else help_text
        kind = _flag_type(hints[f.name])
        if kind is not bool:
            kwargs["metavar"] = meta.get("metavar", f.name.upper())
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind == list[int]:
            kwargs.update(nargs="+", type=int, metavar="N")
        elif kind == list[str]:
            kwargs.update(nargs="+", type=str)
        else:
            kwargs["type"] = kind
            for key in ("choices", "nargs"):
                if key in meta:
                    kwargs[key] = meta[key]
        name = meta.get("flag_name", f.name.replace("_", "-"))
        group.add_argument("--" + name, *meta.get("aliases", ()), **kwargs)


def _flag_type(hint: Any) -> Any:
    """int | None -> int, list[int] | None -> list[int], int | str -> str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if len(args) == 1:
            return _flag_type(args[0])
        return str
    return hint


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    group = parser.add_argument_group("engine")
    if positional_model:
        group.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                           help="model directory or .gguf file (default: bundled SmolLM2)")
    group.add_argument("--config", help="engine settings from a YAML file or a shipped preset "
                                        f"({', '.join(presets())}); flags override them")
    for section in section_classes().values():
        add_config_flags(group, section)
    add_config_flags(group, EngineConfig)
    # vLLM's engine flag: only `serve` logs stats while it runs (every command takes it, as
    # vLLM's do).
    group.add_argument("--disable-log-stats", action="store_true", help=argparse.SUPPRESS)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    add_config_flags(group, ServerConfig)
    group.add_argument("--disable-log-requests", dest="enable_log_requests",
                       action="store_false", default=None, help=argparse.SUPPRESS)
    group.add_argument("--disable-chat-page", dest="enable_chat_page",
                       action="store_false", default=None, help=argparse.SUPPRESS)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings given on the command line (LLM(...) keywords), `config` included."""
    names = [f.name for section in section_classes().values()
             for f in dataclasses.fields(section)]
    names += [f.name for f in dataclasses.fields(EngineConfig)
              if f.name not in section_classes()]
    kwargs = {name: getattr(args, name, None) for name in names}
    positional = getattr(args, "model_pos", None)
    if positional is not None and kwargs["model"] not in (None, positional):
        # Most likely a value of the flag before it, e.g. a second --served-model-name.
        raise ValueError(f"two models given: {positional!r} (positional) and "
                         f"{kwargs['model']!r} (--model); give one")
    kwargs["model"] = positional or kwargs["model"]
    kwargs["config"] = args.config
    return {k: v for k, v in kwargs.items() if v is not None}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kwargs = engine_kwargs(args)
    config_path = kwargs.pop("config", None)
    if config_path is not None:
        config = EngineConfig.from_yaml(config_path, **kwargs)
    else:
        config = EngineConfig.from_kwargs(**kwargs)
    warn_unused(config, kwargs)
    if config.engine_core_process is None:
        # The command line's default: on a GPU the host is the bottleneck, so the core steps
        # in a process of its own while this one serves HTTP and detokenizes.
        config.engine_core_process = (config.torch_device.type == "cuda"
                                      or config.data_parallel_size > 1)
    return config


def warn_unused(config: EngineConfig, given: dict[str, Any]) -> None:
    """Settings given for the other kind of device than the one the engine runs on."""
    cuda = config.torch_device.type == "cuda"
    unused = {"gpu_memory_utilization": not cuda, "kv_cache_memory": cuda}
    for name, ignored in unused.items():
        if ignored and name in given:
            other = "kv_cache_memory" if name == "gpu_memory_utilization" else \
                "gpu_memory_utilization"
            logger.warning("--%s does not apply on %s (its KV cache budget is --%s)",
                           name.replace("_", "-"), config.torch_device.type,
                           other.replace("_", "-"))


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**given_fields(args, ServerConfig))


def make_llm(args: argparse.Namespace | EngineConfig) -> Any:
    """LLM from the engine flags (or a config built from them); a bad setting exits with a
    one-line error."""
    from pagedserve.engine.core_client import EngineStartupError
    from pagedserve.engine.llm import LLM

    try:
        config = args if isinstance(args, EngineConfig) else engine_config(args)
        return LLM(config=config)
    except (ValueError, OSError, EngineStartupError) as exc:
        raise SystemExit(f"pagedserve: error: {exc}") from None


def checked_engine_config(args: argparse.Namespace) -> EngineConfig:
    """engine_config() with a bad setting as a one-line error."""
    try:
        return engine_config(args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagedserve: error: {exc}") from None


def given_fields(args: argparse.Namespace, config_cls: type, dest_prefix: str = ""
                 ) -> dict[str, Any]:
    """The fields of `config_cls` whose flags were given (`add_config_flags`' flags)."""
    values = {f.name: getattr(args, dest_prefix + f.name, None)
              for f in dataclasses.fields(config_cls)}
    return {name: value for name, value in values.items() if value is not None}


def check_output_file(path: str | None, flag: str, command: str) -> None:
    """A one-line error before the run when the results could not be written to `path`
    (after it they would be lost); '-' is stdout."""
    if path is None or path == "-":
        return
    target = Path(path)
    parent = target.parent
    why = None
    if target.is_dir():
        why = "is a directory"
    elif not parent.is_dir():
        why = f"no such directory: {parent}"
    elif not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        why = "not writable"
    if why is not None:
        raise SystemExit(f"pagedserve {command}: error: {flag} {path}: {why}")
