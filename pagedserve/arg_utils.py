"""Command-line flags generated from the config dataclasses (`config.setting` metadata), and
the engine built from them. Shared by `generate`, `serve` and `bench`."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from pagedserve.config import EngineConfig, ServerConfig, section_classes


def add_config_flags(group: Any, config_cls: type, skip: tuple[str, ...] = ()) -> None:
    """One `--kebab-case` flag per field of `config_cls` that has help text. Flags default to
    None, so a setting left out keeps the YAML preset's value or the dataclass default (which
    the help shows)."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        if "help" not in meta or meta.get("flag", True) is False or f.name in skip:
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": None}
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = meta["help"] or ""
        if default is not None and "(default" not in help_text:
            help_text += f" (default: {default})"
        kwargs["help"] = argparse.SUPPRESS if meta.get("hidden") else help_text
        kind = _flag_type(hints[f.name])
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind == list[int]:
            kwargs.update(nargs="+", type=int, metavar="N")
        else:
            kwargs["type"] = kind
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)


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
    group.add_argument("--config", help="YAML preset of engine settings (flags override it)")
    for section in section_classes().values():
        add_config_flags(group, section)
    add_config_flags(group, EngineConfig)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser.add_argument_group("server"), ServerConfig)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings given on the command line (LLM(...) keywords), `config` included."""
    names = [f.name for section in section_classes().values()
             for f in dataclasses.fields(section)]
    names += [f.name for f in dataclasses.fields(EngineConfig)
              if f.name not in section_classes()]
    kwargs = {name: getattr(args, name, None) for name in names}
    kwargs["model"] = getattr(args, "model_pos", None) or kwargs["model"]
    kwargs["config"] = args.config
    return {k: v for k, v in kwargs.items() if v is not None}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kwargs = engine_kwargs(args)
    config_path = kwargs.pop("config", None)
    if config_path is not None:
        return EngineConfig.from_yaml(config_path, **kwargs)
    return EngineConfig.from_kwargs(**kwargs)


def server_config(args: argparse.Namespace) -> ServerConfig:
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in given.items() if v is not None})


def make_llm(args: argparse.Namespace, **extra: Any) -> Any:
    """LLM from the engine flags; a bad setting exits with a one-line error."""
    from pagedserve.engine.llm import LLM

    try:
        return LLM(**engine_kwargs(args), **extra)
    except ValueError as exc:
        raise SystemExit(f"pagedserve: error: {exc}") from None
