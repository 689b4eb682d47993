"""A request's structured-output fields -> the engine's GuidedDecodingParams: OpenAI's
response_format, vLLM's guided_* fields, and the grammar that makes tool_choice "required" or a
named function produce calls whose arguments parse. Errors are 400s naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pagedserve.sampling_params import GuidedDecodingParams, SamplingParams
from pagedserve.server import protocol as p
from pagedserve.server.common import ApiError, ServerState

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_decoding(body: p.SamplingRequest) -> tuple[GuidedDecodingParams | None, str | None]:
    """The request's grammar and the field it came from (for errors), or (None, None)."""
    given = [name for name in GUIDED_FIELDS if getattr(body, name) is not None]
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
    if body.guided_whitespace_pattern is not None:
        raise ApiError(400, "guided_whitespace_pattern is not supported (the JSON of a schema is "
                            "compact)", param="guided_whitespace_pattern")
    if len(given) > 1:
        raise ApiError(400, f"give at most one of response_format and the guided_* fields, got "
                            f"{', '.join(given)}", param=given[1])
    if not given:
        return None, None
    field = given[0]
    spec: dict[str, Any]
    if field == "response_format":
        assert fmt is not None
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise ApiError(400, "response_format json_object takes no json_schema",
                               param="response_format.json_schema")
            spec = {"json_object": True}
        else:
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema",
                               param="response_format.json_schema")
            spec = {"json": fmt.json_schema.json_schema}
    else:
        spec = {field.removeprefix("guided_"): getattr(body, field)}
    return _checked(spec, field), field


def tool_call_guided(tools: list[p.ChatTool], choice: str | p.NamedToolChoice,
                     parallel: bool) -> GuidedDecodingParams:
    """tool_choice "required": a JSON array of {"name", "arguments"} objects, each valid for
    its tool (one call unless `parallel`); a named function: that tool's arguments object."""
    if isinstance(choice, p.NamedToolChoice):
        tool = find_tool(tools, choice.function.name)
        return _checked({"json": _parameters(tool)}, "tool_choice")
    # Each call object's place in the array's schema, where its tool's local $refs now point.
    places = ["#/items"] if len(tools) == 1 else [f"#/items/anyOf/{i}" for i in range(len(tools))]
    calls = []
    for i, (tool, place) in enumerate(zip(tools, places, strict=True)):
        try:
            arguments = _relocated(_parameters(tool), f"{place}/properties/arguments")
        except RecursionError:  # a body may nest deeper than the interpreter recurses
            raise ApiError(400, f"tools.{i}.function.parameters: the JSON schema is nested too "
                                "deeply", param=f"tools.{i}.function.parameters") from None
        calls.append({"type": "object",
                      "properties": {"name": {"const": tool.function.name},
                                     "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return _checked({"json": schema}, "tools")


def find_tool(tools: list[p.ChatTool], name: str) -> p.ChatTool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise ApiError(400, f"tool_choice names function {name!r}, which is not among the tools",
                   param="tool_choice")


def _parameters(tool: p.ChatTool) -> dict[str, Any]:
    # No parameters: a function of no arguments takes an empty object.
    params = tool.function.parameters
    return params if params is not None else {"type": "object", "properties": {}}


# Keys whose values are JSON values, not schemas: a "$ref" inside them is data. And keys whose
# values map names (of properties, definitions) to schemas: a property may be called "default".
_VALUE_KEYS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})


def _relocated(schema: Any, pointer: str) -> Any:
    """`schema` as a part of a larger schema at `pointer`: its local $refs ("#/$defs/X", or
    "#" itself) point into it there, not at the larger schema's root. Pydantic (and so the
    Agents SDK) keeps a tool's types in $defs; two tools' $defs may share names."""
    if isinstance(schema, list):
        return [_relocated(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = pointer + value[1:]
        elif key in _VALUE_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _relocated(sub, pointer) for name, sub in value.items()}
        else:
            out[key] = _relocated(value, pointer)
    return out


def _checked(spec: dict[str, Any], field: str) -> GuidedDecodingParams:
    try:
        return GuidedDecodingParams(**spec)
    except ValueError as exc:
        message = str(exc)
        if message.startswith("guided_decoding."):
            message = message.split(": ", 1)[-1]
        raise ApiError(400, f"{field}: {message}", param=field) from None


async def with_guided(state: ServerState, params: SamplingParams,
                      guided: GuidedDecodingParams | None, field: str | None) -> SamplingParams:
    """`params` with the grammar, compiled now in a worker thread (the engine thread then finds
    it in the cache): a grammar that cannot be compiled is this request's 400."""
    if guided is None:
        return params
    try:
        await asyncio.to_thread(state.llm.engine.structured_output.compile, guided)
    except ValueError as exc:
        raise ApiError(400, f"{field}: {exc}", param=field) from None
    return dataclasses.replace(params, guided_decoding=guided)
