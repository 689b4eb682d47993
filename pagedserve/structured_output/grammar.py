"""A guided-decoding spec (kind, text) -> an xgrammar Grammar, with errors a client can read.

Parsing needs no tokenizer, so `SamplingParams` checks a spec when it is made and a bad schema,
regex or grammar never reaches the engine. Compiling against the vocabulary is the manager's.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Compiled grammars a cache keeps (a compiled JSON schema over a 50k vocabulary is tens of KiB
# to a few MiB); the least recently used goes first.
CACHE_ENTRIES = 512
# The kinds of GuidedDecodingParams, in the order its fields are declared.
GRAMMAR_KINDS = ("json", "regex", "choice", "grammar", "json_object")

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def missing_package(package: str) -> str:
    """Why a guided request is refused where `package` cannot be imported. Only guided
    requests need it: the engine runs the others without it."""
    return (f"guided decoding needs the {package} package, which cannot be imported here (pip "
            f"install {package}); requests without a grammar run without it")


def import_xgrammar() -> Any:
    """xgrammar, imported on first use (it takes seconds); a ValueError naming the package
    where it is missing, so a guided request is refused, not failed."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(missing_package("xgrammar")) from None
    return xgrammar


def grammar_key(kind: str, value: Any, any_whitespace: bool = False) -> tuple[str, str]:
    """The cache key of a spec: its kind and a canonical text. A schema's keys keep their
    order: properties are generated in the order the schema lists them. `any_whitespace`:
    JSON may hold any whitespace between tokens ("json+ws"); by default it is compact, as a
    small model would otherwise spend its tokens on blank lines."""
    if kind == "json":
        try:
            if isinstance(value, str):
                value = json.loads(value)
            text = json.dumps(value, ensure_ascii=False)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        except RecursionError:  # a request body may nest about as deep as the limit
            raise ValueError("the JSON schema is nested too deeply") from None
        return "json+ws" if any_whitespace else kind, text
    if kind == "choice":
        return kind, json.dumps(list(value), ensure_ascii=False)
    if kind == "json_object":
        return kind, ""
    return kind, value


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse_grammar(key: tuple[str, str]) -> Any:
    """The xgrammar Grammar of a key from `grammar_key`; ValueError naming what is wrong."""
    xgr = import_xgrammar()
    kind, text = key
    try:
        if kind in ("json", "json+ws"):
            check_json_schema(json.loads(text))
            return xgr.Grammar.from_json_schema(text, any_whitespace=kind == "json+ws")
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    except Exception as exc:  # xgrammar's C++ errors come as RuntimeError, others as they may
        raise ValueError(f"invalid {_WHAT[kind]}: {_clean(exc)}") from None
    raise ValueError(f"unknown guided decoding kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")


_WHAT = {"json": "JSON schema", "json+ws": "JSON schema", "regex": "regex", "choice": "choice list",
         "grammar": "EBNF grammar", "json_object": "JSON object grammar"}


def check_json_schema(schema: Any) -> None:
    """The schema against its metaschema (jsonschema's checker): the grammar libraries ignore
    keywords they do not know, so a typo such as {"type": "strnig"} would otherwise pass
    silently in places."""
    import jsonschema

    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"{exc.message}" + (f" (at {where})" if where else "")) from None
    except Exception as exc:  # e.g. a $schema URI jsonschema cannot resolve
        raise ValueError(str(exc) or type(exc).__name__) from None


def _clean(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
