"""What a chat request's tools and tool_choice mean for it: the mode its reply is read in
(chat_output), the grammar that enforces "required" and named choices, and how the tools
reach the prompt (the template's tools section, or a system message the server writes when the
template has none, as the bundled SmolLM2's has not)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.server import protocol as p
from pagedserve.server.chat_output import ChatChoiceParser
from pagedserve.server.common import ApiError, ServerState
from pagedserve.server.guided import find_tool, tool_call_guided
from pagedserve.server.tool_parsers import HermesToolParser, ParsedCall, ToolParser


@dataclass
class ToolPrompt:
    """The tools as the prompt shows them."""

    tools: list[dict[str, Any]]
    parser: ToolParser  # how earlier calls are written when the template cannot
    instructions: str  # the system text for a template without a tools section

    def apply(self, messages: list[dict[str, Any]], template: str
              ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
        """(tools for the template, or None; the messages to render)."""
        if "tools" in template:
            return self.tools, messages
        out = calls_as_text(messages, template, self.parser)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]
            out[0] = {**first, "content": f"{first['content']}\n\n{self.instructions}"}
        else:
            out.insert(0, {"role": "system", "content": self.instructions})
        return None, out


def calls_as_text(messages: list[dict[str, Any]], template: str, parser: ToolParser
                  ) -> list[dict[str, Any]]:
    """Earlier assistant tool calls written into their message's text in `parser`'s format,
    for a template with no place for them: it would drop them, and the model would read the
    results of calls it never made (a request without tools, or with tool_choice "none",
    still holds the calls of its earlier turns)."""
    if "tool_calls" in template:
        return messages
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            parsed: list[ParsedCall] = [(c["function"]["name"], c["function"]["arguments"])
                                        for c in calls]
            text = parser.format_calls(parsed)
            message = {**message, "content": f"{message['content']}\n{text}".strip()}
            message.pop("tool_calls")
        out.append(message)
    return out


@dataclass
class ToolPlan:
    mode: str  # text, auto, required, named
    function_name: str | None = None
    guided: GuidedDecodingParams | None = None
    prompt: ToolPrompt | None = None
    parallel: bool = True  # parallel_tool_calls

    def parser(self, state: ServerState) -> ChatChoiceParser:
        return ChatChoiceParser(self.mode, state.reasoning_parser, state.tool_parser,
                                self.function_name, self.parallel)


def tool_plan(state: ServerState, body: p.ChatCompletionRequest) -> ToolPlan:
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan("text")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique", param="tools")
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan("text")
    described = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        if state.tool_parser is None:
            raise ApiError(400, 'tool_choice "auto" needs the server started with '
                                "--tool-call-parser (\"required\" or a named function need "
                                "none)", param="tool_choice")
        parser = state.tool_parser
        return ToolPlan("auto", prompt=ToolPrompt(described, parser,
                                                  parser.system_prompt(described)),
                        parallel=body.parallel_tool_calls)
    writer = state.tool_parser or HermesToolParser()
    if choice == "required":
        guided = tool_call_guided(tools, "required", body.parallel_tool_calls)
        text = ("Call one or more of these functions (JSON schemas). Answer with a JSON list "
                'of calls: [{"name": ..., "arguments": {...}}]\n'
                + "\n".join(map(_json, described)))
        return ToolPlan("required", guided=guided, prompt=ToolPrompt(described, writer, text))
    assert isinstance(choice, p.NamedToolChoice)
    tool = find_tool(tools, choice.function.name)
    guided = tool_call_guided(tools, choice, body.parallel_tool_calls)
    text = (f"Call the function {tool.function.name}. Answer with its arguments as a JSON "
            f"object. The function:\n{_json(tool.model_dump(exclude_none=True))}")
    return ToolPlan("named", tool.function.name, guided,
                    ToolPrompt(described, writer, text))


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
